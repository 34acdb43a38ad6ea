"""Scaling the step (docs/design.md §9): bucket cap, split orthonormalization work, state dtype,
randomized Cholesky-QR, and params agreed when some ranks lack a gradient.

Pinned here:
- Transient step memory (RSS high-water above the steady state, fresh process) stays within the
  parameters' bytes and does not grow with the number of matrices: scaled down in the default
  suite (256×256 matrices, 1 MiB cap), at the issue's size (1024×1024, default cap) under `slow`.
- The bucket cap changes the memory, not the result.
- Dion's orthonormalization is split over the ranks: at 4 replicas each rank orthonormalizes
  1/4 of the matrices (counted FLOPs ≤ 0.35× one replica's), with the replicate-axis bytes of
  docs/design.md's formula, and the weights of a single-process float64 Dion fed the mean gradient;
  on the shard axis (FSDP2, HSDP) likewise, against tests/reference.py.
- state_dtype: fp32 momentum for bf16 params (and back through state_dict); bad values raise.
- qr_method="rcqr" is orthonormal on ill-conditioned inputs and Dion with it follows the float64
  reference.
- A param whose gradient is missing on some ranks is stepped on all of them (zeros where
  missing); one missing on every rank is skipped on all of them; nobody hangs.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  imported once before the pools fork (see workers.py)
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401

import reference
import shardopt
from shardopt.optim import traffic
from shardopt.layout.buckets import chunk_sizes
from shardopt.wire.comm import collective_bytes
from shardopt.algorithms.lowrank import orthonormalize

ROOT = Path(__file__).resolve().parents[1]


# ---- transient memory ---------------------------------------------------------------------------
def _memory_rows(*args):
    done = subprocess.run([sys.executable, str(ROOT / "launch" / "bench" / "step_memory.py"), "--json", *args],
                          capture_output=True, text=True, timeout=3000, check=True)
    return {(row["algorithm"], row["matrices"]): row for row in json.loads(done.stdout.strip().splitlines()[-1])}


def _check_memory(rows):
    for algorithm in ("dion", "signmuon"):
        small, large = rows[(algorithm, 32)], rows[(algorithm, 128)]
        assert large["transient_mib"] <= 1.0 * large["param_mib"], large
        assert large["transient_mib"] <= 1.5 * small["transient_mib"], (small, large)


def test_transient_step_memory_bounded_by_bucket_cap_scaled_down():
    _check_memory(_memory_rows("--size", "256", "--bucket-bytes", str(2**20)))


@pytest.mark.slow
def test_transient_step_memory_bounded_on_128_bf16_1024x1024_matrices():
    _check_memory(_memory_rows())


def test_chunk_sizes_cap_bytes_and_keep_multiples_of_the_split():
    assert chunk_sizes(10, 4, 16) == [4, 4, 2]
    assert chunk_sizes(3, 100, 16) == [1, 1, 1]                # a matrix over the cap is a bucket of its own
    assert chunk_sizes(10, 4, 16, split=3) == [3, 3, 3, 1]      # multiples of the split
    assert chunk_sizes(10, 100, 16, split=4) == [4, 4, 2]       # at least the split
    assert chunk_sizes(2, 4, 64, split=4) == [2]


@pytest.mark.parametrize("algorithm", ["dion", "signmuon"])
def test_bucket_cap_changes_memory_not_result(algorithm):
    def run(bucket_bytes):
        generator = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(12, 8, generator=generator, dtype=torch.float64)) for _ in range(5)]
        if algorithm == "dion":
            opt = shardopt.Dion(params, rank_fraction=0.5, bucket_bytes=bucket_bytes)
        else:
            opt = shardopt.SignMuon(params, lr=0.01, ns_dtype="float64", bucket_bytes=bucket_bytes)
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator, dtype=torch.float64)
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in params])
    torch.testing.assert_close(run(1), run(2**30), rtol=1e-12, atol=1e-12)


def test_bad_bucket_bytes_raises_value_error():
    with pytest.raises(ValueError, match="bucket_bytes"):
        shardopt.Dion([torch.nn.Parameter(torch.zeros(4, 4))], bucket_bytes=0)


# ---- state dtype --------------------------------------------------------------------------------
def test_state_dtype_float32_for_bfloat16_params_and_through_state_dict():
    generator = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(16, 8, generator=generator).bfloat16())]
    opt = shardopt.SignMuon(params, lr=0.01, momentum=0.9, state_dtype="float32")
    grad = torch.randn(16, 8, generator=generator)
    params[0].grad = grad.bfloat16()
    opt.step()
    momentum = opt.state[params[0]]["momentum"]
    assert momentum.dtype == torch.float32
    torch.testing.assert_close(momentum, 0.1 * grad.bfloat16().float(), rtol=0, atol=0)  # fp32 EMA, not rounded
    saved = opt.state_dict()
    fresh = shardopt.SignMuon(params, lr=0.01, momentum=0.9, state_dtype="float32")
    fresh.load_state_dict(saved)
    assert fresh.state[params[0]]["momentum"].dtype == torch.float32
    assert torch.equal(fresh.state[params[0]]["momentum"], momentum)


def test_dion_state_dtype_bfloat16_for_float32_params():
    params = [torch.nn.Parameter(torch.randn(16, 8))]
    opt = shardopt.Dion(params, rank_fraction=0.5, state_dtype="bfloat16")
    params[0].grad = torch.randn(16, 8)
    opt.step()
    assert {opt.state[params[0]][k].dtype for k in ("momentum", "Q")} == {torch.bfloat16}
    assert params[0].dtype == torch.float32 and torch.isfinite(params[0]).all()


def test_bad_state_dtype_raises_value_error_naming_it():
    with pytest.raises(ValueError, match="state_dtype"):
        shardopt.Dion([torch.nn.Parameter(torch.zeros(4, 4))], state_dtype="int8")


# ---- randomized Cholesky-QR ---------------------------------------------------------------------
def test_rcqr_orthonormal_basis_of_same_span_on_ill_conditioned_input():
    generator = torch.Generator().manual_seed(2)
    U, _ = torch.linalg.qr(torch.randn(3, 300, 40, generator=generator, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(3, 40, 40, generator=generator, dtype=torch.float64))
    P = (U * torch.logspace(0, -5, 40, dtype=torch.float64)) @ V.mT       # condition number 1e5
    Q = orthonormalize(P.float(), "rcqr", seed=5).double()
    eye = torch.eye(40, dtype=torch.float64)
    assert (Q.mT @ Q - eye).abs().max() <= 1e-4
    assert (P - Q @ (Q.mT @ P)).norm() / P.norm() <= 1e-5
    Q64 = orthonormalize(P, "rcqr", seed=5)
    assert (Q64.mT @ Q64 - eye).abs().max() <= 1e-12


def test_dion_rcqr_matches_float64_reference():
    hyper = dict(lr=0.02, mu=0.9, weight_decay=0.1)
    generator = torch.Generator().manual_seed(3)
    shapes = [(48, 24), (24, 48), (48, 24)]
    initial = [torch.randn(*s, generator=generator, dtype=torch.float64) for s in shapes]
    params = [torch.nn.Parameter(x.clone()) for x in initial]
    opt = shardopt.Dion(params, rank_fraction=0.25, qr_method="rcqr", seed=4, **hyper)
    loops = []
    for index, X in enumerate(initial):
        m, n = X.shape
        r = shardopt.algorithms.lowrank.dion_rank(m, n, 0.25, 1)
        loops.append([X, torch.zeros_like(X), reference.initial_q(min(m, n), r, reference.optimizer_param_seed(4, index))])
    for step in range(10):
        for index, param in enumerate(params):
            param.grad = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            X, M, Q = loops[index]
            loops[index] = list(reference.dion_step(X, param.grad, M, Q, transpose=X.shape[0] < X.shape[1], **hyper))
        opt.step()
    for param, loop in zip(params, loops):
        assert ((param - loop[0]).norm() / loop[0].norm()).item() <= 1e-9


# ---- split orthonormalization work (multi-process) ------------------------------------------------
SPLIT_SHAPE, SPLIT_COUNT, SPLIT_STEPS = (32, 16), 8, 4


def _split_dion_run(use_mesh, wire_dtype):
    """Dion 1/4 on 8 same-shape matrices (one bucket), replicas on the world or one process alone,
    counting the matrices and FLOPs (2·a·r² each, Householder) that this rank orthonormalizes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    counted = {"matrices": 0, "flops": 0}
    original = shardopt.algorithms.dion.orthonormalize

    def counting(P, method="qr", seed=0):
        counted["matrices"] += P.shape[0]
        counted["flops"] += 2 * P.shape[0] * P.shape[1] * P.shape[2] ** 2
        return original(P, method, seed)
    shardopt.algorithms.dion.orthonormalize = counting
    try:
        hyper = dict(lr=0.02, mu=0.9, weight_decay=0.1)
        generator = torch.Generator().manual_seed(0)
        initial = [torch.randn(*SPLIT_SHAPE, generator=generator, dtype=torch.float64) for _ in range(SPLIT_COUNT)]
        params = [torch.nn.Parameter(x.clone()) for x in initial]
        opt = shardopt.Dion(params, rank_fraction=0.25, replicate_mesh=dist.group.WORLD if use_mesh else None,
                            seed=1, wire_dtype=wire_dtype, **hyper)
        m, n = SPLIT_SHAPE
        r = shardopt.algorithms.lowrank.dion_rank(m, n, 0.25, 1)
        loops = [[X, torch.zeros_like(X), reference.initial_q(n, r, reference.optimizer_param_seed(1, i))]
                 for i, X in enumerate(initial)]
        for step in range(SPLIT_STEPS):
            for index, param in enumerate(params):
                grads = [torch.randn(*SPLIT_SHAPE, generator=torch.Generator().manual_seed(1000 * j + 10 * step + index),
                                     dtype=torch.float64) for j in range(world)]
                param.grad = grads[rank] if use_mesh else sum(grads) / world
                X, M, Q = loops[index]
                loops[index] = list(reference.dion_step(X, sum(grads) / world, M, Q, transpose=False, **hyper))
            opt.step()
        error = max(((p - loop[0]).norm() / loop[0].norm()).item() for p, loop in zip(params, loops))
        return {**counted, "error": error, "bytes": opt.comm_stats()["replicate"]["bytes_sent"],
                "params": torch.cat([p.detach().reshape(-1) for p in params]), "consistent": opt.replicas_consistent()}
    finally:
        shardopt.algorithms.dion.orthonormalize = original


