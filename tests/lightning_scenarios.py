"""Lightning scenarios, run by tests/test_lightning.py under torchrun with 2 CPU processes (gloo).

A tiny GPT (integrations/model.py) with Sign-Muon + Lion-vote (`shardopt.param_groups(model, "signmuon",
"lion")`) under `lightning.Trainer(strategy="ddp", callbacks=[ShardoptCallback()])`, 2 epochs of 3
optimizer steps, accumulate_grad_batches=2, a checkpoint at each epoch end:
- ddp: replicas bitwise identical, replicate bytes per step (comm_stats) against an fp32 all-reduce,
  momenta different between saves and equal at each save; resumed from the epoch-1 checkpoint it ends
  bitwise where the uninterrupted run ended (weights and optimizer state);
- fsdp2: the same model under ModelParallelStrategy with fully_shard over its data-parallel mesh in
  configure_model (the shard axis, no replicate axis), resumed bit-exact from Lightning's distributed
  checkpoint; hsdp: the same with the data-parallel ranks as a (replicate, shard) = (2, 1) mesh,
  fully_shard over "shard" and the optimizer's replicate_mesh "replicate";
- overlap: DDP with overlap_backward off and on (max_grad_norm=0): bitwise, the same bytes, the exchange begun in
  the backward of each step's last micro-batch;
- refused: gradient_clip_val, an optimizer without replicate_mesh under DDP, LocalSteps.
Each rank writes its measurements to $SHARDOPT_TEST_OUT/result-<rank>.json.
"""

import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import shardopt
from shardopt.lightning import ShardoptCallback
from two_processes import finish

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
from model import GPT, GPTConfig  # noqa: E402

OUT = Path(os.environ["SHARDOPT_TEST_OUT"])
CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
STEPS_PER_EPOCH, EPOCHS, ACCUMULATE, BATCH = 3, 2, 2, 4


class LitGPT(L.LightningModule):
    """fsdp: None (DDP), "fsdp" (fully_shard over ModelParallelStrategy's data-parallel mesh) or "hsdp"
    (a (replicate, shard) = (2, 1) mesh of the data-parallel ranks: fully_shard over "shard", the
    optimizer on "replicate")."""

    def __init__(self, fsdp: str | None = None, replicate: bool = True, **options):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(CONFIG)
        self.fsdp, self.replicate, self.replicate_mesh, self.options = fsdp, replicate, None, options

    def configure_model(self):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        if not self.fsdp:
            return
        mesh = self.device_mesh["data_parallel"]
        if self.fsdp == "hsdp":
            hsdp = init_device_mesh("cpu", (mesh.size(), 1), mesh_dim_names=("replicate", "shard"))
            mesh, self.replicate_mesh = hsdp["shard"], hsdp["replicate"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch):
        return self.model(*batch)[1]

    def configure_optimizers(self):
        groups = shardopt.param_groups(self, "signmuon", "lion", nonmatrix_options={"lr": 1e-3})
        replicate_mesh = self.replicate_mesh if self.fsdp else dist.group.WORLD if self.replicate else None
        return shardopt.SignMuon(groups, lr=0.02, replicate_mesh=replicate_mesh, **{"max_grad_norm": 1.0, **self.options})


class LitLocalSteps(LitGPT):
    """LocalSteps from configure_optimizers: refused by ShardoptCallback."""

    def configure_optimizers(self):
        return shardopt.LocalSteps(torch.optim.SGD(self.parameters(), lr=0.01), replicate_mesh=dist.group.WORLD,
                                   sync_every=4)


def loader():
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (2 * STEPS_PER_EPOCH * ACCUMULATE * BATCH, CONFIG.block_size + 1),
                           generator=generator)
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (its shard of a DTensor)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def gathered(tensors) -> torch.Tensor:
    """(world, n) float64: every rank's (local) tensors, flattened."""
    local_rows = torch.cat([local(t).detach().to(torch.float64).reshape(-1) for t in tensors])
    out = [torch.empty_like(local_rows) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local_rows)
    return torch.stack(out)


def momenta(optimizer):
    return [optimizer.state[p][key] for group in optimizer.param_groups for p in group["params"]
            for key in ("momentum", "exp_avg") if key in optimizer.state[p]]


