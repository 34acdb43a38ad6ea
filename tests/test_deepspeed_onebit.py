"""DeepSpeed's removed 1-bit family under shardopt's plugin (issue 41 part 2; shardopt/deepspeed/onebit.py).

Real DeepSpeed engines on gloo ranks, CPU accelerator: 2 ranks (one pool), and 4 ranks as a 2 × 2 mesh for
ZeRO 1/2 (a second pool). Pinned here:
- "type": "OneBitAdam" through shardopt.deepspeed.initialize (fp32, ZeRO 0): exact Adam (the replicas' mean
  gradient, m/(√v+ε), no bias correction, as DeepSpeed's) over its freeze_step steps; then the weights of
  shardopt.OneBitAdam on the same gradients; the engine never all-reduces; after the freeze the bytes per step
  are the 1-bit formula (+ the non-finite flag), ≤ 1/25 of an fp32 all-reduce of the model; replicas
  bitwise identical; cuda_aware and comm_backend_name are reported as not needed.
- after shardopt.deepspeed.register(), deepspeed.initialize builds it from the same config.
- bf16 trains (loss down); engine.save_checkpoint after the freeze → load → the same trajectory, bitwise.
- ZeRO 1 and 2 on 2 nodes × 2: the trajectory of ZeRO 0 on the same mesh, replicate bytes per rank about
  half of it, replicas identical.
- "OneBitLamb", "ZeroOneAdam", amsgrad, unknown params, other "shardopt" keys: errors naming the fix.
"""

import os
import warnings

import pytest
import torch
import torch.distributed as dist

deepspeed = pytest.importorskip("deepspeed")  # imported before the pool forks: the workers inherit it
pytestmark = pytest.mark.usefixtures("deepspeed_cpu_ops")   # the CPU op compiled before the pool forks

import shardopt  # noqa: E402
import shardopt.deepspeed as sds  # noqa: E402
from shardopt.deepspeed.config import build_param_groups  # noqa: E402
from shardopt.deepspeed.onebit import DeepSpeedOneBitAdam  # noqa: E402
from shardopt.wire.comm import collective_bytes  # noqa: E402
from shardopt.wire.onebit import onebit_mean_bytes  # noqa: E402
from test_deepspeed import _batch, _loss, _max_diff, _model, _weights  # noqa: E402
from workers import WorkerPool  # noqa: E402

TIMEOUT_S = 240
FREEZE = 4
PARAMS = {"lr": 0.003, "freeze_step": FREEZE, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2, collective_timeout_s=60)
    yield p
    p.close()


@pytest.fixture(scope="module")
def pool4():
    p = WorkerPool(4, collective_timeout_s=120)
    yield p
    p.close()