# (wire dtype, relative error bound vs the float64 reference): float32 as the reference's 1e-6; bfloat16
# rounds P (and the orthonormalized P that the owners gather) and R to 8 mantissa bits, as test_replicate.py
@pytest.mark.parametrize("wire_dtype, tolerance", [("float32", 1e-6), ("bfloat16", 1e-3)])
def test_dion_orthonormalization_split_over_4_replicas_same_bytes(pool4, wire_dtype, tolerance):
    split = pool4.run(_split_dion_run, True, wire_dtype)
    alone = pool4.run(_split_dion_run, False, wire_dtype)[0]
    m, n = SPLIT_SHAPE
    r = shardopt.algorithms.lowrank.dion_rank(m, n, 0.25, 1)
    wire = torch.empty(0, dtype=getattr(torch, wire_dtype)).element_size()
    for result in split:
        assert result["flops"] <= 0.35 * alone["flops"], (result["flops"], alone["flops"])
        assert result["matrices"] == SPLIT_COUNT * SPLIT_STEPS // 4
        assert result["error"] <= tolerance
        # docs/design.md §1: 2(M−1)/M·(a + b)·r·wire bytes per matrix per step, plus the one-float check,
        # plus step 1's double-averaging check
        design = SPLIT_COUNT * collective_bytes("all_reduce", (m + n) * r * wire, 4) + collective_bytes("all_reduce", 4, 4)
        assert result["bytes"] == SPLIT_STEPS * design + traffic.double_averaging_check_bytes(4)
        assert torch.equal(result["params"], split[0]["params"]) and result["consistent"]
    assert alone["error"] <= 1e-6 and alone["bytes"] == 0   # one replica: nothing exchanged, nothing rounded