class Record(Callback):
    """Replicate bytes after each optimizer step; whether the replicas' momenta agree between saves and at saves;
    how many bucket steps had begun in backward before each optimizer step."""

    def __init__(self):
        self.bytes, self.momenta_equal_between, self.momenta_equal_at_save, self.started = [], [], [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        ours = trainer.optimizers[0]    # bucket steps begun in backward (overlap_backward)
        self.started.append(ours.backward_overlap.started() if ours.backward_overlap is not None else 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > len(self.bytes):
            optimizer = trainer.optimizers[0]
            self.bytes.append(optimizer.comm_stats()["replicate"]["bytes_sent"])
            rows = gathered(momenta(optimizer))
            self.momenta_equal_between.append(bool((rows == rows[0]).all()))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        rows = gathered(momenta(trainer.optimizers[0]))
        self.momenta_equal_at_save.append(bool((rows == rows[0]).all()))


def fit(directory, module, ckpt_path=None, strategy="ddp", **trainer_options):
    record = Record()
    checkpoint = ModelCheckpoint(dirpath=directory, every_n_epochs=1, save_top_k=-1)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=EPOCHS,
                        accumulate_grad_batches=ACCUMULATE, callbacks=[ShardoptCallback(), record, checkpoint],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, **trainer_options)
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    optimizer = trainer.optimizers[0]
    return trainer, optimizer, record


def local_tensors(module, optimizer):
    """This rank's weights and optimizer state tensors (local shards under FSDP2)."""
    tensors = [local(p).detach().clone() for p in module.parameters()]
    params = [p for group in optimizer.param_groups for p in group["params"]]   # state in param order
    return tensors + [local(v).clone() for p in params for v in optimizer.state[p].values()]


def bitwise_equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def train_and_resume(kind: str | None = None) -> dict:
    """6 steps with checkpoints after 3 and 6, then a fresh module resumed from step 3 to 6; kind: None (DDP),
    "fsdp" or "hsdp" (ModelParallelStrategy, see LitGPT)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    def strategy():
        return "ddp" if kind is None else ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    name = kind or "ddp"
    module = LitGPT(fsdp=kind)
    trainer, optimizer, record = fit(OUT / name, module, strategy=strategy())
    final = local_tensors(module, optimizer)
    resumed_module = LitGPT(fsdp=kind)
    _, resumed_optimizer, _ = fit(OUT / f"{name}_resumed", resumed_module, strategy=strategy(),
                                  ckpt_path=OUT / name / "epoch=0-step=3.ckpt")
    params = sum(p.numel() for p in LitGPT().parameters())   # (the whole model: under FSDP2 module holds shards)
    stats = optimizer.comm_stats()
    result = {"steps": trainer.global_step, "saved_after": STEPS_PER_EPOCH, "params": params,
              "replicas_consistent": optimizer.replicas_consistent(),
              "sharded": all(hasattr(p, "to_local") for p in module.parameters()),
              "shard_bytes": stats["shard"]["bytes_sent"], "replicate_bytes": stats["replicate"]["bytes_sent"],
              "bytes_per_step": [b - a for a, b in zip([0] + record.bytes, record.bytes)],
              "fp32_all_reduce_bytes": 2 * (dist.get_world_size() - 1) * 4 * params // dist.get_world_size(),
              "momenta_equal_between_saves": record.momenta_equal_between,
              "momenta_equal_at_saves": record.momenta_equal_at_save,
              "resume_bit_exact": bitwise_equal(final, local_tensors(resumed_module, resumed_optimizer))}
    if kind is None:
        result["trained"] = not torch.equal(final[0], next(LitGPT().parameters()))
    return result


def overlap_backward() -> dict:
    """DDP, max_grad_norm=0, overlap_backward off and on: weights and state, all replicate bytes, work begun in backward."""
    runs = []
    for on in (False, True):
        module = LitGPT(max_grad_norm=0.0, overlap_backward=on)
        _, optimizer, record = fit(OUT / f"overlap_{on}", module)
        runs.append((local_tensors(module, optimizer), optimizer.comm_stats()["replicate"]["bytes_sent"], record.started))
    (off, off_bytes, off_started), (on, on_bytes, on_started) = runs
    return {"bitwise": bitwise_equal(off, on), "bytes": [off_bytes, on_bytes], "started": [off_started, on_started]}


def refused():
    errors = {}
    for name, module, options in (("gradient_clip_val", LitGPT(), {"gradient_clip_val": 1.0}),
                                  ("no_replicate_mesh", LitGPT(replicate=False), {}),
                                  ("local_steps", LitLocalSteps(), {})):
        try:
            fit(OUT / name, module, **options)
            errors[name] = None
        except (ValueError, RuntimeError) as error:
            errors[name] = str(error)
    return errors


if __name__ == "__main__":
    result = {"ddp": train_and_resume(), "fsdp2": train_and_resume("fsdp"), "hsdp": train_and_resume("hsdp"),
              "overlap": overlap_backward(), "refused": refused()}
    finish(OUT / f"result-{dist.get_rank()}.json", result)
