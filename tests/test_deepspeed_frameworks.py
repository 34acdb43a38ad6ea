"""shardopt.deepspeed.register(): frameworks that call deepspeed.initialize themselves get shardopt's optimizer
from a DeepSpeed JSON config. Two gloo ranks (one worker pool for the module), CPU accelerator, a tiny GPT-2
(transformers' GPT2LMHeadModel from a GPT2Config, nothing downloaded). Pinned here:
- HF Trainer with TrainingArguments(deepspeed="ds_config.json") naming "SignMuon" (non-matrix params on Lion's vote), at
  ZeRO 0 (every rank a replica) and ZeRO 2 (mesh 2 × 1: each rank a node of its own, so the replicate axis has
  2 ranks): replicas bitwise identical, replicate-axis bytes per step ≤ 1/25 of an fp32 all-reduce of every
  parameter, and Trainer's resume from its checkpoint bit-exact (4 steps straight = 2, save, resume, 2);
- Accelerate with DeepSpeedPlugin(hf_ds_config=config) and DummyOptim: the same;
- the docs' blocks (docs/trainers.md) run as shown; the shipped configs pass HF's and Accelerate's own config
  processing ("auto" placeholders); register() is idempotent and unregister() restores deepspeed.initialize;
  Accelerate counting one process (no backend found on a CPU-only machine) is refused, naming the setting;
- HF Trainer with TrainingArguments(use_cpu=True) keeps DeepSpeed (bitwise the run of the gloo recipe), while
  Accelerator(cpu=True) leaves it out; "lr": "auto" filled with TrainingArguments' default learning_rate warns;
- ZeRO 3 (the 2 ranks one node, each weight kept on its owner): HF Trainer with from_pretrained under zero.Init
  and Accelerate's DeepSpeedPlugin(hf_ds_config=...) train bitwise as stage 2; Trainer's evaluate / generate match,
  trainer.save_model and Accelerate's get_state_dict + save_pretrained write the whole trained weights, and the
  Trainer resumes bit-exact; DeepSpeedPlugin(zero_stage=3) around a shardopt optimizer is refused;
- Lightning's DeepSpeedStrategy is not run: it refuses any accelerator but CUDA (pinned, so the docs' reason holds).
"""

import copy
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

missing = [name for name in ("deepspeed", "transformers", "accelerate") if importlib.util.find_spec(name) is None]
if missing:
    pytest.skip(f"{' and '.join(missing)} not installed (pip install 'shardopt[deepspeed,hf]')", allow_module_level=True)

import deepspeed  # noqa: E402  (imported before the pool forks: the workers inherit it)
pytestmark = pytest.mark.usefixtures("deepspeed_cpu_ops")   # the CPU op compiled before the pool forks
import transformers  # noqa: E402,F401

import shardopt.deepspeed as sds  # noqa: E402
from docblocks import python_block  # noqa: E402
from shardopt.wire.comm import collective_bytes  # noqa: E402
from shardopt.deepspeed.config import plugin_setup  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240
STEPS = 4
SIGNMUON_LION = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "SignMuon", "params": {"lr": "auto", "momentum": 0.9, "vote": "fewest_bytes"}},
    "shardopt": {"nonmatrix_algorithm": "lion", "nonmatrix": {"lr": 3e-4}},
}


# ---- helpers run on the workers -----------------------------------------------------------------
def _env() -> None:
    """What torchrun would set; Accelerate's shared state given its backend on this CPU-only machine (the
    docs' recipe), a fresh AcceleratorState for each run (each Trainer / Accelerator builds its own); and
    shardopt registered (on the workers only)."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", ACCELERATE_USE_DEEPSPEED="true")
    AcceleratorState._reset_state(reset_partial_state=False)
    PartialState(backend="gloo")
    sds.register()


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0))


class Tokens(torch.utils.data.Dataset):
    """64 fixed random sequences (the samplers of Trainer / Accelerate give each rank its own)."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def _config(stage: int, local_steps: dict | None = None, one_node: bool = False) -> dict:
    """`one_node`: the 2 ranks one node (the default mesh at stages 1-3: ZeRO partitions over both)."""
    config = copy.deepcopy(SIGNMUON_LION)
    config["zero_optimization"] = {"stage": stage}
    if local_steps:
        config["shardopt"]["local_steps"] = local_steps
    if stage and not one_node:    # 2 ranks as 2 nodes of 1: the replicate axis is the one across nodes
        config["shardopt"]["mesh"] = {"replicate": 2, "shard": 1}
    return config