def _split_dion_sharded(replicate, shard):
    """FSDP2 (1×4) or HSDP (2×2): 4 same-shape row-sharded matrices, Dion 1/4 against the float64 reference;
    returns the error and the matrices this rank orthonormalized."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    counted = {"matrices": 0}
    original = shardopt.algorithms.dion.orthonormalize

    def counting(P, method="qr", seed=0):
        counted["matrices"] += P.shape[0]
        return original(P, method, seed)
    shardopt.algorithms.dion.orthonormalize = counting
    try:
        mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
        hyper = dict(lr=0.02, mu=0.9, weight_decay=0.1)
        generator = torch.Generator().manual_seed(0)
        model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(24, 16, generator=generator, dtype=torch.float64))
                                       for _ in range(4))
        initial = [p.detach().clone() for p in model]
        fully_shard(model, mesh=mesh["shard"])
        params = list(model.parameters())
        opt = shardopt.Dion(params, rank_fraction=0.25, replicate_mesh=mesh["replicate"], seed=3, wire_dtype="float32",
                            **hyper)
        r = shardopt.algorithms.lowrank.dion_rank(24, 16, 0.25, 1)
        refs = [[X, torch.zeros_like(X), reference.initial_q(24, r, reference.optimizer_param_seed(3, i))]
                for i, X in enumerate(initial)]
        replica = mesh.get_local_rank("replicate")
        for step in range(3):
            for index, param in enumerate(params):
                grads = [torch.randn(24, 16, generator=torch.Generator().manual_seed(100 * j + 10 * step + index),
                                     dtype=torch.float64) for j in range(replicate)]
                layout = shardopt.layout.placement.matrix_layout(param)
                rows = grads[replica][layout.row_start:layout.row_start + layout.rows]
                param.grad = DTensor.from_local(rows, param.device_mesh, param.placements, run_check=False,
                                                shape=param.shape, stride=param.stride())
                X, M, Q = refs[index]
                refs[index] = list(reference.dion_step(X, sum(grads) / replicate, M, Q, transpose=True, **hyper))
            opt.step()
        error = max(((p.full_tensor() - ref[0]).norm() / ref[0].norm()).item() for p, ref in zip(params, refs))
        return {"error": error, "matrices": counted["matrices"], "consistent": opt.replicas_consistent()}
    finally:
        shardopt.algorithms.dion.orthonormalize = original


@pytest.mark.parametrize("mesh", [(1, 4), (2, 2)], ids=["fsdp_1x4", "hsdp_2x2"])
def test_dion_orthonormalization_split_over_shard_axis_matches_reference(pool4, mesh):
    for result in pool4.run(_split_dion_sharded, *mesh):
        assert result["error"] <= 1e-6
        assert result["matrices"] == 3 * 4 // 4      # each of 4 ranks: one matrix of 4 per step
        assert result["consistent"]


# ---- params agreed when gradients are missing on some ranks ----------------------------------------
def _missing_gradients_run(algorithm):
    """Three params: #0 has a gradient everywhere, #1 only on ranks ≠ 0, #2 nowhere."""
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 8, generator=generator, dtype=torch.float64)) for _ in range(3)]
    before = [p.detach().clone() for p in params]
    if algorithm == "dion":
        opt = shardopt.Dion(params, rank_fraction=0.5, replicate_mesh=dist.group.WORLD)
    else:
        opt = shardopt.SignMuon(params, lr=0.01, ns_dtype="float64", replicate_mesh=dist.group.WORLD)
    for step in range(2):
        params[0].grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank * 10 + step), dtype=torch.float64)
        params[1].grad = None if rank == 0 else params[0].grad.clone()
        params[2].grad = None
        opt.step()
    return {"moved": [not torch.equal(p, b) for p, b in zip(params, before)], "has_state": [p in opt.state for p in params],
            "params": torch.cat([p.detach().reshape(-1) for p in params]), "consistent": opt.replicas_consistent()}


