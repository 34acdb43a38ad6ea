"""torchtitan scenarios, run by tests/test_torchtitan.py under torchrun with 2 CPU processes (gloo).

A tiny GPT (integrations/model.py, fused attn.c_attn split into Q, K, V) set up as torchtitan's
Trainer sets up a model: `use_shardopt` on the config fields the Trainer reads (torchtitan's own
ParallelismConfig(data_parallel_replicate_degree=2, spmd_backend="partial_dtensor"),
TrainingConfig(max_norm=1.0) and ModelSpec; Trainer.Config itself imports triton, absent on a CPU
machine), ParallelDims.from_config (its build_mesh takes the device type from torchtitan.tools.utils,
"cuda" on a machine without an accelerator: set to "cpu" here), the model spec's parallelize_fn
(written like torchtitan's parallelize_llama: fully_shard on ["dp_replicate", "fsdp"] when
dp_replicate is enabled, else on ["fsdp"]) called with the Trainer's arguments, then torchtitan's own
classes: config.optimizer.build(model_parts=…), LRSchedulersContainer.Config(…).build(…),
CheckpointManager.Config(…).build(…):
- 6 steps, a checkpoint at step 3 and 6: replicas bitwise identical, replicate bytes per step
  (comm_stats), momenta different between saves and equal at each save; a fresh container loaded
  from the step-3 checkpoint by the CheckpointManager ends bitwise where the uninterrupted run ended
  (weights, optimizer state, lr);
- per-pattern groups (torchtitan's ParamGroupConfig) with a fused-qkv split train and stay identical;
- refused with a message: no lr, an unknown optimizer_name, splits beside param_groups, a pattern
  list that leaves params out, the stock HSDP parallelize (without shard_only), plain params on 2 ranks.
Each rank writes its measurements to $SHARDOPT_TEST_OUT/result-<rank>.json.
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims
from torch.distributed.fsdp import fully_shard
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.model_spec import ModelSpec

from shardopt.torchtitan import ShardoptOptimizersContainer, shard_only, use_shardopt
from two_processes import finish

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
from model import GPT, GPTConfig  # noqa: E402

OUT = Path(os.environ["SHARDOPT_TEST_OUT"])
CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
QKV = (0, (CONFIG.n_embd,) * 3)
SAVE_AT, TOTAL, BATCH = 3, 6, 8
AUTO = dict(algorithm="signmuon", options={"lr": 0.02}, nonmatrix_options={"lr": 1e-3}, splits={"attn.c_attn": QKV})
PATTERNS = dict(algorithm="signmuon", options={"lr": 0.02}, param_groups=[
    ParamGroupConfig(pattern=r"c_attn\.weight$", optimizer_name="signmuon", optimizer_kwargs={"split": QKV}),
    ParamGroupConfig(pattern=r"\.h\.\d+\.(attn\.c_proj|mlp)\.", optimizer_name="signmuon"),
    ParamGroupConfig(pattern=r".*", optimizer_name="lion", optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.0})])


class TrainState:
    """The step, saved beside the model, optimizer and lr scheduler (torchtitan's Trainer saves itself)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def parallelize_gpt(model, *, parallel_dims, **_):  # (training, parallelism, compile_config, ac_config, dump_folder)
    """FSDP2 as torchtitan's parallelize functions apply it (models/llama3/parallelize.py)."""
    mesh = parallel_dims.get_mesh(["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"])
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@dataclass
class TrainerConfigFields:
    """The fields of torchtitan's Trainer.Config that use_shardopt reads and sets (see the module docstring)."""
    parallelism: ParallelismConfig
    training: TrainingConfig
    model_spec: ModelSpec
    optimizer: OptimizersContainer.Config | None = None


def trainer_config():
    spec = ModelSpec(name="gpt", flavor="tiny", model=None, parallelize_fn=parallelize_gpt, pipelining_fn=None,
                     post_optimizer_build_fn=None, state_dict_adapter=None)
    fields = TrainerConfigFields(ParallelismConfig(data_parallel_replicate_degree=2, spmd_backend="partial_dtensor"),
                                 TrainingConfig(max_norm=1.0), spec)
    return use_shardopt(fields, **AUTO)


def build(parallel_dims, config, parallelize=None):
    """A fresh model (same initial weights on every rank), parallelized as torchtitan's Trainer does it
    (parallelize: the model spec's parallelize_fn, or None: plain), its optimizers and lr schedulers."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if parallelize is not None:
        model = parallelize(model, parallel_dims=parallel_dims, training=TrainingConfig(), parallelism=None,
                            compile_config=None, ac_config=None, dump_folder=str(OUT))
    optimizers = config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5, min_lr_factor=0.1).build(
        optimizers=optimizers, training_steps=TOTAL)
    return model, optimizers, schedulers


def checkpointer(model, optimizers, schedulers, state):
    return CheckpointManager.Config(enable=True, folder="checkpoint", interval=SAVE_AT, keep_latest_k=0).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None, base_folder=str(OUT))


def batch(step):
    """This replica's batch at `step` (the replicas see different data)."""
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def momenta_equal_across_ranks(optimizer) -> bool:
    rows = torch.cat([local(optimizer.state[p][key]).reshape(-1) for group in optimizer.param_groups
                      for p in group["params"] for key in ("momentum", "exp_avg") if key in optimizer.state[p]])
    out = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
    dist.all_gather(out, rows)
    return all(torch.equal(row, out[0]) for row in out)


def train(model, optimizers, schedulers, state, steps, saver=None, record=None):
    optimizer = optimizers.optimizers[0]
    for step in steps:
        loss = model(*batch(step))[1]
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.step = step
        if record is not None:
            record["bytes"].append(optimizer.comm_stats()["replicate"]["bytes_sent"])
            record["momenta_equal_between_saves"].append(momenta_equal_across_ranks(optimizer))
        if saver is not None and saver.save(curr_step=step):
            record["momenta_equal_at_saves"].append(momenta_equal_across_ranks(optimizer))


def snapshot(model, optimizers, schedulers):
    tensors = [local(p).detach().clone() for p in model.parameters()]
    tensors += [local(v).clone() for s in optimizers.optimizers[0].state.values() for v in s.values()]
    return tensors, schedulers.schedulers[0].get_last_lr()


def same(a, b) -> bool:
    return a[1] == b[1] and len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))