def _fp32_allreduce_bytes(model) -> int:
    return collective_bytes("all_reduce", 4 * sum(p.numel() for p in model.parameters()), dist.get_world_size())


def _as_a_fresh_process() -> None:
    """Accelerate's state and environment as a fresh torchrun process has them (nothing configured, no
    ACCELERATE_USE_DEEPSPEED); the process group stays. Reset again after use (_env configures the next run)."""
    from accelerate.state import AcceleratorState
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    AcceleratorState._reset_state(reset_partial_state=True)


def _hf_trainer(directory, stage, resume, local_steps=None, use_cpu=False, steps=STEPS, callbacks=(), save_to=None,
                pretrained=None, bf16=False):
    """Trainer to `steps` steps, saving at STEPS/2; `resume`: from that checkpoint of an earlier run in `directory`;
    `use_cpu`: TrainingArguments(use_cpu=True) in a fresh process's state instead of the configured gloo state;
    `callbacks` after the one that reads the bytes at each step's end; `save_to`: trainer.save_model there after;
    `pretrained`: the model from_pretrained(pretrained) after TrainingArguments (under deepspeed.zero.Init at
    stage 3, as HF does it), the 2 ranks one node, then evaluated and saved with trainer.save_model; `bf16`:
    "bf16": {"enabled": "auto"} in the config and TrainingArguments(bf16=True) (with use_cpu: bf16 on a CPU)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    _env()
    if use_cpu:
        _as_a_fresh_process()
    sent = []

    class Bytes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):   # before Trainer saves at this step
            sent.append(sds.shard_optimizer(trainer.model_wrapped).comm_stats()["replicate"]["bytes_sent"])

    model = _model() if pretrained is None else None
    config = os.path.join(directory, "ds_config.json")    # as `--deepspeed ds_config.json` gives it
    if dist.get_rank() == 0 and not resume:
        Path(config).write_text(json.dumps({**_config(stage, local_steps, one_node=pretrained is not None),
                                            **({"bf16": {"enabled": "auto"}} if bf16 else {})}))
    dist.barrier()
    backend = {"use_cpu": True} if use_cpu else {"accelerator_config": {"use_configured_state": True}}
    args = TrainingArguments(output_dir=directory, deepspeed=config, learning_rate=3e-3,
                             per_device_train_batch_size=4, max_steps=steps, save_steps=STEPS // 2, logging_steps=1,
                             report_to=[], disable_tqdm=True, bf16=bf16, **backend)
    if pretrained is not None:
        model = type(_model()).from_pretrained(pretrained)
    zero_init = hasattr(next(model.parameters()), "ds_id")
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Bytes(), *callbacks])
    trainer.train(resume_from_checkpoint=os.path.join(directory, f"checkpoint-{STEPS // 2}") if resume else None)
    if save_to is not None:
        trainer.save_model(save_to)
    processes, deepspeed_enabled = trainer.accelerator.num_processes, trainer.is_deepspeed_enabled
    ours = sds.shard_optimizer(trainer.model_wrapped)
    per_step = [b - a for a, b in zip([0] + sent, sent)]
    with sds.gathered_weights(trainer.model_wrapped):
        named = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    weights = list(named.values())
    final = _evaluate_and_save(trainer, named) if pretrained is not None else {}
    result = {**final, "zero_init": zero_init, "weights": weights, "per_step": per_step,
              "sent": ours.comm_stats()["replicate"]["bytes_sent"], "consistent": ours.replicas_consistent(),
              "optimizer": type(ours).__name__,
              "allreduce": _fp32_allreduce_bytes(model), "algorithms": [g["algorithm"] for g in ours.param_groups],
              "engine_allreduce": trainer.model_wrapped.enable_backward_allreduce,
              "zero": getattr(ours, "inner", ours).zero.stage if getattr(ours, "inner", ours).zero else 0, "losses": [h["loss"] for h in trainer.state.log_history
                                                                       if "loss" in h],
              "processes": processes, "deepspeed_enabled": deepspeed_enabled}
    trainer.model_wrapped.destroy()
    if use_cpu:
        _as_a_fresh_process()
    return result


def _evaluate_and_save(trainer, named) -> dict:
    """trainer.evaluate's loss, greedy generate's tokens, and trainer.save_model's safetensors file (read back on rank
    0) against the trained weights `named` (gathered): whole and equal."""
    from safetensors.torch import load_file
    evaluated = trainer.evaluate(eval_dataset=torch.utils.data.Subset(Tokens(), range(16)))["eval_loss"]
    generated = trainer.model.generate(Tokens()[0]["input_ids"][None, :4], max_new_tokens=3, do_sample=False,
                                       pad_token_id=0)
    final = os.path.join(trainer.args.output_dir, "final")
    trainer.save_model(final)
    saved = load_file(os.path.join(final, "model.safetensors")) if dist.get_rank() == 0 else {}
    return {"eval_loss": evaluated, "generated": generated.tolist(), "saved_whole": dist.get_rank() != 0 or all(
        torch.equal(saved[name], weight) for name, weight in named.items() if name in saved) and
        {"transformer.wte.weight", "transformer.h.0.attn.c_attn.weight"} <= set(saved)}


def _hf_trainer_stage_3_door(directory, bf16=False):
    """One node of 2 ranks: stage 2 straight; stage 3 straight and resumed from its step-2 checkpoint; each from the
    same saved model, from_pretrained after TrainingArguments (stage 3: under deepspeed.zero.Init)."""
    pretrained = os.path.join(directory, "pretrained")
    if dist.get_rank() == 0:
        _model().save_pretrained(pretrained)
    dist.barrier()
    runs = {}
    for name, stage, resume in (("two", 2, False), ("three", 3, False), ("resumed", 3, True)):
        run_dir = os.path.join(directory, f"stage{stage}")
        os.makedirs(run_dir, exist_ok=True)
        runs[name] = _hf_trainer(run_dir, stage, resume, use_cpu=bf16, pretrained=pretrained, bf16=bf16)
    two, three, resumed = (runs[name].pop("weights") for name in ("two", "three", "resumed"))
    runs["bitwise"] = all(torch.equal(a, b) for a, b in zip(two, three))
    if dist.get_rank() == 0:   # the model file of Trainer's step-2 checkpoint, stage 3 against stage 2; at stage 3
        from safetensors.torch import load_file   # the head tied to wte is written once (as DeepSpeed's stage 3 does)
        files = [load_file(os.path.join(directory, f"stage{stage}", f"checkpoint-{STEPS // 2}", "model.safetensors"))
                 for stage in (2, 3)]
        runs["checkpoint_equal"] = set(files[0]) - set(files[1]) <= {"lm_head.weight"} and all(
            torch.equal(files[0][name], files[1][name]) for name in files[1]) and len(files[1]) > 20
    runs["resumed_equal"] = all(torch.equal(a, b) for a, b in zip(three, resumed))
    return runs


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_hf_trainer_at_stage_3_trains_as_stage_2_saves_the_whole_model_and_resumes_bit_exact(pool2, tmp_path, bf16):
    """TrainingArguments(deepspeed=config at stage 3) makes transformers build from_pretrained under zero.Init;
    shardopt gathers it, trains stage 2's math bitwise (weights released on the non-owner), evaluates with the
    module hooks gathering (evaluate, generate), and trainer.save_model writes the whole trained weights (the engine's
    _zero3_consolidated_16bit_state_dict, the one Accelerate's get_state_dict calls). bf16 (slow): the fp32 masters
    of the owned params, the saved weights bf16."""
    for rank, runs in enumerate(pool2.run(_hf_trainer_stage_3_door, str(tmp_path), bf16, timeout_s=TIMEOUT_S)):
        two, three = runs["two"], runs["three"]
        print(f"rank {rank} HF Trainer one node of 2: losses stage 2 {two['losses']} stage 3 {three['losses']}; "
              f"eval loss {two['eval_loss']} / {three['eval_loss']}")
        assert three["zero_init"] and not two["zero_init"] and three["zero"] == 3 and two["zero"] == 2
        assert three["losses"] == two["losses"] and runs["bitwise"] and three["consistent"]
        assert three["eval_loss"] == two["eval_loss"] and three["generated"] == two["generated"]
        assert three["saved_whole"] and two["saved_whole"]
        assert runs["resumed_equal"] and runs.get("checkpoint_equal", rank != 0)


def _hf_trainer_straight_and_resumed(directory, stage, local_steps=None):
    straight = _hf_trainer(directory, stage, resume=False, local_steps=local_steps)
    resumed = _hf_trainer(directory, stage, resume=True, local_steps=local_steps)
    straight["resumed_equal"] = all(torch.equal(a, b) for a, b in zip(straight.pop("weights"), resumed.pop("weights")))
    straight["resumed_per_step"] = resumed["per_step"]
    return straight


@pytest.mark.parametrize("stage", [0, 2])
def test_hf_trainer_with_a_deepspeed_config_trains_compressed_and_resumes_bit_exact(pool2, tmp_path, stage):
    for rank, run in enumerate(pool2.run(_hf_trainer_straight_and_resumed, str(tmp_path), stage, timeout_s=TIMEOUT_S)):
        # steps 2 and 4: no double-averaging check (step 1), no checkpoint sync (after step 2's callback)
        clean = [run["per_step"][1], run["per_step"][3]]
        print(f"rank {rank} HF Trainer ZeRO {stage}: replicate B/step {clean} vs fp32 all-reduce {run['allreduce']} "
              f"({max(clean) / run['allreduce']:.4f}); losses {run['losses']}")
        assert run["algorithms"] == ["signmuon", "lion"] and run["zero"] == stage
        assert run["engine_allreduce"] is False and run["consistent"]
        assert 0 < max(clean) <= run["allreduce"] / 25
        assert run["resumed_equal"]


def _hf_trainer_use_cpu_and_the_gloo_recipe(directory):
    runs = {}
    for name, use_cpu in (("recipe", False), ("use_cpu", True)):
        os.makedirs(os.path.join(directory, name), exist_ok=True)
        runs[name] = _hf_trainer(os.path.join(directory, name), 2, resume=False, use_cpu=use_cpu)
    runs["bitwise"] = all(torch.equal(a, b) for a, b in zip(runs["recipe"].pop("weights"), runs["use_cpu"].pop("weights")))
    return runs


def test_hf_trainer_use_cpu_runs_deepspeed_bitwise_as_the_gloo_recipe(pool2, tmp_path):
    """TrainingArguments(use_cpu=True) with a DeepSpeed config, from a fresh process's Accelerate state: the Trainer
    runs DeepSpeed with shardopt's optimizer on both processes, each its own batches (the same weights as the
    documented gloo recipe, whose sampler splits the data), ZeRO 2 on a 2 × 1 mesh."""
    for runs in pool2.run(_hf_trainer_use_cpu_and_the_gloo_recipe, str(tmp_path), timeout_s=TIMEOUT_S):
        use_cpu = runs["use_cpu"]
        print(f"use_cpu: replicate B/step {use_cpu['per_step']}, losses {use_cpu['losses']}")
        assert use_cpu["deepspeed_enabled"] and use_cpu["processes"] == 2 and use_cpu["zero"] == 2, use_cpu
        assert use_cpu["optimizer"] == "DeepSpeedSignMuon" and use_cpu["engine_allreduce"] is False, use_cpu
        assert use_cpu["per_step"] == runs["recipe"]["per_step"] and max(use_cpu["per_step"]) > 0, runs
        assert runs["bitwise"] and use_cpu["consistent"], runs


def _accelerator_cpu_true():
    """Accelerator(cpu=True, deepspeed_plugin=...) as a fresh process builds it."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim
    _env()
    _as_a_fresh_process()
    config = _config(0)
    config.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1, gradient_clipping=1.0)
    config["optimizer"]["params"]["lr"] = 3e-3
    try:
        accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
        model = _model()
        prepared, _ = accelerator.prepare(model, DummyOptim(model.parameters()))
        return str(accelerator.distributed_type), type(prepared).__name__
    finally:
        _as_a_fresh_process()


