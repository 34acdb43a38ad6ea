"""Local steps from a DeepSpeed JSON config ("shardopt": {"local_steps": {...}}, ZeRO stage 0).

Two gloo ranks (one worker pool for the module), CPU accelerator, every rank a replica. Pinned here:
- fp32: the engine's run equals shardopt.LocalSteps around Sign-Muon (no replicate axis) driven by a
  plain backward, weights and replicate bytes; the inner steps send 0 bytes on the replicate axis (step 1: the double-averaging check),
  the syncs the format's bytes; the replicas are bitwise equal after a sync and differ between syncs.
- fp32 with the inner optimizer's overlap_backward: bitwise the weights without it, work started in backward.
- bf16: trains (loss goes down); an inf gradient on one rank skips that replica's inner step only
  (nothing crosses the replicas), the step still counts towards the round, and both reach the
  next sync together and end bitwise equal.
- engine.save_checkpoint mid-round → a fresh engine loads it → the following steps equal the saving
  run bitwise (each rank's own params and state files), fp32 and bf16.
- unknown or missing keys, a bad value → clear errors (ZeRO 1/2: tests/test_deepspeed_zero.py).
"""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
deepspeed = pytest.importorskip("deepspeed")  # imported before the pool forks: the workers inherit it
pytestmark = pytest.mark.usefixtures("deepspeed_cpu_ops")   # the CPU op compiled before the pool forks

import shardopt  # noqa: E402
import shardopt.deepspeed as sds  # noqa: E402
from shardopt.deepspeed.config import load_config, plugin_setup  # noqa: E402
from shardopt.wire.comm import collective_bytes  # noqa: E402
from test_deepspeed import SIGNMUON, _batch, _config, _env, _loss, _max_diff, _model, _train, _weights  # noqa: E402
from workers import WorkerPool  # noqa: E402

TIMEOUT_S = 150
H = 3
LOCAL_STEPS = {"sync_every": H, "exchange": "sign_mean", "block": 128, "outer_lr": 0.7, "outer_momentum": 0.0}


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2, collective_timeout_s=60)
    yield p
    p.close()


def _local_config(precision="fp32", **local_steps) -> dict:
    return _config("SignMuon", precision=precision, shardopt={"local_steps": {**LOCAL_STEPS, **local_steps}})


def _replicate_sent(optimizer) -> int:
    return optimizer.comm_stats()["replicate"]["bytes_sent"]


def _engine_equals_own_local_steps():
    _env()
    reference_model = _model()
    reference = shardopt.LocalSteps(shardopt.SignMuon(shardopt.param_groups(reference_model, "signmuon"), **SIGNMUON),
                                    replicate_mesh=dist.group.WORLD, **LOCAL_STEPS)
    engine, *_ = sds.initialize(model=_model(), config=_local_config())
    ours = sds.shard_optimizer(engine)
    sent, reference_sent, consistent = [], [], []
    for step in range(2 * H + 1):
        before = _replicate_sent(reference)
        loss = _loss(reference_model, *_batch(step))
        loss.backward()
        reference.step()
        reference.zero_grad()
        reference_sent.append(_replicate_sent(reference) - before)
        before = _replicate_sent(ours)
        _train(engine, 1, first=step)
        sent.append(_replicate_sent(ours) - before)
        consistent.append(ours.replicas_consistent())   # (its hashes are not counted in `sent`)
    return (_max_diff(_weights(reference_model), _weights(engine.module)), sent, reference_sent, consistent,
            sum(ours.sync_bytes()), type(ours).__name__, ours.describe().splitlines()[0])


