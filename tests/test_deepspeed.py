"""DeepSpeed plugin (shardopt.deepspeed): Dion and Sign-Muon as the engine's optimizer, ZeRO stage 0.

Two gloo ranks (one worker pool for the module), CPU accelerator. Pinned here:
- Dion through the engine (fp32, with and without gradient_clipping) equals shardopt's own
  replicate-axis path (Dion(..., replicate_mesh=world) with a plain backward), weights and bytes.
- Sign-Muon through the engine: the engine never all-reduces gradients (local gradients differ
  across ranks before the step, allreduce_gradients is never called), replicas stay bit-identical,
  and comm_stats() equals the vote + non-matrix mean byte formulas.
- bf16 and fp16 train (loss goes down); under fp16 the gradient carries the loss scale exactly once;
  an inf gradient on one rank skips the step on both, optimizer state and weights untouched.
- Gradient accumulation 4 equals one step on the 4× batch; the exchange happens only at the boundary.
- overlap_backward through the engine (fp32, bf16, fp16; ZeRO 0): weights and state bitwise those without it, the
  exchange started in the boundary's backward; an inf gradient skips the step and drops the work; clipping and ZeRO 1 refuse it, naming the setting.
- engine.save_checkpoint at step 5 → a fresh engine loads it → steps 6-10 equal the saving run.
- ZeRO 1/2/3, unknown optimizer params and a scheduler that would overwrite per-group lrs → clear errors;
  a non-shardopt optimizer type passes through to deepspeed.initialize unchanged.
- integrations/deepspeed/train.py runs under torchrun with 2 processes.
"""

import copy
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
# DeepSpeed's CPU accelerator builds a small C++ op once (about a minute); keep it in the git-ignored cache.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
deepspeed = pytest.importorskip("deepspeed")  # imported before the pool forks: the workers inherit it
pytestmark = pytest.mark.usefixtures("deepspeed_cpu_ops")   # the CPU op compiled before the pool forks

import shardopt  # noqa: E402
import shardopt.deepspeed as sds  # noqa: E402
from shardopt import Dion, param_groups
from shardopt.optim import traffic  # noqa: E402
from shardopt.wire.comm import collective_bytes  # noqa: E402
from shardopt.wire.vote import resolve_vote, vote_bytes  # noqa: E402
from workers import WorkerPool  # noqa: E402

TIMEOUT_S = 150
# DeepSpeed's CPU accelerator runs fp16 only where mkldnn has fp16 kernels (not on e.g. AMD EPYC).
FP16_SUPPORTED = bool(deepspeed.accelerator.get_accelerator().is_fp16_supported())
needs_fp16 = pytest.mark.skipif(not FP16_SUPPORTED, reason="DeepSpeed's accelerator does not support fp16 on this "
                                "device (CPU: torch.ops.mkldnn._is_mkldnn_fp16_supported() is False)")
DION = {"lr": 0.02, "rank_fraction": 0.25, "weight_decay": 0.01}
SIGNMUON = {"lr": 0.003, "momentum": 0.9, "weight_decay": 0.0}


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2, collective_timeout_s=60)
    yield p
    p.close()


# ---- helpers run on the workers -----------------------------------------------------------------
def _env() -> None:
    """What DeepSpeed reads from the environment; the process group is already up (gloo)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def _model(seed=0) -> torch.nn.Module:
    """Three matrices of distinct shapes (one bucket each; the last is wide) and their biases."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 8))


def _batch(step: int, rows: int = 8):
    """This rank's batch for `step`: different on every rank, the same in every run."""
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(rows, 16, generator=generator)
    return x, torch.sin(3 * x[:, :8]) + 0.1 * torch.randn(rows, 8, generator=generator)


def _loss(model, x, y):
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def _config(optimizer="Dion", params=None, precision="fp32", micro=8, gas=1, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
              "optimizer": {"type": optimizer, "params": dict(params or (DION if optimizer == "Dion" else SIGNMUON))}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 10}
    config.update(extra)
    return config