@pytest.mark.parametrize("algorithm", ["dion", "signmuon"])
def test_param_missing_gradient_on_some_ranks_is_stepped_on_all_and_on_none_is_skipped(pool4, algorithm):
    results = pool4.run(_missing_gradients_run, algorithm, timeout_s=60)
    for result in results:
        assert result["moved"] == [True, True, False]
        assert result["has_state"] == [True, True, False]
        assert result["consistent"] and torch.equal(result["params"], results[0]["params"])
    assert math.isfinite(float(results[0]["params"].sum()))


# ---- torch.compile option -------------------------------------------------------------------------
def test_compile_falls_back_to_eager_when_compiling_fails(monkeypatch, caplog):
    polar_module = sys.modules["shardopt.algorithms.polar"]   # the module (shardopt.algorithms.polar is also the function)

    def failing(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("no compiler here")
        return compiled
    monkeypatch.setattr(torch, "compile", failing)
    monkeypatch.setattr(polar_module, "_compiled", {})
    G = torch.randn(3, 8, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with caplog.at_level("WARNING", logger="shardopt"):
        got = polar_module.polar(G, 5, torch.float64, compile=True)
    assert torch.equal(got, polar_module.polar(G, 5, torch.float64))
    assert "torch.compile of Newton–Schulz failed" in caplog.text
    assert "failed" in polar_module._compiled


def test_bad_compile_flag_raises_value_error():
    with pytest.raises(ValueError, match="compile"):
        shardopt.SignMuon([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.01, compile="yes")


# ---- the vote's temporaries -------------------------------------------------------------------------
def _vote_temporaries(fmt, n):
    """Every tensor the vote's ops produce on this rank: (op name, dtype, numel)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardopt.optim.schedule import complete
    from shardopt.wire.vote import FORMATS
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor):
                    seen.append((str(func), tensor.dtype, tensor.numel()))
            return out
    positive = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank())) >= 0
    with Record():
        V = complete(FORMATS[fmt].exchange(positive, shardopt.wire.comm.Axis("replicate", dist.group.WORLD), seed=9))
    return {"seen": seen, "V": V}


@pytest.mark.parametrize("fmt", ["allreduce_int8", "allgather_1bit", "alltoall_1bit"])
def test_vote_makes_no_int64_or_replicas_by_entries_temporaries_and_draws_only_owned_coins(pool4, fmt):
    n = 4096
    results = pool4.run(_vote_temporaries, fmt, n)
    for result in results:
        wide = [s for s in result["seen"] if s[1] == torch.int64 and s[2] > 1]
        assert not wide, wide
        largest = max(s[2] * s[1].itemsize for s in result["seen"])
        assert largest <= n, largest                      # bytes: at most one byte per entry (M·n would be 4n)
        # the coins' one draw: hash bytes over an int32 index of ⌈entries/8⌉ (docs/design.md §2), 8 entries each
        coins = [8 * s[2] for s in result["seen"] if "arange" in s[0] and s[1] == torch.int32]
        assert coins == ({"allreduce_int8": [], "allgather_1bit": [n], "alltoall_1bit": [n // 4]}[fmt])
        assert torch.equal(result["V"], results[0]["V"])


def _vote_ops(fmt: str, voters: int, abstain: bool, matrices: int) -> tuple[int, int]:
    """(aten ops, host syncs) of one vote on 7680 entries (a multiple of 8·M: no padding) at `voters` replicas
    (a counting axis: the same ops as on a process group, nothing moves), after one vote made the tables."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardopt.optim.schedule import complete
    from shardopt.wire.comm import CountingAxis
    from shardopt.wire.vote import FORMATS
    counted = {"ops": 0, "syncs": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counted["ops"] += 1
            counted["syncs"] += func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.equal)
            return func(*args, **(kwargs or {}))
    positive = torch.rand(7680, generator=torch.Generator().manual_seed(0)) < 0.5
    options = {"abstain": positive.roll(1) & ~positive if abstain else None,
               "silent": torch.arange(matrices) % 3 == 0 if matrices else None}
    complete(FORMATS[fmt].exchange(positive, CountingAxis("replicate", voters), 1, **options))
    with Count():
        complete(FORMATS[fmt].exchange(positive, CountingAxis("replicate", voters), 1, **options))
    return counted["ops"], counted["syncs"]


@pytest.mark.parametrize("fmt", ["allreduce_int8", "allgather_1bit", "alltoall_1bit"])
@pytest.mark.parametrize("abstain, matrices", [(False, 0), (True, 0), (False, 4)])
def test_vote_issues_the_same_few_ops_at_any_replica_count_and_no_host_sync(fmt, abstain, matrices):
    """The counts are taken per bit plane and the coins in one draw, so a vote dispatches a fixed number of
    ops at 4, 8, 64 or 120 replicas (even counts: ties, so coins are drawn at each), and reads nothing back."""
    counted = {voters: _vote_ops(fmt, voters, abstain, matrices) for voters in (4, 8, 64, 120)}
    assert len(set(counted.values())) == 1, counted
    ops, syncs = counted[4]
    assert syncs == 0 and ops <= 160, counted
