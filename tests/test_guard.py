"""The double-averaging guard (docs/design.md §9): replicas whose gradients were averaged already
(DDP without no_sync(), FSDP2 HSDP without set_requires_all_reduce(False)) have bitwise identical
gradients; the optimizer raises DoubleAveragingError on every rank before any state changes, at
step 1 and every `double_averaging_check_every` steps, with the check's bytes counted by the comm layer.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

import reference
import shardopt
from shardopt.optim import traffic
from shardopt.wire.comm import collective_bytes
from workers import WorkerPool

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    pool = WorkerPool(WORLD)
    yield pool
    pool.close()


# ---- helpers run on the workers ---------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(8, 16, dtype=torch.float64)
        self.down = torch.nn.Linear(16, 4, bias=False, dtype=torch.float64)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _optimizer(algorithm, model, replicate_mesh, **options):
    groups = shardopt.param_groups(model, algorithm, "adamw")
    if algorithm == "dion":
        return shardopt.Dion(groups, lr=0.01, rank_fraction=0.5, replicate_mesh=replicate_mesh, **options)
    return shardopt.SignMuon(groups, lr=0.01, replicate_mesh=replicate_mesh, **options)


def _set_grads(model, seed):
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator, dtype=param.dtype)


def _batch(seed, rows=6):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=generator, dtype=torch.float64)


def _step(opt):
    """opt.step(): None, or the DoubleAveragingError's message."""
    try:
        opt.step()
    except shardopt.DoubleAveragingError as error:
        return str(error)
    return None


def _identical_then_different(algorithm):
    """Every replica gets the same gradients: the guard raises on every rank, params and state
    untouched, only the check's bytes spent; then each replica's own gradients pass (step 1 is
    checked again: the raise did not advance the schedule)."""
    model = Net()
    opt = _optimizer(algorithm, model, dist.group.WORLD)
    before = [p.detach().clone() for p in model.parameters()]
    _set_grads(model, seed=7)
    error = _step(opt)
    untouched = (all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and not opt.state
                 and opt.steps_called == 0 and opt.skipped_steps == 0)
    check_bytes = opt.comm_stats()["replicate"]["bytes_sent"]
    opt.reset_comm_stats()
    _set_grads(model, seed=100 + dist.get_rank())
    second = _step(opt)
    stepped = opt.comm_stats()["replicate"]["bytes_sent"]
    formula = sum(opt.replicate_bytes_per_step()) + traffic.nonfinite_check_bytes(WORLD)
    return {"error": error, "untouched": untouched, "check_bytes": check_bytes, "second": second,
            "stepped_minus_formula": stepped - formula, "moved": not torch.equal(next(model.parameters()), before[0]),
            "consistent": opt.replicas_consistent()}


IDENTICAL_STEPS = (2, 3, 4)


def _schedule(every, steps=8):
    """Different gradients on every step but IDENTICAL_STEPS (the same on all replicas). Per step:
    the replicate bytes beyond the step's formula and whether the guard raised (then the step is
    retried with different gradients)."""
    model = Net()
    opt = _optimizer("signmuon", model, dist.group.WORLD, double_averaging_check_every=every)
    formula = sum(opt.replicate_bytes_per_step()) + traffic.nonfinite_check_bytes(WORLD)
    extra, raised = [], []
    for step in range(1, steps + 1):
        identical = step in IDENTICAL_STEPS
        _set_grads(model, seed=1000 * step + (0 if identical else dist.get_rank() + 1))
        opt.reset_comm_stats()
        error = _step(opt)
        raised.append(error is not None)
        if error is not None:
            _set_grads(model, seed=1000 * step + dist.get_rank() + 1)
            opt.step()
        extra.append(opt.comm_stats()["replicate"]["bytes_sent"] - formula)
    return {"extra": extra, "raised": raised, "steps_called": opt.steps_called}


def _ddp(no_sync):
    """DDP over the 4 ranks, each rank its own batch. Without no_sync() DDP averages the gradients in
    backward and shardopt would average them again: caught."""
    model = torch.nn.parallel.DistributedDataParallel(Net())
    opt = _optimizer("dion", model.module, dist.group.WORLD)
    with model.no_sync() if no_sync else contextlib.nullcontext():   # forward and backward inside it
        model(_batch(dist.get_rank())).square().mean().backward()
    return _step(opt)