def test_accelerator_cpu_true_leaves_deepspeed_out(pool2):
    """Why docs/trainers.md and the refusal name InitProcessGroupKwargs for Accelerate and not cpu=True: with it
    Accelerate wraps the model in DDP and never calls deepspeed.initialize (so no shardopt optimizer)."""
    for distributed_type, wrapper in pool2.run(_accelerator_cpu_true, timeout_s=TIMEOUT_S):
        assert "DEEPSPEED" not in distributed_type and wrapper == "DistributedDataParallel", (distributed_type, wrapper)


def _accelerate(directory, local_steps=None, steps=STEPS):
    """Accelerate's DeepSpeedPlugin with the full config and DummyOptim (the optimizer comes from the config);
    with `local_steps`, `steps` steps and then LocalSteps.sync_now (the docs' end of training) before save_state."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim
    _env()
    config = _config(0, local_steps)
    config.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1, gradient_clipping=1.0)
    config["optimizer"]["params"]["lr"] = 3e-3
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = _model()
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=4)
    engine, optimizer, loader = accelerator.prepare(model, DummyOptim(model.parameters()), loader)
    ours = sds.shard_optimizer(engine)
    first = next(iter(loader))["input_ids"]
    gathered = [torch.empty_like(first) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, first)
    sent = []
    for step, batch in zip(range(steps), loader):
        accelerator.backward(engine(**batch).loss)
        sent.append(ours.comm_stats()["replicate"]["bytes_sent"])
    if local_steps:
        before = ours.replicas_consistent()
        synced = sds.shard_optimizer(engine).sync_now()
        result = (before, synced, ours.replicas_consistent())
        engine.destroy()
        return result
    accelerator.save_state(directory)
    per_step = [b - a for a, b in zip([0] + sent, sent)]
    result = (not torch.equal(gathered[0], gathered[1]), accelerator.num_processes, per_step, _fp32_allreduce_bytes(model),
              ours.replicas_consistent(), engine.enable_backward_allreduce)
    engine.destroy()
    return result


def test_accelerate_deepspeed_plugin_splits_the_data_and_trains_compressed(pool2, tmp_path):
    for own_batches, processes, per_step, allreduce, consistent, engine_allreduce in pool2.run(
            _accelerate, str(tmp_path), timeout_s=TIMEOUT_S):
        print(f"Accelerate: replicate B/step {per_step} vs fp32 all-reduce {allreduce}")
        assert own_batches and processes == 2
        assert 0 < max(per_step[1:]) <= allreduce / 25 and consistent and engine_allreduce is False


def test_accelerate_with_local_steps_ending_off_a_sync_step_syncs_with_sync_now(pool2, tmp_path):
    """Issue 39.2, Accelerate + DeepSpeed (no end-of-training event): sync_every 4, 6 steps, then
    shard_optimizer(engine).sync_now() as docs/trainers.md says: the replicas differ before, agree after."""
    local_steps = {"sync_every": 4, "exchange": "sign_mean", "block": 128}
    for before, synced, after in pool2.run(_accelerate, str(tmp_path), local_steps, 6, timeout_s=TIMEOUT_S):
        assert not before and synced == [0] and after


def _accelerate_stage(directory, stage, pretrained):
    """Accelerate's DeepSpeedPlugin(hf_ds_config=config at `stage`, the 2 ranks one node), the model
    from_pretrained after the Accelerator (zero3_init_flag: under deepspeed.zero.Init at stage 3), STEPS steps;
    then accelerator.get_state_dict + save_pretrained (as Accelerate's docs save a DeepSpeed model),
    accelerator.save_model and engine.save_16bit_model, each read back."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim
    from safetensors.torch import load_file
    _env()
    config = _config(stage, one_node=True)
    config.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1, gradient_clipping=1.0)
    config["optimizer"]["params"]["lr"] = 3e-3
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=stage == 3))
    model = type(_model()).from_pretrained(pretrained)
    zero_init = hasattr(next(model.parameters()), "ds_id")
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=4)
    engine, _, loader = accelerator.prepare(model, DummyOptim(model.parameters()), loader)
    losses = []
    for step, batch in zip(range(STEPS), loader):
        loss = engine(**batch).loss
        accelerator.backward(loss)
        losses.append(loss.item())
    with sds.gathered_weights(engine):
        named = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    state_dict = accelerator.get_state_dict(engine)
    saved = os.path.join(directory, f"stage{stage}")
    accelerator.unwrap_model(engine).save_pretrained(saved, state_dict=state_dict,
                                                     is_main_process=accelerator.is_main_process)
    accelerator.save_model(engine, os.path.join(saved, "save_model"))
    engine.save_16bit_model(os.path.join(saved, "16bit"))
    accelerator.wait_for_everyone()
    whole = not accelerator.is_main_process or all(
        all(torch.equal(read[name], weight) for name, weight in named.items() if name in read)
        and "transformer.wte.weight" in read for read in (load_file(os.path.join(saved, "model.safetensors")),
                                                          load_file(os.path.join(saved, "save_model", "model.safetensors")),
                                                          torch.load(os.path.join(saved, "16bit", "pytorch_model.bin"))))
    engine.destroy()
    return {"losses": losses, "weights": list(named.values()), "zero_init": zero_init, "saved_whole": whole,
            "zero": sds.shard_optimizer(engine).zero.stage}