def _weights(module) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in module.parameters()]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _train(engine, steps, first=0, rows=8):
    losses = []
    for step in range(first, first + steps):
        loss = _loss(engine, *_batch(step, rows))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _dion_engine_matches_own_replicate_path(clip):
    _env()
    reference = _model()
    optimizer = Dion(param_groups(reference), **DION, replicate_mesh=dist.group.WORLD)
    engine, *_ = sds.initialize(model=_model(), config=_config("Dion", gradient_clipping=clip))
    for step in range(5):
        loss = _loss(reference, *_batch(step))
        loss.backward()
        if clip:   # the rule the plugin documents: one factor from the mean of the local norms
            grads = [p.grad for p in reference.parameters()]
            norm = torch.stack([g.norm() for g in grads]).norm().reshape(1)
            dist.all_reduce(norm)
            factor = torch.clamp(clip / (norm / dist.get_world_size() + 1e-6), max=1.0)
            for g in grads:
                g.mul_(factor)
        optimizer.step()
        optimizer.zero_grad()
    _train(engine, 5)
    ours = sds.shard_optimizer(engine)
    return (_max_diff(_weights(reference), _weights(engine.module)), ours.comm_stats()["replicate"]["bytes_sent"],
            optimizer.comm_stats()["replicate"]["bytes_sent"], engine.gradient_clipping(), ours.max_grad_norm)


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_dion_zero0_fp32_equals_shardopt_replicate_path(pool, clip):
    for diff, engine_bytes, own_bytes, engine_clip, optimizer_clip in pool.run(
            _dion_engine_matches_own_replicate_path, clip, timeout_s=TIMEOUT_S):
        assert diff <= 1e-6
        assert engine_clip == 0 and optimizer_clip == clip   # the optimizer clips, DeepSpeed does not
        norm_bytes = 5 * collective_bytes("all_reduce", 4, 2)   # the agreed gradient norm, every step
        assert engine_bytes == own_bytes + norm_bytes


def _signmuon_engine_exchanges_itself():
    _env()
    engine, *_ = sds.initialize(model=_model(), config=_config("SignMuon"))
    ours = sds.shard_optimizer(engine)
    engine_allreduces = []
    engine.allreduce_gradients = lambda *a, **k: engine_allreduces.append(1)
    loss = _loss(engine, *_batch(0))
    engine.backward(loss)
    grad = engine.module[0].weight.grad
    gathered = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, grad)
    local_grads_differ = not torch.equal(gathered[0], gathered[1])
    engine.step()
    _train(engine, 9, first=1)
    matrices = [p for p in engine.module.parameters() if p.ndim == 2]
    nonmatrix_bytes = 4 * sum(p.numel() for p in engine.module.parameters() if p.ndim != 2)
    per_step = sum(vote_bytes(resolve_vote("auto", p.numel(), 2, 1), p.numel(), 2, 1) for p in matrices) \
        + collective_bytes("all_reduce", nonmatrix_bytes, 2) + 2 * collective_bytes("all_reduce", 4, 2)  # + flag, norm
    sent = ours.comm_stats()["replicate"]["bytes_sent"]
    return (local_grads_differ, len(engine_allreduces), engine.enable_backward_allreduce, ours.replicas_consistent(),
            sent, 10 * per_step + traffic.double_averaging_check_bytes(2), [float(p.sum()) for p in matrices])  # + step 1's


def test_signmuon_engine_does_not_allreduce_and_replicas_stay_identical(pool):
    results = pool.run(_signmuon_engine_exchanges_itself, timeout_s=TIMEOUT_S)
    for differ, allreduces, backward_allreduce, consistent, sent, expected, _ in results:
        assert differ, "local gradients were equal across ranks: something averaged them"
        assert allreduces == 0 and backward_allreduce is False
        assert consistent
        assert sent == expected
    assert results[0][-1] == results[1][-1]


def _engine_allreduce_left_on(optimizer):
    """The engine's gradient all-reduce turned back on after the plugin turned it off: the replicas'
    gradients arrive averaged, the guard raises on both ranks before any state changes."""
    _env()
    engine, *_ = sds.initialize(model=_model(), config=_config(optimizer))
    ours = sds.shard_optimizer(engine)
    engine.enable_backward_allreduce = True
    weights = _weights(engine.module)
    engine.backward(_loss(engine, *_batch(0)))
    try:
        engine.step()
    except shardopt.DoubleAveragingError as error:
        return str(error), not ours.state and _max_diff(weights, _weights(engine.module)) == 0
    return None, False