def _hsdp(fsdp_replicates, algorithm):
    """A 2 × 2 (replicate, shard) mesh, each rank its own batch. fsdp_replicates: FSDP2 HSDP,
    fully_shard on the 2-D mesh, whose backward all-reduces the gradient shards over the replicate
    axis, so both replicas hold the same mean: caught. Otherwise fully_shard on the shard axis only
    and the optimizer exchanges over the replicate axis (integrations/fsdp/train.py): passes. (On a
    2-D mesh set_requires_all_reduce(False) leaves .grad unset in torch 2.13: FSDP2 keeps the partial
    sums for a later all-reducing backward.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = Net()
    fully_shard(model, mesh=mesh if fsdp_replicates else mesh["shard"])
    opt = _optimizer(algorithm, model, mesh["replicate"])
    model(_batch(dist.get_rank())).square().mean().backward()
    error = _step(opt)
    return {"error": error, "state": len(opt.state), "shard_bytes": opt.comm_stats()["shard"]["bytes_sent"],
            "replicate_bytes": opt.comm_stats()["replicate"]["bytes_sent"]}


def _zero_gradients_are_no_evidence():
    """All-zero gradients on every replica are identical but say nothing: no raise, and the schedule
    does not advance (as after torch's DCP state initialization), so the next step is checked."""
    model = Net()
    opt = _optimizer("dion", model, dist.group.WORLD)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    zero = _step(opt)
    steps_called = opt.steps_called
    _set_grads(model, seed=7)
    return zero, steps_called, _step(opt) is not None


# ---- tests -----------------------------------------------------------------------------------
CHECK = traffic.double_averaging_check_bytes(WORLD)


def _assert_guard_message(error):
    for words in ("bitwise identical", "no_sync()", "set_requires_all_reduce(False)",
                  "engine.enable_backward_allreduce = False", "double_averaging_check_every=0",
                  "No optimizer state was changed"):
        assert words in error, (words, error)


def test_check_bytes_formula():
    assert CHECK == collective_bytes("all_reduce", 3 * 8, WORLD) == 36
    assert traffic.double_averaging_check_bytes(2) == 24 and traffic.double_averaging_check_bytes(1) == 0
    assert traffic.double_averaging_check_bytes(2, 2) == 2 and traffic.double_averaging_check_bytes(1, 2) == 0
    assert [reference.double_averaging_checks(s, 3) for s in (1, 3, 4, 7)] == [1, 1, 2, 3]
    assert reference.double_averaging_checks(10, 0) == 0


@pytest.mark.parametrize("algorithm", ["dion", "signmuon"])
def test_identical_gradients_raise_on_every_rank_state_untouched(pool, algorithm):
    results = pool.run(_identical_then_different, algorithm)
    for result in results:
        _assert_guard_message(result["error"])
        assert result["untouched"], result
        assert result["check_bytes"] == CHECK
        assert result["second"] is None and result["moved"] and result["consistent"]
        assert result["stepped_minus_formula"] == CHECK   # step 1 again: checked


@pytest.mark.parametrize("every, extra_at", [(3, (1, 4, 7)), (1, tuple(range(1, 9))), (0, ())])
def test_check_runs_at_the_steps_it_should(pool, every, extra_at):
    """Steps 2, 3 and 4 feed identical gradients; the check runs (and its bytes are spent) at steps
    1, 1+N, 1+2N, …, so it raises only at the identical steps it checks."""
    steps = 8
    for result in pool.run(_schedule, every, steps):
        raised = tuple(step for step, r in enumerate(result["raised"], 1) if r)
        assert raised == tuple(s for s in IDENTICAL_STEPS if s in extra_at), result
        # a raising check is retried: that step spends the check twice
        expected = [(CHECK * (2 if step in raised else 1) if step in extra_at else 0) for step in range(1, steps + 1)]
        assert result["extra"] == expected, result
        assert result["steps_called"] == steps
        assert reference.double_averaging_checks(steps, every) == len(extra_at)


def test_ddp_without_no_sync_is_caught(pool):
    for error in pool.run(_ddp, False):
        _assert_guard_message(error)
    assert pool.run(_ddp, True) == [None] * WORLD


@pytest.mark.parametrize("algorithm", ["dion", "signmuon"])
def test_fsdp2_hsdp_replicate_all_reduce_is_caught(pool, algorithm):
    caught = pool.run(_hsdp, True, algorithm)
    for result in caught:
        _assert_guard_message(result["error"])
        assert result["state"] == 0
        assert result["replicate_bytes"] == traffic.double_averaging_check_bytes(2)
        assert result["shard_bytes"] == traffic.double_averaging_check_bytes(2, 2) == 2   # the verdict
    for result in pool.run(_hsdp, False, algorithm):
        assert result["error"] is None and result["state"] > 0


def test_all_zero_gradients_are_not_evidence(pool):
    assert pool.run(_zero_gradients_are_no_evidence) == [(None, 0, True)] * WORLD


@pytest.mark.parametrize("value", [-1, 1.5, True, "10", None])
def test_bad_check_every_values(value):
    with pytest.raises(ValueError, match="double_averaging_check_every.*integer ≥ 0"):
        shardopt.Dion(Net().down.parameters(), double_averaging_check_every=value)


def test_one_replica_no_check():
    model = Net()
    opt = _optimizer("dion", model, None)
    _set_grads(model, 0)
    opt.step()
    assert opt.comm_stats()["replicate"]["bytes_sent"] == 0 and opt.steps_called == 1


def test_describe_names_the_check():
    model = Net()
    opt = _optimizer("dion", model, None, double_averaging_check_every=50)
    line = opt.describe(4).splitlines()[-1]
    assert f"+{CHECK} B" in line and "every 50 steps" in line and "double_averaging_check_every" in line
    assert "double-averaging" not in _optimizer("dion", model, None, double_averaging_check_every=0).describe(4)


def test_bit_hash_in_chunks_equals_the_whole_sum(monkeypatch):
    """bit_hash sums Σ bits_i·(2654435761·i + 1) chunk by chunk (bounded temporaries): the same value."""
    from shardopt.optim import guard
    tensor = torch.randn(1001, dtype=torch.float64)
    raw = tensor.view(torch.int64)
    whole = (raw * (torch.arange(raw.numel(), dtype=torch.int64) * 2654435761 + 1)).sum()
    monkeypatch.setattr(guard, "HASH_CHUNK", 64)
    assert guard.bit_hash(tensor) == whole
    changed = tensor.clone()
    changed[1000] = -changed[1000]
    assert guard.bit_hash(changed) != whole


def test_deepspeed_config_passes_the_option_through():
    """"optimizer": {"params": {"double_averaging_check_every": N}} reaches the optimizer's constructor."""
    config = pytest.importorskip("shardopt.deepspeed.config")
    plan = config.plugin_setup({"optimizer": {"type": "SignMuon", "params": {"lr": 0.01, "double_averaging_check_every": 0}}})
    assert plan.options["double_averaging_check_every"] == 0


def _replicas_equal_after_flipping(rank_to_flip):
    """replicas_equal over the world after the last bit of one weight is flipped on rank
    `rank_to_flip` (None: nothing flipped), with the bytes it spent; and the optimizer's
    replicas_consistent, which is the same check on its replicate axis."""
    from shardopt.wire.comm import Axis
    from shardopt.optim.guard import replicas_equal
    model = Net()
    if dist.get_rank() == rank_to_flip:
        with torch.no_grad():
            model.down.weight.view(torch.int64)[0, 0] ^= 1
    axis = Axis("replicate", dist.group.WORLD)
    equal = replicas_equal([p.detach() for p in model.parameters()], axis)
    return equal, axis.stats()["bytes_sent"], _optimizer("dion", model, dist.group.WORLD).replicas_consistent()


@pytest.mark.parametrize("rank_to_flip", [None, 0, WORLD - 1])
def test_replicas_equal_sees_one_flipped_bit_on_one_rank(pool, rank_to_flip):
    """One all-gather of one int64 hash per parameter (3 here); every rank gets the same answer."""
    results = pool.run(_replicas_equal_after_flipping, rank_to_flip)
    assert results == [(rank_to_flip is None, collective_bytes("all_gather", 3 * 8, WORLD), rank_to_flip is None)] * WORLD