def _accelerate_stage_3_door(directory):
    pretrained = os.path.join(directory, "pretrained")
    if dist.get_rank() == 0:
        _model().save_pretrained(pretrained)
    dist.barrier()
    two, three = (_accelerate_stage(directory, stage, pretrained) for stage in (2, 3))
    three["bitwise"] = all(torch.equal(a, b) for a, b in zip(two.pop("weights"), three.pop("weights")))
    return two, three


def test_accelerate_at_stage_3_trains_as_stage_2_and_get_state_dict_holds_the_whole_model(pool2, tmp_path):
    for two, three in pool2.run(_accelerate_stage_3_door, str(tmp_path), timeout_s=TIMEOUT_S):
        print(f"Accelerate one node of 2: losses stage 2 {two['losses']} stage 3 {three['losses']}")
        assert three["zero_init"] and not two["zero_init"] and (two["zero"], three["zero"]) == (2, 3)
        assert three["losses"] == two["losses"] and three["bitwise"]
        assert three["saved_whole"] and two["saved_whole"]


def _accelerate_zero_stage_3_around_a_shardopt_optimizer():
    """DeepSpeedPlugin(zero_stage=3) (no optimizer in its config) and a shardopt optimizer given to prepare."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    import shardopt
    _env()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=1))
    model = _model()
    optimizer = shardopt.SignMuon(shardopt.param_groups(model, "signmuon", "lion"), lr=3e-3,
                                  replicate_mesh=dist.group.WORLD)
    with pytest.raises(ValueError) as refused:
        accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(Tokens(), batch_size=4))
    return str(refused.value)


def test_accelerate_zero_stage_3_around_a_shardopt_optimizer_is_refused_naming_the_config(pool2):
    for message in pool2.run(_accelerate_zero_stage_3_around_a_shardopt_optimizer, timeout_s=TIMEOUT_S):
        assert "zero_optimization.stage = 3" in message and '"type": "SignMuon"' in message, message
        assert "DeepSpeedPlugin(hf_ds_config=config) and DummyOptim" in message, message


def _accelerate_without_a_backend():
    """Accelerate as it sets itself up on a CPU-only machine: no backend, one process counted."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, DummyOptim
    _env()
    AcceleratorState._reset_state(reset_partial_state=True)   # as in a fresh process: Accelerate finds no backend
    config = _config(0)
    config.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1, gradient_clipping=1.0)
    config["optimizer"]["params"]["lr"] = 3e-3
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = _model()
    try:
        accelerator.prepare(model, DummyOptim(model.parameters()))
    except RuntimeError as error:
        return accelerator.num_processes, str(error)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    return accelerator.num_processes, None


