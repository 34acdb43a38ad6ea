"""The exchange during backward (docs/design.md §12, `overlap_backward=True`).

Each case trains the same small MLP twice on every rank, overlap_backward off and on, from the same
weights and batches (each rank its own), and pins:
- bitwise equal params and optimizer state, for Dion (compressed, split over the replicas, and the
  plain-mean fallback) and Sign-Muon (each vote format) with their non-matrix groups (AdamW, Lion),
  on plain replicas, DDP (shardopt.ddp's comm hook), FSDP2 (shard axis) and HSDP (2 × 2);
- that work really started during backward (units started before step());
- a non-finite gradient on one rank: the step skipped on every rank, nothing changed;
- a param used on one rank only, and one used by no rank (the round is rerun in place);
- gradient accumulation: no collective before the last micro-batch's backward;
- the same collectives in the same order on every rank, with one rank slowed down in backward.
"""

import contextlib
import time

import pytest
import torch
import torch._dynamo  # noqa: F401  torch.optim imports it on first use; import it once before the pools fork
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401  same: DeviceMesh/DTensor machinery, imported once

import shardopt
import shardopt.ddp
from shardopt.wire.comm import Axis
from shardopt.layout.placement import local

TIMEOUT_S = 60


# ---- helpers run on the workers -----------------------------------------------------------------
class Net(torch.nn.Module):
    """Four Linear layers (three layouts, two same-shape matrices that share a bucket) and an extra
    one that `forward(x, use_extra)` may skip."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(12, 24), torch.nn.Linear(24, 24),
                                           torch.nn.Linear(24, 24), torch.nn.Linear(24, 8)])
        self.extra = torch.nn.Linear(8, 8)

    def forward(self, x, use_extra=True):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        x = self.layers[-1](x)
        return self.extra(x) if use_extra else x


def _batch(rank, step, micro=0, nan=False):
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + micro))
    if nan:
        x[0, 0] = float("nan")
    return x


def _setup(kind, algorithm, nonmatrix, options, overlap):
    """(model to run, optimizer) for `kind`: plain replicas, DDP, FSDP2 on a shard axis, HSDP 2 × 2."""
    net = Net()
    meshes = {}
    if kind in ("fsdp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        if kind == "fsdp":
            shard_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))["shard"]
        else:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            shard_mesh, meshes["replicate_mesh"] = mesh["shard"], mesh["replicate"]
        for layer in (*net.layers, net.extra):
            fully_shard(layer, mesh=shard_mesh)
        fully_shard(net, mesh=shard_mesh)
    else:
        meshes["replicate_mesh"] = dist.group.WORLD
    groups = shardopt.param_groups(net, algorithm, nonmatrix, nonmatrix_options=dict(lr=0.01, **(
        {"vote": options["vote"]} if nonmatrix == "lion" and "vote" in options else {})))
    cls = shardopt.Dion if algorithm == "dion" else shardopt.SignMuon
    opt = cls(groups, overlap_backward=overlap, seed=3, **meshes, **options)
    model = net
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net)
        shardopt.ddp.keep_local_gradients(model, opt)
    return net, model, opt


def _exchange_calls(opt):
    return sum(axis.calls for axis in opt.bucket_step_axes)


def _train(kind, algorithm, nonmatrix, options, overlap, steps=3, micro=1, nan_at=None, extra_on=None,
           slow_rank=None):
    """Train `steps` steps; returns the local params and state and what each backward left started.
    extra_on(rank, step) → whether this rank uses the extra layer at that step; nan_at: (rank, step)
    whose batch holds a NaN; slow_rank: a rank that sleeps in backward (other hook timing)."""
    rank = dist.get_rank()
    net, model, opt = _setup(kind, algorithm, nonmatrix, options, overlap)
    if slow_rank == rank:
        net.layers[1].register_full_backward_pre_hook(lambda module, grad: time.sleep(0.05))
    started, calls_after_backward = [], []
    for step in range(steps):
        for m in range(micro):
            accumulate = opt.accumulating() if m < micro - 1 else contextlib.nullcontext()
            use_extra = extra_on(rank, step) if extra_on else True
            with accumulate:
                model(_batch(rank, step, m, nan_at == (rank, step)), use_extra).square().mean().backward()
            started.append(opt.backward_overlap.started() if opt.backward_overlap is not None else 0)
            calls_after_backward.append(_exchange_calls(opt))
        opt.step()
        opt.zero_grad()
    state = {f"{i}.{key}": local(value).clone() for i, p in enumerate(net.parameters())
             for key, value in opt.state[p].items()}
    return {"params": [local(p).detach().clone() for p in net.parameters()], "state": state, "started": started,
            "calls": calls_after_backward, "skipped": opt.skipped_steps, "consistent": opt.replicas_consistent()}


def _on_and_off(*args, **kwargs):
    off = _train(*args, overlap=False, **kwargs)
    on = _train(*args, overlap=True, **kwargs)
    return {"params": all(torch.equal(a, b) for a, b in zip(off["params"], on["params"])),
            "state": off["state"].keys() == on["state"].keys()
            and all(torch.equal(off["state"][k], on["state"][k]) for k in off["state"]),
            "on": {k: on[k] for k in ("started", "calls", "skipped", "consistent")},
            "off": {k: off[k] for k in ("started", "calls", "skipped", "consistent")},
            "moved": not all(torch.equal(a, b) for a, b in zip(off["params"], [local(p).detach() for p in Net().parameters()]))}


def _assert_bitwise(results):
    for rank, result in enumerate(results):
        assert result["params"] and result["state"], (rank, result)
        assert result["moved"] and result["on"]["consistent"] and result["off"]["consistent"], (rank, result)


CASES = [   # (kind, algorithm, non-matrix algorithm, optimizer options)
    ("plain", "dion", "adamw", dict(rank_fraction=0.25)),
    ("plain", "dion", "lion", dict(rank_fraction=1.0)),
    ("plain", "signmuon", "lion", dict(lr=0.01, vote="allreduce_int8")),
    ("plain", "signmuon", "adamw", dict(lr=0.01, vote="allgather_1bit")),
    ("plain", "signmuon", "lion", dict(lr=0.01, vote="alltoall_1bit")),
    ("ddp", "dion", "adamw", dict(rank_fraction=0.25)),
    ("ddp", "signmuon", "lion", dict(lr=0.01)),
    ("fsdp", "dion", "adamw", dict(rank_fraction=0.25)),
    ("fsdp", "signmuon", "lion", dict(lr=0.01, orthogonalize="full")),
]


# ---- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,algorithm,nonmatrix,options", CASES, ids=lambda v: str(v) if not isinstance(v, dict) else
                         "-".join(f"{k}={x}" for k, x in v.items()))
def test_overlap_is_bitwise_the_step_after_backward(pool2, kind, algorithm, nonmatrix, options):
    results = pool2.run(_on_and_off, kind, algorithm, nonmatrix, options, timeout_s=TIMEOUT_S)
    _assert_bitwise(results)
    for result in results:
        assert all(started > 0 for started in result["on"]["started"]), result   # work began in backward
        assert all(started == 0 for started in result["off"]["started"]), result


@pytest.mark.parametrize("algorithm,options", [("dion", dict(rank_fraction=0.25)),
                                               ("signmuon", dict(lr=0.01, vote="alltoall_1bit"))])
def test_hsdp_overlap_is_bitwise_the_step_after_backward(pool4, algorithm, options):
    results = pool4.run(_on_and_off, "hsdp", algorithm, "lion", options, timeout_s=TIMEOUT_S)
    _assert_bitwise(results)
    assert all(all(started > 0 for started in result["on"]["started"]) for result in results)


def _after_a_group_of_one_rank(algorithm, options):
    """Overlap on and off after rank 0 alone made a group of its own ranks (use_local_synchronization):
    the ranks then hold different numbers of groups, which names a group-local one differently on each."""
    lonely = dist.new_group([0], use_local_synchronization=True) if dist.get_rank() == 0 else None
    try:
        return _on_and_off("plain", algorithm, "lion", options)
    finally:
        if lonely is not None:
            dist.destroy_process_group(lonely)


def test_private_groups_are_agreed_when_ranks_hold_different_numbers_of_groups(pool2):
    _assert_bitwise(pool2.run(_after_a_group_of_one_rank, "signmuon", dict(lr=0.01, vote="alltoall_1bit"),
                              timeout_s=TIMEOUT_S))


def test_nonfinite_gradient_on_one_rank_skips_everywhere(pool2):
    results = pool2.run(_on_and_off, "plain", "dion", "adamw", dict(rank_fraction=0.25), nan_at=(1, 1),
                        timeout_s=TIMEOUT_S)
    _assert_bitwise(results)
    for result in results:
        assert result["on"]["skipped"] == result["off"]["skipped"] == 1, result


def _nonfinite_state_untouched():
    rank = dist.get_rank()
    net, model, opt = _setup("plain", "signmuon", "lion", dict(lr=0.01), True)
    model(_batch(rank, 0)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in net.parameters()]
    state = {(i, k): v.clone() for i, p in enumerate(net.parameters()) for k, v in opt.state[p].items()}
    model(_batch(rank, 1, nan=rank == 1)).square().mean().backward()
    started = opt.backward_overlap.started()
    opt.step()
    return {"started": started, "params": all(torch.equal(a, p) for a, p in zip(before, net.parameters())),
            "state": all(torch.equal(v, opt.state[list(net.parameters())[i]][k]) for (i, k), v in state.items()),
            "skipped": opt.skipped_steps}


def test_nonfinite_with_work_started_leaves_state_untouched(pool2):
    for result in pool2.run(_nonfinite_state_untouched, timeout_s=TIMEOUT_S):
        assert result["started"] > 0 and result["params"] and result["state"] and result["skipped"] == 1, result


def test_param_unused_on_one_rank_or_on_all(pool2):
    # step 0: every rank uses the extra layer; step 1: rank 0 only; step 2: no rank (its params do not step,
    # the round planned with them is discarded and the step runs in place); step 3: everyone again
    extra_on = _ExtraOn()
    results = pool2.run(_on_and_off, "plain", "signmuon", "lion", dict(lr=0.01), steps=4, extra_on=extra_on,
                        timeout_s=TIMEOUT_S)
    _assert_bitwise(results)


class _ExtraOn:
    def __call__(self, rank, step):
        return step in (0, 3) or (step == 1 and rank == 0)


def test_accumulation_starts_the_exchange_on_the_last_micro_batch_only(pool2):
    results = pool2.run(_on_and_off, "plain", "dion", "lion", dict(rank_fraction=0.25), steps=2, micro=3,
                        timeout_s=TIMEOUT_S)
    _assert_bitwise(results)
    for result in results:
        calls, started = result["on"]["calls"], result["on"]["started"]
        assert calls[0] == 0, calls
        for step in range(2):   # (the step() between steps adds the rest of a round's collectives)
            first, second, last = calls[3 * step:3 * step + 3]
            assert first == second and last > second, calls
            assert started[3 * step:3 * step + 3][:2] == [0, 0] and started[3 * step + 2] > 0, started


def _collective_log(slow_rank):
    """Every collective the optimizer's exchange axes start, in order, over two steps with a param used on
    rank 0 only at step 1 and one rank slowed down in backward."""
    log = []
    start = Axis._start

    def logged(axis, collective, *args, **kwargs):
        log.append((axis.name, collective.__name__, tuple(t.numel() for t in args if isinstance(t, torch.Tensor))))
        return start(axis, collective, *args, **kwargs)
    Axis._start = logged
    try:
        result = _train("plain", "dion", "lion", dict(rank_fraction=0.25), True, steps=3,
                        extra_on=lambda rank, step: step != 1 or rank == 0, slow_rank=slow_rank)
    finally:
        Axis._start = start
    logs = [None] * dist.get_world_size()
    dist.all_gather_object(logs, log)
    return {"logs": logs, "started": result["started"]}


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_every_rank_issues_the_same_collectives_in_the_same_order(pool2, slow_rank):
    results = pool2.run(_collective_log, slow_rank, timeout_s=TIMEOUT_S)
    logs = results[0]["logs"]
    assert len(logs[0]) > 10 and logs[0] == logs[1]
    # rank 1 skips the extra layer at step 1: the first unit in backward order waits for it, and every unit
    # after that one, so rank 1 starts them in step(), the same collectives in the same place of the sequence
    assert all(started > 0 for started in results[0]["started"]), results[0]["started"]
    assert results[1]["started"][1] == 0 and results[1]["started"][0] > 0 and results[1]["started"][2] > 0


def test_overlap_refuses_clipping():
    weights = [layer.weight for layer in Net().layers]
    with pytest.raises(ValueError, match="overlap_backward=True needs max_grad_norm=0"):
        shardopt.Dion(weights, max_grad_norm=1.0, overlap_backward=True)
    opt = shardopt.Dion(weights, overlap_backward=True)
    with pytest.raises(RuntimeError, match="clip_grad_norm_ with overlap_backward=True"):
        opt.clip_grad_norm_(1.0)
    assert not shardopt.Dion(weights).overlap_backward            # off unless asked for
    assert not shardopt.Dion(weights, max_grad_norm=1.0).overlap_backward


def test_single_process_overlap_is_bitwise_and_warns_on_changed_gradients(caplog):
    def train(overlap, clip_between):
        net = Net()
        opt = shardopt.SignMuon(shardopt.param_groups(net, "signmuon", "adamw"), lr=0.01, overlap_backward=overlap)
        for step in range(3):
            net(_batch(0, step)).square().mean().backward()
            if clip_between:
                for p in net.parameters():
                    p.grad.mul_(0.5)     # what an unscale or clip between backward and step() does
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in net.parameters()], list(opt.state_dict()["state"])
    for clip_between in (False, True):
        with caplog.at_level("WARNING", logger="shardopt"):
            (off, off_order), (on, on_order) = train(False, clip_between), train(True, clip_between)
            assert all(torch.equal(a, b) for a, b in zip(off, on))
            assert on_order == off_order == sorted(off_order)    # the state in param order, as without overlap
    assert "gradients changed between backward and step()" in caplog.text


def test_load_state_dict_keeps_one_hook_per_param_and_off_removes_them():
    """torch.optim's load_state_dict calls __setstate__ on the optimizer itself: its params keep one hook each
    (not one more per load), and overlap_backward=False then leaves none (a leftover hook would start a round
    after overlap was turned off, which HF Trainer does when max_grad_norm clips)."""
    net = Net()
    opt = shardopt.SignMuon(shardopt.param_groups(net, "signmuon", "adamw"), lr=0.01, overlap_backward=True)
    net(_batch(0, 0)).square().mean().backward()
    opt.step()
    for _ in range(2):
        opt.load_state_dict(opt.state_dict())
    hooks = lambda: [len(p._post_accumulate_grad_hooks or {}) for p in net.parameters()]   # noqa: E731
    assert hooks() == [1] * len(list(net.parameters()))
    opt.overlap_backward = False
    assert hooks() == [0] * len(list(net.parameters()))
    opt.zero_grad()
    net(_batch(0, 1)).square().mean().backward()
    assert opt.backward_overlap is None         # no work began in this backward