def hsdp(parallel_dims):
    config = trainer_config()
    model, optimizers, schedulers = build(parallel_dims, config.optimizer, config.model_spec.parallelize_fn)
    state = TrainState()
    record = {"bytes": [], "momenta_equal_between_saves": [], "momenta_equal_at_saves": []}
    train(model, optimizers, schedulers, state, range(1, TOTAL + 1), checkpointer(model, optimizers, schedulers, state),
          record)
    optimizer = optimizers.optimizers[0]
    final = snapshot(model, optimizers, schedulers)
    groups = [(g["algorithm"], len(g["params"]), g.get("split")) for g in optimizer.param_groups]
    params = sum(p.numel() for p in model.parameters())

    resumed_model, resumed_optimizers, resumed_schedulers = build(parallel_dims, config.optimizer,
                                                                  config.model_spec.parallelize_fn)
    resumed_state = TrainState()
    resumed_saver = checkpointer(resumed_model, resumed_optimizers, resumed_schedulers, resumed_state)
    loaded = resumed_saver.load(step=SAVE_AT)
    resumed_from = resumed_state.step
    resumed_record = {"bytes": [], "momenta_equal_between_saves": [], "momenta_equal_at_saves": []}
    train(resumed_model, resumed_optimizers, resumed_schedulers, resumed_state, range(resumed_state.step + 1, TOTAL + 1),
          resumed_saver, resumed_record)   # (it saves at step 6 too: the momenta averaged there as in the first run)
    per_step = [b - a for a, b in zip([0] + record["bytes"], record["bytes"])]
    return {"max_norm": config.training.max_norm, "max_grad_norm": config.optimizer.options["max_grad_norm"],
            "groups": groups, "params": params, "replicas_consistent": optimizer.replicas_consistent(),
            "bytes_per_step": per_step, "saved_after": SAVE_AT, "fp32_all_reduce_bytes": 2 * (2 - 1) * 4 * params // 2,
            "momenta_equal_between_saves": record["momenta_equal_between_saves"],
            "momenta_equal_at_saves": record["momenta_equal_at_saves"], "loaded": loaded,
            "resumed_from": resumed_from if loaded else None, "lr": final[1],
            "resume_bit_exact": same(final, snapshot(resumed_model, resumed_optimizers, resumed_schedulers))}


def patterns(parallel_dims):
    config = ShardoptOptimizersContainer.Config(**PATTERNS)
    model, optimizers, schedulers = build(parallel_dims, config, shard_only(parallelize_gpt))
    train(model, optimizers, schedulers, TrainState(), range(1, 3))
    optimizer = optimizers.optimizers[0]
    return {"groups": [(g["algorithm"], len(g["params"]), g.get("split")) for g in optimizer.param_groups],
            "replicas_consistent": optimizer.replicas_consistent(),
            "replicate_bytes": optimizer.comm_stats()["replicate"]["bytes_sent"]}


def refused(parallel_dims):
    shardopt_parallelize = shard_only(parallelize_gpt)
    cases = {"no_lr": ({"options": {}}, shardopt_parallelize),
             "optimizer_name": ({"options": {"lr": 0.02}, "param_groups": [
                 ParamGroupConfig(pattern=".*", optimizer_name="AdamW")]}, shardopt_parallelize),
             "splits_beside_param_groups": ({**PATTERNS, "splits": {"attn.c_attn": QKV}}, shardopt_parallelize),
             "unmatched": ({"options": {"lr": 0.02}, "param_groups": PATTERNS["param_groups"][:2]}, shardopt_parallelize),
             "stock_hsdp": (AUTO, parallelize_gpt),
             "plain_params": (AUTO, None),
             "overlap_backward": ({**AUTO, "options": {**AUTO["options"], "overlap_backward": True}}, shardopt_parallelize)}
    errors = {}
    for name, (fields, parallelize) in cases.items():
        try:
            build(parallel_dims, ShardoptOptimizersContainer.Config(**fields), parallelize)
            errors[name] = None
        except ValueError as error:
            errors[name] = str(error)
    fields = trainer_config()
    fields.parallelism.spmd_backend = "spmd_types"
    try:
        use_shardopt(fields, **AUTO)
        errors["spmd_backend"] = None
    except ValueError as error:
        errors["spmd_backend"] = str(error)
    return errors


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torchtitan.distributed.parallel_dims.device_type = "cpu"
    dims = ParallelDims.from_config(trainer_config().parallelism, world_size=dist.get_world_size())
    dims.build_mesh()
    result = {"hsdp": hsdp(dims), "patterns": patterns(dims), "refused": refused(dims)}
    finish(OUT / f"result-{dist.get_rank()}.json", result)