def test_accelerate_counting_one_process_is_refused_naming_the_backend(pool2):
    for processes, message in pool2.run(_accelerate_without_a_backend, timeout_s=TIMEOUT_S):
        assert processes == 1
        assert message and "Accelerate counts 1 process(es) but 2 ranks" in message
        assert 'InitProcessGroupKwargs(backend="gloo")' in message and "use_configured_state" in message
        assert "TrainingArguments(..., use_cpu=True)" in message and "not Accelerator(cpu=True)" in message


def _doc_block(heading, directory):
    """The block run as shown; the HF one (use_cpu=True on this CPU machine) from a fresh process's Accelerate state."""
    _env()
    fresh = heading.startswith("HF Trainer")
    if fresh:
        _as_a_fresh_process()
    os.chdir(directory)
    namespace = {"__name__": "__main__"}
    try:
        exec(python_block("docs/trainers.md", heading), namespace)   # noqa: S102 - the docs' own code, run as shown
    finally:
        if fresh:
            _as_a_fresh_process()
    ours, stats = namespace["optimizer"], namespace["optimizer"].comm_stats()
    return ours.replicas_consistent(), stats["replicate"]["bytes_sent"] + stats["node"]["bytes_sent"], \
        stats["replicate"]["bytes_sent"], ours.describe()