def test_fp32_engine_equals_local_steps_and_sends_only_at_syncs(pool):
    for diff, sent, reference_sent, consistent, sync_bytes, name, described in pool.run(
            _engine_equals_own_local_steps, timeout_s=TIMEOUT_S):
        assert name == "DeepSpeedLocalSteps" and described.startswith(f"LocalSteps: sync every {H} steps")
        assert diff <= 1e-6
        assert sent == reference_sent
        assert [sent[i] for i in (1, 3, 4, 6)] == [0] * 4, sent        # the inner steps send nothing,
        assert sent[0] == collective_bytes("all_reduce", 24, 2), sent   # but the first the double-averaging check
        assert sent[5] == sync_bytes == sent[2], sent
        assert consistent == [False, False, True, False, False, True, False], consistent


def _overlap_backward_inside_local_steps():
    """The inner Sign-Muon with overlap_backward (fp32, ZeRO 0): the same weights as without, bitwise."""
    _env()
    engines = [sds.initialize(model=_model(), config=_config("SignMuon", {**SIGNMUON, "overlap_backward": on},
                                                            shardopt={"local_steps": LOCAL_STEPS}))[0]
               for on in (False, True)]
    started = []
    for step in range(2 * H + 1):
        for engine in engines:
            engine.backward(_loss(engine, *_batch(step)))
            inner = sds.shard_optimizer(engine).inner
            if inner.overlap_backward:
                started.append(inner.backward_overlap.started() if inner.backward_overlap is not None else 0)
            engine.step()
    return _max_diff(_weights(engines[0].module), _weights(engines[1].module)), started


def test_overlap_backward_of_the_inner_optimizer_keeps_local_steps_bitwise(pool):
    for diff, started in pool.run(_overlap_backward_inside_local_steps, timeout_s=TIMEOUT_S):
        assert diff == 0
        assert all(count > 0 for count in started), started    # the inner step's work began in backward


def _bf16_trains_and_one_replica_skips_alone():
    _env()
    engine, *_ = sds.initialize(model=_model(), config=_local_config("bf16"))
    ours = sds.shard_optimizer(engine)
    untouched = ours.steps == 0 and not ours.state   # the wrapper's construction-time step is not a step
    x, y = _batch(0)
    losses = []
    for _ in range(4 * H):                             # one batch, 4 rounds: the loss must fall
        loss = _loss(engine, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    synced = ours.replicas_consistent()
    before = _replicate_sent(ours)
    _train(engine, 1, first=4 * H, rows=32)            # step 1 of the round
    engine.backward(_loss(engine, *_batch(4 * H + 1, rows=32)))
    if dist.get_rank() == 1:
        engine.module[2].weight.grad[0, 0] = float("inf")
    engine.step()                                      # step 2: skipped on rank 1 only
    inner_bytes = _replicate_sent(ours) - before
    skipped = engine.skipped_steps
    _train(engine, 1, first=4 * H + 2, rows=32)        # step 3: the sync, on both
    one_sync = _replicate_sent(ours) - before == sum(ours.sync_bytes())
    return untouched, losses[0], losses[-1], synced, inner_bytes, skipped, ours.steps, ours.replicas_consistent(), \
        one_sync


def test_bf16_trains_and_an_inf_gradient_skips_one_replica_without_losing_the_round(pool):
    results = pool.run(_bf16_trains_and_one_replica_skips_alone, timeout_s=TIMEOUT_S)
    for rank, (untouched, first, last, synced, inner_bytes, skipped, steps, consistent, one_sync) in enumerate(results):
        assert untouched
        assert last < 0.8 * first and synced, (first, last)
        assert inner_bytes == 0                        # not even a flag crossed the replicas
        assert skipped == (1 if rank == 1 else 0)
        assert steps == 5 * H and consistent and one_sync


def _model_weights_equal_across_replicas(engine) -> bool:
    from shardopt.optim.guard import bit_hash
    mine = bit_hash(torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])).reshape(1)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _ending_off_a_sync(precision):
    """H + 2 steps (a sync, then two inner steps), then sync_now: whether the model's weights are equal across
    the replicas before and after, and whether the optimizer's params are the synced θ_outer and (bf16) the model's weights the masters rounded."""
    _env()
    engine, *_ = sds.initialize(model=_model(), config=_local_config(precision))
    ours = sds.shard_optimizer(engine)
    _train(engine, H + 2)
    before = _model_weights_equal_across_replicas(engine)
    synced = ours.sync_now()
    is_outer = all(torch.equal(p.detach(), ours.state[p]["outer_params"]) for p in ours.params()) and all(
        torch.equal(low.detach(), master.detach().to(low.dtype)) for low, master in ours.inner.wiring.masters)
    return before, _model_weights_equal_across_replicas(engine), synced, is_outer, ours.replicas_consistent()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sync_now_ends_a_run_off_a_sync_step_with_identical_model_weights(pool, precision):
    """Issue 39.2, DeepSpeed's own loop: shard_optimizer(engine).sync_now() before saving the final model; under
    bf16 the model's weights are refreshed from the synced fp32 masters too."""
    for before, after, synced, is_outer, consistent in pool.run(_ending_off_a_sync, precision, timeout_s=TIMEOUT_S):
        assert not before and after and is_outer and consistent and synced == [0], (before, after, is_outer, synced)