@pytest.mark.parametrize("optimizer", ["Dion", "SignMuon"])
def test_engine_allreduce_left_on_is_caught_by_the_guard(pool, optimizer):
    for error, untouched in pool.run(_engine_allreduce_left_on, optimizer, timeout_s=TIMEOUT_S):
        assert error is not None and "engine.enable_backward_allreduce = False" in error and untouched


def _low_precision_trains(optimizer, precision):
    _env()
    model = _model()
    initial = _weights(model)
    engine, *_ = sds.initialize(model=model, config=_config(optimizer, precision=precision))
    ours = sds.shard_optimizer(engine)
    # the wrapper's construction-time step on zero gradients must not move anything
    wrapper = engine.optimizer
    untouched_at_construction = not ours.state and _max_diff(initial, _weights(engine.module)) <= 1e-2 and all(
        torch.equal(master, p.float()) for lp, fp32 in zip(wrapper.fp16_groups, wrapper.fp32_groups)
        for p, master in zip(lp, fp32))
    grad_ratio = None
    if precision == "fp16":   # the gradient DeepSpeed unscales must carry the loss scale exactly once
        reference = copy.deepcopy(engine.module).float()
        x, y = _batch(0)
        _loss(reference, x.half().float(), y).backward()
        engine.backward(_loss(engine, x, y))
        scale = engine.optimizer.loss_scale
        grad_ratio = (engine.module[0].weight.grad.float().norm() / scale / reference[0].weight.grad.norm()).item()
        engine.zero_grad()
    x, y = _batch(0, rows=8)
    losses = []
    for _ in range(15):
        loss = _loss(engine, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return untouched_at_construction, losses[0], losses[-1], engine.skipped_steps, ours.replicas_consistent(), grad_ratio


@pytest.mark.parametrize("optimizer,precision", [("Dion", "bf16"), ("SignMuon", "bf16"),
                                                 pytest.param("SignMuon", "fp16", marks=needs_fp16)])
def test_low_precision_trains_and_loss_goes_down(pool, optimizer, precision):
    for untouched, first, last, skipped, consistent, grad_ratio in pool.run(_low_precision_trains, optimizer, precision,
                                                                            timeout_s=TIMEOUT_S):
        assert untouched
        assert last < 0.8 * first, (first, last)
        assert skipped == 0 and consistent
        if precision == "fp16":
            assert abs(grad_ratio - 1) < 0.02, grad_ratio


def _inf_on_one_rank_skips_everywhere(precision):
    _env()
    engine, *_ = sds.initialize(model=_model(), config=_config("SignMuon", precision=precision, scheduler={
        "type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.003, "warmup_num_steps": 10}}))
    ours = sds.shard_optimizer(engine)
    _train(engine, 2)
    weights = _weights(engine.module)
    masters = [p.detach().clone() for group in ours.param_groups for p in group["params"]]
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in ours.state.items()}
    scale = getattr(engine.optimizer, "loss_scale", 1.0)
    sent, lr = ours.comm_stats()["replicate"]["bytes_sent"], ours.param_groups[0]["lr"]
    engine.backward(_loss(engine, *_batch(2)))
    if dist.get_rank() == 0:
        engine.module[2].weight.grad[0, 0] = float("inf")
    engine.step()
    unchanged = (_max_diff(weights, _weights(engine.module)) == 0
                 and all(torch.equal(a, p) for a, p in zip(masters, (p for g in ours.param_groups for p in g["params"])))
                 and all(torch.equal(v, ours.state[p][k]) for p in ours.state for k, v in state[id(p)].items()))
    skipped, new_scale = engine.skipped_steps, getattr(engine.optimizer, "loss_scale", 1.0)
    flag_bytes = ours.comm_stats()["replicate"]["bytes_sent"] - sent
    lr_held = ours.param_groups[0]["lr"] == lr and not engine.was_step_applied()
    _train(engine, 2, first=3)
    return (skipped, unchanged, new_scale / scale, flag_bytes, lr_held, ours.replicas_consistent(),
            engine.skipped_steps)


@pytest.mark.parametrize("precision", [pytest.param("fp16", marks=needs_fp16), "fp32"])
def test_inf_gradient_on_one_rank_skips_the_step_on_both(pool, precision):
    """fp16: DeepSpeed's wrapper skips (its overflow check replaced by one that agrees over the replicas)
    and halves the loss scale; fp32: the optimizer skips and tells the engine (optimizer.overflow)."""
    for skipped, unchanged, scale_ratio, flag_bytes, lr_held, consistent, skipped_after in pool.run(
            _inf_on_one_rank_skips_everywhere, precision, timeout_s=TIMEOUT_S):
        assert skipped == 1 and unchanged and lr_held
        assert scale_ratio == (0.5 if precision == "fp16" else 1.0)
        # only the overflow flag moved (fp32: and the gradient norm, computed before the optimizer's own check)
        assert flag_bytes == (1 if precision == "fp16" else 2) * collective_bytes("all_reduce", 4, 2)
        assert consistent and skipped_after == 1


def _accumulation_equals_big_batch():
    _env()
    big, *_ = sds.initialize(model=_model(), config=_config("Dion", micro=16, gas=1))
    accumulated, *_ = sds.initialize(model=_model(), config=_config("Dion", micro=4, gas=4))
    ours = sds.shard_optimizer(accumulated)
    calls_before_boundary = []
    for step in range(3):
        x, y = _batch(step, rows=16)
        big.backward(_loss(big, x, y))
        big.step()
        for micro in range(4):
            accumulated.backward(_loss(accumulated, x[4 * micro:4 * micro + 4], y[4 * micro:4 * micro + 4]))
            accumulated.step()
            if step == 0 and micro < 3:
                calls_before_boundary.append(ours.comm_stats()["replicate"]["calls"])
    return _max_diff(_weights(big.module), _weights(accumulated.module)), calls_before_boundary, accumulated.global_steps


def test_gradient_accumulation_equals_one_step_on_the_4x_batch(pool):
    for diff, calls_before_boundary, global_steps in pool.run(_accumulation_equals_big_batch, timeout_s=TIMEOUT_S):
        assert diff <= 1e-6
        assert calls_before_boundary == [0, 0, 0]
        assert global_steps == 3


def _overlap_equals_plain(optimizer, gas, precision, inf_at):
    """overlap_backward on and off through the engine (ZeRO 0, `gas` micro-batches a step; at step `inf_at`
    rank 0's last micro-batch has an inf input, so the step is skipped): weights and optimizer state after 4
    steps, how many bucket steps had started when each engine.backward returned, and the replicate bytes."""
    _env()
    params = DION if optimizer == "Dion" else SIGNMUON
    engines = [sds.initialize(model=_model(), config=_config(optimizer, {**params, "overlap_backward": on}, precision,
                                                            micro=8 // gas, gas=gas))[0] for on in (False, True)]
    started = []
    for step in range(4):
        x, y = _batch(step)
        if step == inf_at and dist.get_rank() == 0:
            x[-1, 0] = float("inf")
        for engine in engines:
            ours = sds.shard_optimizer(engine)
            for micro in range(gas):
                rows = slice(micro * 8 // gas, (micro + 1) * 8 // gas)
                engine.backward(_loss(engine, x[rows], y[rows]))
                if ours.overlap_backward:
                    started.append(ours.backward_overlap.started() if ours.backward_overlap is not None else 0)
                engine.step()
    plain, overlapped = (sds.shard_optimizer(engine) for engine in engines)
    same_state = all(torch.equal(a, b) for p, q in zip(plain._slots(), overlapped._slots())
                     for a, b in zip(plain.state[p].values(), overlapped.state[q].values()))
    sent = [ours.comm_stats()["replicate"]["bytes_sent"] for ours in (plain, overlapped)]   # before the check's bytes
    return (_max_diff(_weights(engines[0].module), _weights(engines[1].module)), same_state, started,
            overlapped.replicas_consistent(), sent, [engine.skipped_steps for engine in engines])


@pytest.mark.parametrize("optimizer,gas,precision,inf_at", [
    ("Dion", 2, "fp32", None), ("SignMuon", 1, "fp32", None), ("Dion", 1, "fp32", 2), ("Dion", 2, "bf16", 2),
    ("SignMuon", 1, "bf16", None), pytest.param("SignMuon", 2, "fp16", 1, marks=needs_fp16)])
def test_overlap_backward_through_the_engine_equals_the_plain_step(pool, optimizer, gas, precision, inf_at):
    """fp16/bf16: the master copies' gradients made in backward as the wrapper's step makes them; an inf
    gradient: the wrapper (fp16/bf16) or the optimizer (fp32) skips the step on both ranks, the work begun
    in backward dropped."""
    for diff, same_state, started, consistent, sent, skipped in pool.run(
            _overlap_equals_plain, optimizer, gas, precision, inf_at, timeout_s=TIMEOUT_S):
        assert diff == 0 and same_state and consistent
        assert skipped == ([1, 1] if inf_at is not None else [0, 0])
        # the bucket steps start in the boundary's backward, none in an earlier micro-batch's
        assert all(count > 0 for count in started[gas - 1::gas]), started
        assert all(count == 0 for index, count in enumerate(started) if index % gas != gas - 1), started
        # no step ran again after backward (that would send its exchange twice); a skipped one spent it
        assert sent[1] == sent[0] if inf_at is None else sent[0] < sent[1] < sent[0] * 2, sent


def _overlap_refused(precision, extra):
    _env()
    try:
        sds.initialize(model=_model(), config=_config("SignMuon", {**SIGNMUON, "overlap_backward": True},
                                                      precision=precision, **extra))
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("precision,extra,named", [
    ("bf16", {"gradient_clipping": 1.0}, '"gradient_clipping": 0'),
    ("fp32", {"zero_optimization": {"stage": 1}, "shardopt": {"mesh": {"replicate": 1, "shard": 2}}}, "ZeRO stage 2")])
def test_overlap_backward_where_the_engine_changes_gradients_after_backward_is_refused(pool, precision, extra, named):
    for message in pool.run(_overlap_refused, precision, extra, timeout_s=TIMEOUT_S):
        assert message is not None and named in message and "overlap_backward" in message, message


def _checkpoint_resume(directory, optimizer, precision):
    _env()
    params = dict(DION if optimizer == "Dion" else SIGNMUON)
    lr = params["lr"]
    scheduler = {"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.0], "warmup_max_lr": [lr, lr / 2],
                                                "warmup_num_steps": 8}}
    config = _config(optimizer, precision=precision, scheduler=scheduler, shardopt={"nonmatrix": {"lr": lr / 2}})
    saving, *_ = sds.initialize(model=_model(), config=config)
    never_saved, *_ = sds.initialize(model=_model(), config=config)
    _train(saving, 5)
    _train(never_saved, 5)
    saving.save_checkpoint(directory, tag="step5")
    resumed, *_ = sds.initialize(model=_model(seed=1), config=config)
    path, _ = resumed.load_checkpoint(directory, tag="step5")
    diffs = []
    for step in range(5, 10):
        _train(saving, 1, first=step)
        _train(resumed, 1, first=step)
        _train(never_saved, 1, first=step)
        diffs.append(_max_diff(_weights(saving.module), _weights(resumed.module)))
    lrs = [[g["lr"] for g in engine.optimizer.param_groups] for engine in (saving, resumed)]
    return (path is not None, diffs, lrs, resumed.global_steps,
            _max_diff(_weights(saving.module), _weights(never_saved.module)))


@pytest.mark.parametrize("optimizer,precision", [("SignMuon", "fp32"), pytest.param("Dion", "fp16", marks=needs_fp16)])
def test_checkpoint_at_step_5_resumes_on_the_same_trajectory(pool, tmp_path, optimizer, precision):
    for loaded, diffs, lrs, global_steps, _ in pool.run(_checkpoint_resume, str(tmp_path), optimizer, precision,
                                                        timeout_s=TIMEOUT_S):
        assert loaded
        assert max(diffs) <= 1e-6, diffs
        assert lrs[0] == lrs[1] and global_steps == 10


@pytest.mark.parametrize("optimizer", ["Dion", "SignMuon"])
def test_what_zero_stage_3_does_not_do_raises_a_clear_error_naming_the_fix(optimizer):
    """Stage 3 runs (tests/test_deepspeed_zero3.py); offload, local steps, the 1-bit family there and an unknown
    stage are refused before any process group is needed; DeepSpeed's stage-3 fetch knobs are named in a warning."""
    with pytest.raises(ValueError, match=r"zero_optimization.stage must be 0, 1, 2 or 3, got 4"):
        sds.initialize(model=_model(), config=_config(optimizer, zero_optimization={"stage": 4}))
    for stage, offload in ((2, "offload_optimizer"), (3, "offload_param")):
        with pytest.raises(ValueError, match=rf"zero_optimization.{offload} is not supported.*remove it"):
            sds.initialize(model=_model(), config=_config(optimizer, zero_optimization={
                "stage": stage, offload: {"device": "cpu"}}))
    with pytest.raises(ValueError, match=r"local_steps.*stages 0, 1 and 2.*set zero_optimization.stage to 2"):
        sds.initialize(model=_model(), config=_config(optimizer, zero_optimization={"stage": 3},
                                                      shardopt={"local_steps": {"sync_every": 2}}))
    with pytest.raises(ValueError, match=r"OneBitAdam runs at ZeRO stages 0, 1 and 2"):
        sds.initialize(model=_model(), config=_config("OneBitAdam", {"lr": 1e-3}, zero_optimization={"stage": 3}))
    with pytest.warns(UserWarning, match=r"stage3_prefetch_bucket_size.*have no effect"), \
            pytest.raises(ValueError, match=r"zero_optimization.offload_param"):   # stops before any process group
        sds.initialize(model=_model(), config=_config(optimizer, zero_optimization={
            "stage": 3, "stage3_prefetch_bucket_size": 10**6, "offload_param": {"device": "cpu"}}))


@pytest.mark.parametrize("mesh", [{"replicate": 2}, {"replicate": 2, "shard": 0}, {"replicate": 1.5, "shard": 2}, [2, 2]])
def test_a_malformed_mesh_raises_naming_the_section(mesh):
    with pytest.raises(ValueError, match=r"\"shardopt\": \{\"mesh\": ...\} must be \{\"replicate\": R, \"shard\": S\}"):
        sds.initialize(model=_model(), config=_config("Dion", zero_optimization={"stage": 1}, shardopt={"mesh": mesh}))


def test_fp16_on_a_device_without_fp16_raises_naming_bf16(monkeypatch):
    """The accelerator's own capability check (CPU: mkldnn fp16) decides, before any engine is built."""
    monkeypatch.setattr(type(deepspeed.accelerator.get_accelerator()), "is_fp16_supported", lambda self: False)
    with pytest.raises(ValueError, match=r"enables \"fp16\".*does not support.*use \"bf16\""):
        sds.initialize(model=_model(), config=_config("SignMuon", precision="fp16"))


def test_moe_expert_params_raise_a_clear_error():
    model = _model()
    model[2].weight.allreduce = False     # how deepspeed.moe marks expert parameters
    with pytest.raises(NotImplementedError, match=r"MoE expert parameters \(e.g. '2.weight'"):
        sds.initialize(model=model, config=_config("Dion"))


def test_untested_deepspeed_version_fails_clearly(monkeypatch):
    from shardopt.deepspeed import internals
    monkeypatch.setattr(internals, "_checked", [])
    monkeypatch.setattr(deepspeed, "__version__", "0.14.2")
    with pytest.raises(ImportError, match=r"tested with DeepSpeed 0.19.x, and DeepSpeed 0.14.2 is installed"):
        sds.initialize(model=_model(), config=_config("Dion"))
    monkeypatch.setenv(internals.ALLOW_UNTESTED, "1")
    monkeypatch.setattr(internals, "missing_internals", lambda ds: ["DeepSpeedEngine.destroy"])
    with pytest.raises(ImportError, match=r"lacks internals the shardopt plugin relies on: DeepSpeedEngine.destroy"):
        sds.initialize(model=_model(), config=_config("Dion"))


def test_unknown_optimizer_params_and_model_parallelism_raise_clear_errors():
    with pytest.raises(NotImplementedError, match="does not support model parallelism"):
        sds.initialize(model=_model(), config=_config("SignMuon"), mpu=object())
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'momentum' for Dion; allowed: lr, mu"):
        sds.initialize(model=_model(), config=_config("Dion", params={"lr": 0.01, "momentum": 0.9}))
    with pytest.raises(ValueError, match=r"\"shardopt\" section has unknown key\(s\) 'scalar_lr'"):
        sds.initialize(model=_model(), config=_config("Dion", shardopt={"scalar_lr": 0.01}))


def _scheduler_and_passthrough():
    _env()
    config = _config("Dion", shardopt={"nonmatrix": {"lr": 0.001}},
                     scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 0.02, "warmup_num_steps": 5}})
    try:
        sds.initialize(model=_model(), config=config)
        message = None
    except ValueError as error:
        message = str(error)
    model = _model()
    engine, *_ = sds.initialize(model=model, model_parameters=model.parameters(), config=_config("Dion"))
    groups = [(g["algorithm"], len(g["params"])) for g in sds.shard_optimizer(engine).param_groups]
    adamw = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, optimizer, *_ = sds.initialize(model=_model(), config=adamw)
    return message, groups, type(optimizer).__name__, engine.enable_backward_allreduce


def test_scheduler_error_param_groups_and_other_optimizers_pass_through(pool):
    for message, groups, optimizer, backward_allreduce in pool.run(_scheduler_and_passthrough, timeout_s=TIMEOUT_S):
        assert "WarmupLR scheduler sets one warmup_min_lr/warmup_max_lr" in message
        assert groups == [("dion", 3), ("adamw", 3)]   # model.parameters() → shardopt.param_groups split
        assert optimizer == "AdamW" and backward_allreduce is True


def _client_optimizer_path():
    """The way for code that calls deepspeed.initialize itself: engine_config + client_optimizer + attach."""
    _env()
    config = _config("SignMuon", precision="bf16", gradient_clipping=0.05)
    reference, *_ = sds.initialize(model=_model(), config=config)
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=sds.client_optimizer(model, config),
                                      config=sds.engine_config(config))
    engine.backward(_loss(engine, *_batch(0)))
    try:
        engine.step()
        unwired = None
    except RuntimeError as error:
        unwired = str(error)
    engine.zero_grad()
    ours = sds.attach(engine)
    _train(reference, 5)
    _train(engine, 5)
    return (unwired, _max_diff(_weights(reference.module), _weights(engine.module)), engine.enable_backward_allreduce,
            ours.comm_stats()["replicate"]["bytes_sent"], sds.shard_optimizer(reference).comm_stats()["replicate"]["bytes_sent"])


def test_client_optimizer_and_attach_equal_initialize_and_an_unwired_step_raises(pool):
    for unwired, diff, backward_allreduce, sent, reference_sent in pool.run(_client_optimizer_path, timeout_s=TIMEOUT_S):
        assert "call shardopt.deepspeed.attach(engine)" in unwired
        assert diff == 0 and backward_allreduce is False and sent == reference_sent


def _patched(engine) -> list:
    """What the plugin may set on the engine and on DeepSpeed's fp16/bf16 wrapper, as each instance holds it
    (None: not set on the instance), and the post-accumulate-grad hooks on the params."""
    wrapper = engine.optimizer
    names = {engine: ("enable_backward_allreduce", "backward", "save_checkpoint", "load_checkpoint"),
             wrapper: ("overflow_checker", "checkpoint_event_prologue")}
    return [vars(obj).get(name) for obj, attributes in names.items() for name in attributes] + [
        len(p._post_accumulate_grad_hooks or {}) for p in engine.module.parameters()]


def _detach_restores_the_engine():
    """bf16 (DeepSpeed's wrapper) at ZeRO 2 (gradient hooks, checkpoint files): every patch the wiring made."""
    _env()
    config = _config("SignMuon", precision="bf16", zero_optimization={"stage": 2},
                     shardopt={"mesh": {"replicate": 2, "shard": 1}})
    reference, *_ = sds.initialize(model=_model(), config=config)
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=sds.client_optimizer(model, config),
                                      config=sds.engine_config(config))
    before = _patched(engine)
    sds.attach(engine)
    wired = _patched(engine)
    ours = sds.detach(engine)
    after = _patched(engine)
    inert = ours.wiring is None
    sds.attach(engine)    # a detached engine can be wired again: it trains as one wired once
    _train(reference, 3)
    _train(engine, 3)
    return (sum(a is not b for a, b in zip(before, wired)), all(a is b or a == b for a, b in zip(before, after)),
            inert, _max_diff(_weights(reference.module), _weights(engine.module)), ours.replicas_consistent())


def test_detach_restores_every_engine_patch_and_attach_works_again(pool):
    for changed, restored, inert, diff, consistent in pool.run(_detach_restores_the_engine, timeout_s=TIMEOUT_S):
        assert changed >= 6 and restored and inert   # allreduce switch, backward, save/load, overflow check, prologue, hooks
        assert diff == 0 and consistent


def test_missing_deepspeed_gives_an_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ImportError, match=r"pip install 'shardopt\[deepspeed\]'"):
        sds.initialize(model=_model(), config=_config("Dion"))


def _write_corpus(directory) -> None:
    """A small byte corpus in the layout integrations/data.py prepares."""
    text = b"".join(b"%d: To be, or not to be, that is the question.\n" % i for i in range(500))
    (directory / "train.bin").write_bytes(text)
    (directory / "meta.json").write_text('{"vocab_size": 256, "dtype": "uint8"}')


@pytest.mark.parametrize("config", ["dion_bf16", "dion_zero3_bf16", "signmuon_bf16", "signmuon_lion_bf16",
                                    pytest.param("signmuon_fp16", marks=needs_fp16), "adamw",
                                    "signmuon_local_steps_bf16"])
def test_train_script_runs_under_torchrun(config, tmp_path):
    """The GPT of integrations/model.py on a small byte corpus in the prepared layout. Local steps (sync_every
    10) end at step 5, off a sync step: the script syncs at the end and checks that the replicas agree."""
    _write_corpus(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "integrations" / "deepspeed" / "train.py"), "--data-dir", str(tmp_path),
               "--n-layer", "1", "--n-embd", "32", "--block-size", "16",
               "--deepspeed_config", str(ROOT / "integrations" / "deepspeed" / f"{config}.json"), "--steps", "5"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step     5" in result.stdout, result.stdout[-3000:]
    assert ("end: synced fragment(s) [0]" in result.stdout) == ("local_steps" in config), result.stdout[-3000:]


def test_tiny_gpt2_trains_through_accelerate_deepspeed_plugin_with_compressed_bytes(tmp_path):
    """HF Accelerate calls deepspeed.initialize itself: integrations/deepspeed/train_accelerate.py (engine_config,
    client_optimizer, attach) on 2 processes; a GPT-2 built from GPT2Config (no download)."""
    missing = [name for name in ("transformers", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (pip install 'shardopt[hf]')")
    _write_corpus(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "integrations" / "deepspeed" / "train_accelerate.py"), "--data-dir", str(tmp_path),
               "--block-size", "16", "--steps", "6",
               "--deepspeed_config", str(ROOT / "integrations" / "deepspeed" / "signmuon_bf16.json")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = re.search(r"DeepSpeedSignMuon through Accelerate on 2 ranks: ([\d,]+) B sent on the replicate axis, "
                        r"([\d.]+) of an fp32 all-reduce; replicas identical: True", result.stdout)
    assert summary, result.stdout[-3000:]
    assert int(summary.group(1).replace(",", "")) > 0 and float(summary.group(2)) < 0.3
    losses = [float(x) for x in re.findall(r"loss ([\d.]+)", result.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


def test_shardopt_section_keys_before_0_3_still_work_with_a_deprecation_warning():
    """"scalar_algorithm", "scalar_names", "scalar" (users' JSON configs) read as "nonmatrix_*" with a
    DeprecationWarning; both spellings at once is an error naming both."""
    from shardopt.deepspeed import config as ds_config
    base = {"optimizer": {"type": "SignMuon", "params": {"lr": 1e-3}}, "train_micro_batch_size_per_gpu": 1}
    new = ds_config.plugin_setup({**base, "shardopt": {"nonmatrix_algorithm": "lion", "nonmatrix": {"lr": 1e-2}}}).section
    with pytest.warns(DeprecationWarning, match="'scalar' is deprecated; call it 'nonmatrix'"):
        old = ds_config.plugin_setup({**base, "shardopt": {"scalar_algorithm": "lion", "scalar": {"lr": 1e-2}}}).section
    assert old == new
    with pytest.raises(ValueError, match="both 'scalar' and 'nonmatrix'"):
        ds_config.plugin_setup({**base, "shardopt": {"scalar": {"lr": 1}, "nonmatrix": {"lr": 1}}})