@pytest.mark.parametrize("heading", ["HF Trainer with a DeepSpeed config", "Accelerate with DeepSpeed"])
def test_the_docs_blocks_run_as_shown(pool2, tmp_path, heading):
    """Both blocks show the compressed exchange between replicas on one machine: the HF block runs ZeRO 2 on a
    mesh of 2 replicas × 1 (one machine standing in for two nodes), the Accelerate block ZeRO 0 (every rank a
    replica); what they print per step (describe()) is the 1-bit vote's."""
    for consistent, sent, replicate, described in pool2.run(_doc_block, heading, str(tmp_path), timeout_s=TIMEOUT_S):
        assert consistent and sent > 0
        assert replicate > 0 and "whole model, 2 replicas" in described and "1-bit vote" in described, described


def test_register_is_idempotent_and_unregister_restores_deepspeed_initialize():
    from shardopt.deepspeed import internals
    original = internals.original_initialize(deepspeed)
    sds.register()
    sds.register()
    assert deepspeed.initialize is sds.initialize and internals.original_initialize(deepspeed) is original
    sds.unregister()
    assert deepspeed.initialize is original
    sds.unregister()
    assert deepspeed.initialize is original


def test_hf_trainer_with_local_steps_in_the_config_syncs_every_round_and_resumes_mid_round(pool2, tmp_path):
    """sync_every 3: steps 1, 2 and 4 are inner steps, 3 a sync; Trainer saves at step 2 (mid-round) and the
    resumed run ends bitwise where the straight one did (each rank's own params and state files)."""
    local_steps = {"sync_every": 3, "exchange": "sign_mean", "block": 128, "outer_momentum": 0.0}
    for run in pool2.run(_hf_trainer_straight_and_resumed, str(tmp_path), 0, local_steps, timeout_s=TIMEOUT_S):
        assert run["optimizer"] == "DeepSpeedLocalSteps" and run["engine_allreduce"] is False
        inner = [run["per_step"][i] for i in (1, 3)]   # (step 1: the double-averaging check, 24 B)
        assert inner == [0, 0] and run["per_step"][0] == collective_bytes("all_reduce", 24, 2), run["per_step"]
        assert run["per_step"][2] > 0, run["per_step"]
        check = collective_bytes("all_reduce", 24, 2)   # the resumed run checks again, at its first step (3)
        assert run["resumed_per_step"][:2] == [run["per_step"][2] + check, 0], run["resumed_per_step"]
        assert run["resumed_equal"] and not run["consistent"]   # (step 4 is an inner step, no callback: they differ)