# ---- helpers run on the workers -----------------------------------------------------------------
def _env(local: int | None = None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    local = local or world
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local),
                      LOCAL_WORLD_SIZE=str(local), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def _config(params=None, precision="fp32", stage=0, mesh=None, gas=1, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": "OneBitAdam", "params": dict(params or PARAMS)}}
    if mesh:
        config["shardopt"] = {"mesh": mesh}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    config.update(extra)
    return config


def _train(engine, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        for micro in range(engine.gradient_accumulation_steps()):
            loss = _loss(engine, *_batch(100 * step + micro))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def _held_out_loss(engine) -> float:
    """The loss on a batch no step trains on, 64 rows."""
    return _loss(engine, *_batch(10**6, rows=64)).item()


def _exact_adam(model, steps: int, lr, betas, eps, wd) -> None:
    """Exact Adam as DeepSpeed's 1-bit Adam runs it before freeze_step: the replicas' mean gradient,
    m/(√v + ε) without bias correction, the decay added to the update."""
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(steps):
        model.zero_grad()
        _loss(model, *_batch(100 * step)).backward()
        with torch.no_grad():
            for p, a, b in zip(params, m, v):
                dist.all_reduce(p.grad)
                g = p.grad / dist.get_world_size()
                a.mul_(betas[0]).add_(g, alpha=1 - betas[0])
                b.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
                p.sub_(lr * (a / (b.sqrt() + eps) + wd * p))


def _own_onebit_adam(model, steps: int) -> None:
    optimizer = shardopt.OneBitAdam(model.parameters(), lr=PARAMS["lr"], freeze_step=FREEZE,
                                    betas=tuple(PARAMS["betas"]), eps=PARAMS["eps"],
                                    weight_decay=PARAMS["weight_decay"], replicate_mesh=dist.group.WORLD)
    for step in range(steps):
        optimizer.zero_grad()
        _loss(model, *_batch(100 * step)).backward()
        optimizer.step()


def _onebit_adam_through_the_engine():
    _env()
    steps = FREEZE + 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = sds.initialize(model=_model(), config=_config(
            {**PARAMS, "cuda_aware": False, "comm_backend_name": "nccl"}))
    ours = sds.shard_optimizer(engine)
    allreduces = []
    engine.allreduce_gradients = lambda *a, **k: allreduces.append(1)
    sent = []
    for step in range(steps):
        before = ours.comm_stats()["replicate"]["bytes_sent"]
        _train(engine, 1, first=step)
        sent.append(ours.comm_stats()["replicate"]["bytes_sent"] - before)
        if step == FREEZE - 1:
            frozen_at = _weights(engine.module)
    exact = _model()
    _exact_adam(exact, FREEZE, PARAMS["lr"], PARAMS["betas"], PARAMS["eps"], PARAMS["weight_decay"])
    own = _model()
    _own_onebit_adam(own, steps)
    numels = [p.numel() for p in engine.module.parameters()]
    return (_max_diff(frozen_at, _weights(exact)), _max_diff(_weights(engine.module), _weights(own)), sent, numels,
            len(allreduces), engine.enable_backward_allreduce, ours.replicas_consistent(), type(ours).__name__,
            [str(w.message) for w in caught], ours.describe())


def test_onebit_adam_is_exact_adam_then_one_bit_through_the_engine(pool):
    for (freeze_diff, own_diff, sent, numels, allreduces, engine_allreduce, consistent, cls, caught,
         described) in pool.run(_onebit_adam_through_the_engine, timeout_s=TIMEOUT_S):
        assert freeze_diff <= 1e-6, freeze_diff
        assert own_diff <= 1e-6, own_diff
        assert allreduces == 0 and engine_allreduce is False and consistent and cls == "DeepSpeedOneBitAdam"
        fp32_allreduce = collective_bytes("all_reduce", 4 * sum(numels), 2)
        flag = 2 * collective_bytes("all_reduce", 4, 2)   # the non-finite flag and the agreed norm
        assert sent[1:FREEZE] == [fp32_allreduce + flag] * (FREEZE - 1)
        assert sent[FREEZE:] == [onebit_mean_bytes(numels, 2) + flag] * 4
        assert max(sent[FREEZE:]) <= fp32_allreduce / 25
        assert any("cuda_aware, comm_backend_name not needed" in message for message in caught)
        assert f"after step {FREEZE}" in described


def _registered_deepspeed_initialize():
    _env()
    sds.register()
    try:
        engine, *_ = deepspeed.initialize(model=_model(), config=_config())
        losses = [_held_out_loss(engine)]
        _train(engine, FREEZE + 10)
        losses.append(_held_out_loss(engine))
        ours = sds.shard_optimizer(engine)
        return type(ours).__name__, losses, ours.replicas_consistent()
    finally:
        sds.unregister()


def test_register_makes_deepspeed_initialize_build_onebit_adam(pool):
    for cls, losses, consistent in pool.run(_registered_deepspeed_initialize, timeout_s=TIMEOUT_S):
        assert cls == "DeepSpeedOneBitAdam" and consistent
        assert losses[-1] < losses[0]


def _bf16_checkpoint_resume(directory):
    _env()
    config = _config(precision="bf16", gradient_clipping=1.0)
    saving, *_ = sds.initialize(model=_model(), config=config)
    losses = [_held_out_loss(saving)]
    _train(saving, FREEZE + 2)
    saving.save_checkpoint(directory, tag="after_freeze")
    resumed, *_ = sds.initialize(model=_model(seed=1), config=config)
    path, _ = resumed.load_checkpoint(directory, tag="after_freeze")
    diffs = []
    for step in range(FREEZE + 2, FREEZE + 6):
        _train(saving, 1, first=step)
        _train(resumed, 1, first=step)
        diffs.append(_max_diff(_weights(saving.module), _weights(resumed.module)))
    losses.append(_held_out_loss(saving))
    return path is not None, diffs, losses, sds.shard_optimizer(saving).replicas_consistent()


def test_bf16_trains_and_a_checkpoint_after_the_freeze_resumes_bitwise(pool, tmp_path):
    for loaded, diffs, losses, consistent in pool.run(_bf16_checkpoint_resume, str(tmp_path), timeout_s=TIMEOUT_S):
        assert loaded and consistent
        assert max(diffs) == 0.0, diffs     # each rank's own errors come back (DeepSpeed's reset them)
        assert losses[-1] < losses[0]


def _zero_stages_on_a_mesh():
    _env(local=2)
    mesh = {"replicate": 2, "shard": 2}
    results = {}
    for stage in (0, 1, 2):
        engine, *_ = sds.initialize(model=_model(), config=_config(stage=stage, mesh=mesh, gas=2))
        ours = sds.shard_optimizer(engine)
        _train(engine, FREEZE + 4)
        results[stage] = (_weights(engine.module), ours.comm_stats()["replicate"]["bytes_sent"],
                          ours.replicas_consistent())
    reference = results[0][0]
    return {stage: (_max_diff(weights, reference), sent, consistent) for stage, (weights, sent, consistent)
            in results.items()}


def test_zero_1_and_2_follow_zero_0_on_a_2x2_mesh(pool4):
    for result in pool4.run(_zero_stages_on_a_mesh, timeout_s=TIMEOUT_S):
        for stage in (1, 2):
            diff, sent, consistent = result[stage]
            assert diff <= 1e-5, (stage, diff)
            assert consistent
            assert sent <= 0.75 * result[0][1], (stage, sent, result[0][1])   # a rank sends only what it owns


# ---- errors (no process group needed) -----------------------------------------------------------
@pytest.mark.parametrize("kind, named", [("OneBitLamb", '"type": "OneBitAdam"'),
                                         ("ZeroOneAdam", '"local_steps": {"sync_every": 10, "exchange": "sign_mean"}')])
def test_removed_one_bit_optimizers_name_the_shardopt_config(kind, named):
    config = _config()
    config["optimizer"] = {"type": kind, "params": {"lr": 1e-3, "freeze_step": 100}}
    with pytest.raises(ValueError, match="removed") as error:
        sds.initialize(model=_model(), config=config)
    assert named in str(error.value) and "README.md" in str(error.value)


@pytest.mark.parametrize("params, match", [
    ({**PARAMS, "amsgrad": True}, "amsgrad = True: 1-bit Adam has no AMSGrad"),
    ({**PARAMS, "momentum": 0.9}, "unknown key.*'momentum'.*allowed: lr, freeze_step"),
])
def test_bad_onebit_adam_params_name_the_parameter(params, match):
    with pytest.raises(ValueError, match=match):
        sds.initialize(model=_model(), config=_config(params))


def test_other_shardopt_section_keys_are_refused():
    with pytest.raises(ValueError, match="'nonmatrix_algorithm'.* do not apply to OneBitAdam"):
        build_param_groups(_model(), None, DeepSpeedOneBitAdam, {"nonmatrix_algorithm": "lion"})