def _checkpoint_mid_round(directory, precision):
    _env()
    config = _local_config(precision)
    saving, *_ = sds.initialize(model=_model(), config=config)
    _train(saving, H + 1)                               # one step into the second round
    saving.save_checkpoint(directory, tag="mid")
    resumed, *_ = sds.initialize(model=_model(seed=1), config=config)
    path, _ = resumed.load_checkpoint(directory, tag="mid")
    diffs = [_max_diff(_weights(saving.module), _weights(resumed.module))]
    for step in range(H + 1, 3 * H + 1):
        _train(saving, 1, first=step)
        _train(resumed, 1, first=step)
        diffs.append(_max_diff(_weights(saving.module), _weights(resumed.module)))
    files = sorted(name for name in os.listdir(Path(directory) / "mid") if name.startswith("shardopt_"))
    return path is not None, diffs, sds.shard_optimizer(resumed).steps, files


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpoint_mid_round_resumes_bit_exact(pool, tmp_path, precision):
    for rank, (loaded, diffs, steps, files) in enumerate(pool.run(_checkpoint_mid_round, str(tmp_path / precision),
                                                                  precision, timeout_s=TIMEOUT_S)):
        assert loaded and diffs == [0.0] * len(diffs), diffs
        assert steps == 3 * H + 1
        assert files == [f"shardopt_{what}_rank{r}.safetensors" for what in ("params", "zero") for r in (0, 1)]


def _bad_value_is_named():
    _env()
    try:
        sds.initialize(model=_model(), config=_local_config(sync_every=0))
    except ValueError as error:
        return str(error)
    return None


def test_a_bad_local_steps_value_is_named_at_initialize(pool):
    for message in pool.run(_bad_value_is_named, timeout_s=TIMEOUT_S):
        assert message is not None and "sync_every must be an int ≥ 1" in message


@pytest.mark.parametrize("local_steps,match", [
    ({"sync_every": 3, "outer_lrr": 0.7}, r"unknown key\(s\) 'outer_lrr'.*allowed: sync_every, outer_lr"),
    ({"exchange": "sign_vote"}, r"must be a dict with \"sync_every\""),
    (30, r"must be a dict with \"sync_every\""),
])
def test_malformed_local_steps_sections_raise_naming_the_key(local_steps, match):
    with pytest.raises(ValueError, match=match):
        plugin_setup(_config("SignMuon", shardopt={"local_steps": local_steps}))


def test_the_shipped_local_steps_config_plans_local_steps_around_sign_muon():
    setup = plugin_setup(load_config(ROOT / "integrations" / "deepspeed" / "signmuon_local_steps_bf16.json"))
    assert setup.name == "SignMuon" and setup.zero_stage == 0
    assert setup.local_steps["sync_every"] == 10 and setup.local_steps["exchange"] == "sign_mean"
    assert "local_steps" not in setup.engine_config.get("shardopt", {})   # DeepSpeed never sees the section