def _hf_trainer_ending_off_a_sync(directory):
    """sync_every 4, max_steps 6 (a save every 2 steps: checkpoint-6 is the last), ShardoptCallback, then
    save_model: the run, and whether checkpoint-6's and the final model's weights are what this rank's
    engine holds after training."""
    from safetensors.torch import load_file
    from shardopt.hf import ShardoptCallback
    local_steps = {"sync_every": 4, "exchange": "sign_mean", "block": 128}
    run = _hf_trainer(directory, 0, resume=False, local_steps=local_steps, steps=6, callbacks=[ShardoptCallback()],
                      save_to=os.path.join(directory, "final"))
    weights = dict(zip([name for name, _ in _model().named_parameters()], run.pop("weights")))
    weights["lm_head.weight"] = weights["transformer.wte.weight"]   # tied (named_parameters lists it once)
    for where in ("checkpoint-6", "final"):
        saved = load_file(os.path.join(directory, where, "model.safetensors"))
        run[where] = (sorted(set(saved) - set(weights)), [name for name, tensor in saved.items()
                                                           if name in weights and not torch.equal(tensor, weights[name])])
    return run


def test_hf_trainer_with_local_steps_ending_off_a_sync_step_ends_with_identical_replicas(pool2, tmp_path):
    """Issue 39.2: sync_every 4, max_steps 6. ShardoptCallback syncs after step 6 (before the checkpoint) with
    one more round: the replicas end bitwise equal, and the checkpoint and the saved model are the synced
    weights (every rank's, so rank 0's files are everyone's)."""
    for run in pool2.run(_hf_trainer_ending_off_a_sync, str(tmp_path), timeout_s=TIMEOUT_S):
        assert run["optimizer"] == "DeepSpeedLocalSteps" and run["consistent"]
        assert run["per_step"][3] > 0 and run["per_step"][4] == 0 and run["per_step"][5] == 0, run["per_step"]
        assert run["sent"] - sum(run["per_step"]) >= run["per_step"][3], (run["sent"], run["per_step"])   # the end's sync
        assert run["checkpoint-6"] == run["final"] == ([], []), (run["checkpoint-6"], run["final"])


@pytest.mark.parametrize("name", ["signmuon_bf16", "signmuon_fp16", "dion_bf16", "signmuon_local_steps_bf16", "adamw"])
def test_the_shipped_configs_pass_hf_and_accelerate_config_processing(name, tmp_path):
    """HF Trainer's and Accelerate's processing of the shipped configs, TrainingArguments set to the configs'
    values: no "auto" of shardopt's (vote "fewest_bytes"), and one learning rate per scheduler field
    ("scale_scheduler_lr" gives the groups theirs)."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    path = ROOT / "integrations" / "deepspeed" / f"{name}.json"
    config = json.loads(path.read_text())
    params = config["optimizer"]["params"]
    scheduler = config["scheduler"]["params"]
    precision = {key: True for key in ("bf16", "fp16") if config.get(key, {}).get("enabled")}
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, learning_rate=params["lr"],
                             per_device_train_batch_size=config["train_micro_batch_size_per_gpu"],
                             max_grad_norm=config["gradient_clipping"], weight_decay=params.get("weight_decay", 0.0),
                             adam_beta1=params.get("betas", [0.9])[0], adam_beta2=params.get("betas", [0.9, 0.999])[1],
                             warmup_steps=scheduler["warmup_num_steps"], report_to=[], **precision)
    hf_config = HfTrainerDeepSpeedConfig(str(path))
    hf_config.trainer_config_process(args)
    hf_config.trainer_config_finalize(args, _model(), num_training_steps=100)
    DeepSpeedPlugin(hf_ds_config=str(path)).deepspeed_config_process(must_match=False)
    setup = plugin_setup(hf_config.config)
    assert setup is None if name == "adamw" else setup.options.get("vote", "auto") == "auto"


def test_the_local_steps_exchange_auto_is_spelled_by_replicas_in_a_config(tmp_path):
    """Accelerate refuses an "auto" it does not fill (shardopt.local_steps.exchange); "by_replicas" passes its
    processing and builds LocalSteps' exchange="auto"."""
    from accelerate.utils import DeepSpeedPlugin
    config = json.loads((ROOT / "integrations" / "deepspeed" / "signmuon_local_steps_bf16.json").read_text())
    for spelling in ("auto", "by_replicas"):
        config["shardopt"]["local_steps"]["exchange"] = spelling
        path = tmp_path / f"{spelling}.json"
        path.write_text(json.dumps(config))
        if spelling == "auto":
            with pytest.raises(ValueError, match="shardopt.local_steps.exchange"):
                DeepSpeedPlugin(hf_ds_config=str(path)).deepspeed_config_process(must_match=False)
        else:
            DeepSpeedPlugin(hf_ds_config=str(path)).deepspeed_config_process(must_match=False)
            assert plugin_setup(config).local_steps["exchange"] == "auto"


@pytest.mark.parametrize("name, documented_lr", [("Dion", 0.02), ("SignMuon", 3e-3)])
def test_lr_auto_filled_with_training_arguments_default_is_warned_about(name, documented_lr, tmp_path):
    """HF Trainer fills "lr": "auto" with TrainingArguments(learning_rate=...), whose default is an AdamW lr far
    below docs/tuning.md's range for Dion and Sign-Muon: the plugin warns, naming learning_rate; with the
    learning_rate the docs recommend, no warning."""
    import warnings
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    def planned(**learning_rate):
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **learning_rate)
        hf_config = HfTrainerDeepSpeedConfig({"train_micro_batch_size_per_gpu": "auto",
                                              "optimizer": {"type": name, "params": {"lr": "auto"}}})
        hf_config.trainer_config_process(args)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            setup = plugin_setup(hf_config.config)
        return args.learning_rate, setup.options["lr"], [str(w.message) for w in caught if "lr" in str(w.message)]

    default_lr, lr, messages = planned()
    assert lr == default_lr and len(messages) == 1, messages
    assert f"lr for the matrix params is {default_lr:g}" in messages[0] and "TrainingArguments(learning_rate=...)" in \
        messages[0] and '"lr": "auto"' in messages[0], messages
    assert planned(learning_rate=documented_lr)[1:] == (documented_lr, [])


def test_a_scheduler_lr_list_with_scale_scheduler_lr_is_refused():
    config = json.loads((ROOT / "integrations" / "deepspeed" / "signmuon_bf16.json").read_text())
    config["scheduler"]["params"]["warmup_max_lr"] = [0.003, 0.004]
    with pytest.raises(ValueError, match=r"scheduler.params.warmup_max_lr must be one number with \"scale_scheduler_lr\""):
        sds.initialize(model=_model(), config=config)
    with pytest.raises(ValueError, match=r"scale_scheduler_lr.*needs the model's param groups"):
        sds.engine_config(config)


def test_lightning_deepspeed_strategy_refuses_a_cpu_so_it_is_not_tested_here():
    pl = pytest.importorskip("lightning.pytorch")

    class Linear(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def training_step(self, batch, index):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="deepspeed", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2)
    with pytest.raises(RuntimeError, match="The DeepSpeed strategy is only supported on CUDA GPUs"):
        trainer.fit(Linear(), data)
