"""Replicate axis (data parallel): the optimizers' own compressed exchange instead of a gradient all-reduce.

Every case runs on gloo worker pools of 2, 3 and 4 ranks (one pool per world size,
started once for the module); each rank is one replica with its own gradients.
Pinned here:
- Dion (compressed and fallback) equals a single-process float64 Dion fed the mean
  gradient; decoupled momenta differ across replicas until synchronize_for_checkpoint()
  makes each the mean.
- Sign-Muon's vote equals sign(Σ sign(polar(Mᵢ))) computed from every replica's
  direction, exactly, with each format's tie rule (abstain for "allreduce_int8", the
  shared coins for the 1-bit formats: `reference.coins(bucket_seed, n)`, docs/design.md §2's hash).
- Parameters stay bit-identical on all replicas in every mode.
- comm_stats() equals docs/design.md's byte formulas; the 768×3072 ratios against an fp32 ring all-reduce.
- Bad replicate meshes and vote names raise ValueError.
"""

import math

import pytest
import torch
import torch._dynamo  # noqa: F401  torch.optim imports it on first use (seconds); import it once before the pools fork
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401  same: DeviceMesh/DTensor machinery, imported once

import reference
import shardopt
from shardopt.optim import traffic
from shardopt.wire.comm import Axis, collective_bytes
from shardopt.layout.placement import MatrixLayout
from shardopt.optim.schedule import complete
from shardopt.wire.vote import FORMATS, resolve_vote, vote_bytes

WORLD_SIZES = [2, 3, 4]
TIMEOUT_S = 60
OPT_SEED = 7

# Dion: a tall pair (one bucket) and a wide matrix (transposed). At rank_fraction 1/4 every
# r = 3 and (a+b)·r < a·b; every a·r, b·r, a·b is a multiple of 3, so no ring byte count rounds.
DION_SHAPES = [(24, 12), (24, 12), (12, 36)]
# Sign-Muon: two buckets of n = 768 entries each (768 is a multiple of 8·M for M = 2, 3, 4).
SIGN_SHAPES = [(24, 16), (24, 16), (16, 48)]
SIGN_BUCKETS = [[0, 1], [2]]


# ---- helpers run on the workers -----------------------------------------------------------------
def _replicate_mesh(kind):
    if kind == "device_mesh":
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh("cpu", (dist.get_world_size(),))
    return dist.group.WORLD


def _matrices(shapes, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype))
            for shape in shapes]


def _gradient(replica, step, index, shape, dtype=torch.float64):
    """The gradient replica `replica` sees at `step` for parameter `index` (different on every replica)."""
    generator = torch.Generator().manual_seed(10_000 * replica + 100 * step + index)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)


def _gather(tensor):
    """(M, …): `tensor` from every rank, in rank order (the test's own collective, not counted)."""
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return torch.stack(out)


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _relative_error(got, want):
    return ((got - want).norm() / want.norm()).item()


def _dion_run(rank_fraction, mesh_kind, wire_dtype="float32", steps=20, check_at=10):
    """Dion on this replica's gradients beside two single-process float64 Dions fed the mean
    gradient: shardopt.Dion without a mesh, and tests/reference.py's dion_step (docs/design.md §1 as loops)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    hyper = dict(lr=0.02, mu=0.9, weight_decay=0.1)
    params, ref_params = _matrices(DION_SHAPES), _matrices(DION_SHAPES)
    opt = shardopt.Dion(params, rank_fraction=rank_fraction, replicate_mesh=_replicate_mesh(mesh_kind),
                        seed=OPT_SEED, wire_dtype=wire_dtype, **hyper)
    ref = shardopt.Dion(ref_params, rank_fraction=rank_fraction, seed=OPT_SEED, **hyper)
    loops = []   # [X, M, Q] per matrix for reference.dion_step
    for index, X in enumerate(_matrices(DION_SHAPES)):
        m, n = X.shape
        r = shardopt.algorithms.lowrank.dion_rank(m, n, rank_fraction, 1)
        loops.append([X.detach(), torch.zeros_like(X), reference.initial_q(m if m < n else n, r,
                                                                           reference.optimizer_param_seed(OPT_SEED, index))])
    out = {}
    for step in range(steps):
        for index, (param, ref_param) in enumerate(zip(params, ref_params)):
            param.grad = _gradient(rank, step, index, param.shape)
            ref_param.grad = sum(_gradient(j, step, index, param.shape) for j in range(world)) / world
            X, M, Q = loops[index]
            loops[index] = list(reference.dion_step(X, ref_param.grad, M, Q, transpose=X.shape[0] < X.shape[1],
                                                    **hyper))
        opt.step()
        ref.step()
        if step + 1 == check_at:
            out["errors"] = [_relative_error(p, q) for p, q in zip(params, ref_params)]
            out["loop_errors"] = [_relative_error(p, loop[0]) for p, loop in zip(params, loops)]
            out["stats"] = opt.comm_stats()
            out["momenta"] = _flat(opt.state[p]["momentum"] for p in params)
            out["ref_momenta"] = _flat(ref.state[q]["momentum"] for q in ref_params)
            opt.synchronize_for_checkpoint()
            out["synced_momenta"] = _flat(opt.state[p]["momentum"] for p in params)
    out["final_errors"] = [_relative_error(p, q) for p, q in zip(params, ref_params)]
    out["params"] = _flat(params)
    out["consistent"] = opt.replicas_consistent()
    return out


def _bucket_seed(first_index, step):
    """The seed ShardOptimizer passes a bucket step (plan.group_steps) whose first param has index
    `first_index`, at the bucket's step count `step` (1 on the first step)."""
    param_seed = (OPT_SEED * 1_000_003 + first_index) % 2**63
    return (param_seed * 1_000_003 + step) % 2**63


def _signmuon_run(vote_name, steps=20):
    """Sign-Muon with lr 1, wd 0 from X = 0: X stays integral, so X_old − X_new = V exactly.
    Each step the test gathers every replica's float64 polar direction and forms the vote itself."""
    world, rank = dist.get_world_size(), dist.get_rank()
    beta = 0.8
    params = [torch.nn.Parameter(torch.zeros(*shape, dtype=torch.float64)) for shape in SIGN_SHAPES]
    opt = shardopt.SignMuon(params, lr=1.0, momentum=beta, weight_decay=0.0, ns_dtype="float64", vote=vote_name,
                            replicate_mesh=dist.group.WORLD, seed=OPT_SEED)
    momenta = [torch.zeros(*shape, dtype=torch.float64) for shape in SIGN_SHAPES]
    mismatches = ties = tie_plus = tie_minus = 0
    momentum_error = 0.0
    formats = set()
    for step in range(steps):
        before = [p.detach().clone() for p in params]
        for index, param in enumerate(params):
            param.grad = _gradient(rank, step, index, param.shape)
            momenta[index] = beta * momenta[index] + (1 - beta) * param.grad
        opt.step()
        for bucket in SIGN_BUCKETS:
            got = _flat(before[i] - params[i] for i in bucket)                       # V from the weights
            state_momenta = [opt.state[params[i]]["momentum"] for i in bucket]
            momentum_error = max(momentum_error, max((s - momenta[i]).abs().max().item()
                                                     for s, i in zip(state_momenta, bucket)))
            positive = _flat(shardopt.polar(m, 5, torch.float64) >= 0 for m in state_momenta)
            total = (2 * _gather(positive.to(torch.int8)).to(torch.int32) - 1).sum(dim=0)   # Σ sign(polar(Mᵢ))
            expected = torch.sign(total)
            fmt = resolve_vote(vote_name, positive.numel(), world)
            formats.add(fmt)
            tie = total == 0
            if fmt != "allreduce_int8" and world % 2 == 0:
                coins = reference.coins(_bucket_seed(bucket[0], step + 1), positive.numel())
                expected = torch.where(tie, coins.to(expected.dtype), expected)
                tie_plus += int((tie & (coins > 0)).sum())
                tie_minus += int((tie & (coins < 0)).sum())
            ties += int(tie.sum())
            mismatches += int((got != expected.to(got.dtype)).sum())
    stats = opt.comm_stats()
    return {"mismatches": mismatches, "ties": ties, "tie_plus": tie_plus, "tie_minus": tie_minus,
            "momentum_error": momentum_error, "formats": sorted(formats), "stats": stats,
            "params": _flat(params), "consistent": opt.replicas_consistent()}


def _vote_direct(fmt, n, seed):
    """A vote format on its own: random signs per replica, a known seed; returns V, the signs, the bytes."""
    axis = Axis("replicate", dist.group.WORLD)
    generator = torch.Generator().manual_seed(500 + dist.get_rank())
    positive = torch.rand(n, generator=generator) < 0.5
    V = complete(FORMATS[fmt].exchange(positive, axis, seed))
    return {"V": V, "positive": positive, "stats": axis.stats()}


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 12)
        self.fc = torch.nn.Linear(12, 24)
        self.norm = torch.nn.LayerNorm(24)
        self.proj = torch.nn.Linear(24, 12)
        self.head = torch.nn.Linear(12, 10)

    def forward(self, tokens):
        h = self.embedding(tokens)
        h = self.proj(torch.relu(self.norm(self.fc(h)))) + h
        return self.head(h)


def _model_run(matrix_algorithm, steps=20, qr_method="qr"):
    """A small model: 2-D weights by `matrix_algorithm` (Dion with `qr_method`), embedding and head by AdamW,
    norms and biases by Lion; every replica trains on its own tokens."""
    torch.manual_seed(0)
    model = _Model().double()
    matrices = [model.fc.weight, model.proj.weight]
    adamw = [model.embedding.weight, model.head.weight, model.head.bias]
    lion = [model.fc.bias, model.proj.bias, model.norm.weight, model.norm.bias]
    groups = [{"params": matrices, "algorithm": matrix_algorithm},
              {"params": adamw, "algorithm": "adamw", "lr": 1e-2},
              {"params": lion, "algorithm": "lion", "lr": 1e-3}]
    if matrix_algorithm == "dion":
        opt = shardopt.Dion(groups, lr=0.02, rank_fraction=0.25, replicate_mesh=dist.group.WORLD, seed=OPT_SEED,
                            qr_method=qr_method)
    else:
        opt = shardopt.SignMuon(groups, lr=0.01, replicate_mesh=dist.group.WORLD, seed=OPT_SEED)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        tokens = torch.randint(0, 10, (4, 6), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 10), tokens.roll(1, dims=1).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"params": _flat(model.parameters()), "consistent": opt.replicas_consistent()}


def _large_matrix_bytes(world_size_expected):
    """One step on a 768×3072 fp32 matrix (nn.Linear(3072, 768).weight): Sign-Muon alltoall_1bit
    (ns_steps 1; the wire does not depend on it) and Dion at rank_fraction 1/4."""
    assert dist.get_world_size() == world_size_expected
    out = {}
    for name in ("signmuon", "dion"):
        param = torch.nn.Parameter(torch.zeros(768, 3072))
        if name == "signmuon":
            opt = shardopt.SignMuon([param], lr=0.01, ns_steps=1, vote="alltoall_1bit", replicate_mesh=dist.group.WORLD)
        else:
            opt = shardopt.Dion([param], rank_fraction=0.25, replicate_mesh=dist.group.WORLD)
        param.grad = _gradient(dist.get_rank(), 0, 0, param.shape, torch.float32)
        opt.step()
        out[name] = opt.comm_stats()["replicate"]["bytes_sent"]
        out[name + "_consistent"] = opt.replicas_consistent()
    return out


def _bad_replicate_mesh(case):
    """Returns the ValueError message this rank got (None when construction succeeded)."""
    params = [torch.nn.Parameter(torch.randn(8, 4))]
    try:
        if case == "not_a_member":
            only_rank_0 = dist.new_group([0])         # collective: every rank creates it
            shardopt.Dion(params, replicate_mesh=only_rank_0)
        elif case == "two_d_mesh":
            from torch.distributed.device_mesh import init_device_mesh
            world = dist.get_world_size()
            shape = (2, world // 2) if world % 2 == 0 else (1, world)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
            shardopt.SignMuon(params, lr=0.01, replicate_mesh=mesh)
        elif case == "unknown_vote":
            shardopt.SignMuon(params, lr=0.01, vote="allreduce_2bit", replicate_mesh=dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return None


# ---- expected bytes (docs/design.md formulas, written out) ----------------------------------------------
def _check_bytes(M, steps=1):
    """The checks of steps 1 … `steps` on the replicate axis: every step all-reduces one float32 (the
    non-finite gradient check in ShardOptimizer.step, so all ranks skip together), 2(M−1)·4/M bytes,
    one call; step 1 (and every double_averaging_check_every-th after) also all-reduces 3 int64 (the
    double-averaging check), 2(M−1)·24/M bytes, one call."""
    return steps * collective_bytes("all_reduce", 4, M) \
        + reference.double_averaging_checks(steps) * traffic.double_averaging_check_bytes(M)


def _dion_design_bytes(M, rank_fraction, itemsize=8):
    """Replicate bytes per step for DION_SHAPES, whole matrices at M replicas (reference.dion_bytes):
    2(M−1)/M·(a·r + b·r)·itemsize per matrix when compressed, 2(M−1)/M·a·b·8 on the fallback."""
    sizes = {"replicate": M, "shard": 1, "tensor": 1}
    return sum(reference.dion_bytes(MatrixLayout((m, n), (m,)), rank_fraction, itemsize, sizes)["replicate"]
               for m, n in DION_SHAPES)


def _vote_design_bytes(fmt, n, M, matrices=0):
    """docs/design.md §2's table: allreduce_int8 2n(M−1)/M, allgather_1bit n(M−1)/8, alltoall_1bit n(M−1)/(4M),
    and the 1-bit formats' silence flags of `matrices` matrices, (M−1)·⌈matrices/8⌉."""
    flags = 0 if fmt == "allreduce_int8" else (M - 1) * -(-matrices // 8)
    return {"allreduce_int8": 2 * n * (M - 1) // M, "allgather_1bit": n * (M - 1) // 8,
            "alltoall_1bit": n * (M - 1) // (4 * M)}[fmt] + flags


# ---- tests: Dion ------------------------------------------------------------------------------
# Relative error against the float64 single process, by wire dtype (float64 params), as (weights after 10
# and 20 steps, mean of the replicas' momenta): float32 measured ≤ 5e-9, held to the reference's 1e-6;
# bfloat16 (8 mantissa bits on P and R) measured ≤ 3.2e-4 and ≤ 2.2e-3 at 2–4 replicas, held to 1e-3, 5e-3.
WIRE_TOLERANCE = {"float32": (1e-6, 1e-6), "bfloat16": (1e-3, 5e-3)}


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dion_compressed_matches_single_process_float64_on_mean_gradient(pools, world_size, wire_dtype):
    mesh_kind = "device_mesh" if world_size == 3 else "process_group"
    results = pools(world_size).run(_dion_run, 0.25, mesh_kind, wire_dtype, timeout_s=TIMEOUT_S)
    layouts = [shardopt.layout.placement.MatrixLayout(s, (s[0],)) for s in DION_SHAPES]
    assert all(shardopt.algorithms.dion.compressed(layout, {"rank_fraction": 0.25, "rank_multiple_of": 1}) for layout in layouts)
    tolerance, momentum_tolerance = WIRE_TOLERANCE[wire_dtype]
    for result in results:
        assert max(result["errors"]) <= tolerance, result["errors"]            # after 10 steps
        assert max(result["loop_errors"]) <= tolerance, result["loop_errors"]
        assert max(result["final_errors"]) <= tolerance, result["final_errors"]  # after 20 (sync at 10 keeps the mean)
    # decoupled momenta: different on every replica; their mean is the single-process momentum
    momenta = torch.stack([r["momenta"] for r in results])
    assert all(not torch.equal(momenta[i], momenta[0]) for i in range(1, world_size))
    mean = momenta.mean(dim=0)
    assert _relative_error(mean, results[0]["ref_momenta"]) <= momentum_tolerance
    for result in results:   # after synchronize_for_checkpoint: every replica holds the mean, bitwise the same
        assert torch.equal(result["synced_momenta"], results[0]["synced_momenta"])
        assert torch.allclose(result["synced_momenta"], mean, rtol=1e-12, atol=1e-12)
    # 20 steps: bit-identical weights
    assert all(r["consistent"] for r in results)
    assert all(torch.equal(r["params"], results[0]["params"]) for r in results)
    # bytes: 10 steps of 2(M−1)/M·(a·r + b·r)·8 per matrix, nothing on the shard axis
    for result in results:
        stats = result["stats"]
        wire_bytes = torch.empty(0, dtype=getattr(torch, wire_dtype)).element_size()
        assert stats["replicate"]["bytes_sent"] == 10 * _dion_design_bytes(world_size, 0.25, wire_bytes) \
            + _check_bytes(world_size, 10)
        assert stats["replicate"]["bytes_received"] == stats["replicate"]["bytes_sent"]
        # calls per step: the pair's P is split over the replicas (reduce-scatter + all-gather) when
        # 2 is a multiple of M, else all-reduced; the single matrix's P all-reduced; R per bucket; the check
        # (and step 1's double-averaging check)
        pair_p_calls = 2 if 2 % world_size == 0 else 1
        assert stats["replicate"]["calls"] == 10 * (pair_p_calls + 1 + 2 + 1) + 1
        assert stats["shard"]["bytes_sent"] == 0


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dion_fallback_matches_single_process_float64_on_mean_gradient(pools, world_size):
    results = pools(world_size).run(_dion_run, 1.0, "process_group", timeout_s=TIMEOUT_S)
    for result in results:
        assert max(result["errors"]) <= 1e-6, result["errors"]
        assert max(result["loop_errors"]) <= 1e-6, result["loop_errors"]
        assert max(result["final_errors"]) <= 1e-6, result["final_errors"]
        # the gradient is averaged first, so the momenta never diverge
        assert torch.equal(result["momenta"], results[0]["momenta"])
        assert _relative_error(result["momenta"], result["ref_momenta"]) <= 1e-6
        assert result["stats"]["replicate"]["bytes_sent"] == 10 * _dion_design_bytes(world_size, 1.0) \
            + _check_bytes(world_size, 10)
        assert result["stats"]["replicate"]["calls"] == 10 * (2 + 1) + 1
    assert all(r["consistent"] for r in results)
    assert all(torch.equal(r["params"], results[0]["params"]) for r in results)


# ---- tests: Sign-Muon vote ----------------------------------------------------------------------
@pytest.mark.parametrize("vote_name", ["allreduce_int8", "allgather_1bit", "alltoall_1bit", "auto"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_signmuon_vote_equals_sign_of_summed_replica_signs(pools, world_size, vote_name):
    steps = 20
    results = pools(world_size).run(_signmuon_run, vote_name, steps, timeout_s=TIMEOUT_S)
    fmt = resolve_vote(vote_name, 768, world_size)
    if vote_name == "auto":   # fewest bytes: 1-bit gather at 2 replicas (ties alltoall, one call fewer), alltoall beyond
        assert fmt == ("allgather_1bit" if world_size == 2 else "alltoall_1bit")
    for result in results:
        assert result["formats"] == [fmt]
        assert result["mismatches"] == 0
        assert result["momentum_error"] <= 1e-12
    if world_size % 2 == 0:   # ties happened and the tie rule was exercised
        assert results[0]["ties"] > 0
        if fmt != "allreduce_int8":
            assert results[0]["tie_plus"] > 0 and results[0]["tie_minus"] > 0
    else:
        assert results[0]["ties"] == 0
    # 20 steps: bit-identical weights
    assert all(r["consistent"] for r in results)
    assert all(torch.equal(r["params"], results[0]["params"]) for r in results)
    # bytes: docs/design.md's table per bucket of n = 768 entries (2 matrices, then 1) per step (+ the check)
    for result in results:
        sent = result["stats"]["replicate"]["bytes_sent"] - _check_bytes(world_size, steps)
        assert sent == steps * sum(_vote_design_bytes(fmt, 768, world_size, len(b)) for b in SIGN_BUCKETS)
        assert sent == steps * sum(vote_bytes(fmt, 768, world_size, len(b)) for b in SIGN_BUCKETS)
        stats = result["stats"]
        assert stats["shard"]["bytes_sent"] == 0


@pytest.mark.parametrize("fmt", ["allreduce_int8", "allgather_1bit", "alltoall_1bit"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_vote_function_tie_rule_and_padded_bytes(pools, world_size, fmt):
    seed = 12345
    for n in (96, 37):   # 96: no padding; 37: padded to 40 (1-bit) / 8·M bits (alltoall)
        results = pools(world_size).run(_vote_direct, fmt, n, seed, timeout_s=TIMEOUT_S)
        signs = torch.stack([torch.where(r["positive"], 1, -1) for r in results])
        total = signs.sum(dim=0)
        expected = torch.sign(total)
        if fmt != "allreduce_int8" and world_size % 2 == 0:
            expected = torch.where(total == 0, reference.coins(seed, n).to(expected.dtype), expected)
        if world_size % 2 == 0:
            assert (total == 0).any()
        for result in results:
            assert torch.equal(result["V"], expected.to(torch.int8))
            assert result["stats"]["bytes_sent"] == vote_bytes(fmt, n, world_size)
        if n == 96:
            assert results[0]["stats"]["bytes_sent"] == _vote_design_bytes(fmt, n, world_size)
        elif fmt != "allreduce_int8":   # padding costs bytes beyond the unpadded formula
            assert results[0]["stats"]["bytes_sent"] >= _vote_design_bytes(fmt, n, world_size)


# ---- tests: models with element-wise groups -------------------------------------------------------
@pytest.mark.parametrize("matrix_algorithm", ["dion", "signmuon"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_model_with_adamw_and_lion_groups_stays_bit_identical(pools, world_size, matrix_algorithm):
    results = pools(world_size).run(_model_run, matrix_algorithm, timeout_s=TIMEOUT_S)
    assert all(r["consistent"] for r in results)
    assert all(torch.equal(r["params"], results[0]["params"]) for r in results)


@pytest.mark.parametrize("qr_method", ["cholesky", "rcqr"])
def test_dion_cholesky_variants_keep_the_replicas_bit_identical(pools, qr_method):
    """Every rank that orthonormalizes the same P draws the same dither (and sketch) from the shared seed."""
    results = pools(2).run(_model_run, "dion", 20, qr_method, timeout_s=TIMEOUT_S)
    assert all(r["consistent"] for r in results)
    assert all(torch.equal(r["params"], results[0]["params"]) for r in results)


# ---- tests: bytes at GPT-2 scale ------------------------------------------------------------------
def test_768x3072_bytes_against_fp32_ring_allreduce_at_4_replicas(pools):
    M, m, n = 4, 768, 3072
    result = pools(M).run(_large_matrix_bytes, M, timeout_s=TIMEOUT_S)[0]
    fp32_allreduce = 8 * m * n * (M - 1) // M
    assert fp32_allreduce == collective_bytes("all_reduce", 4 * m * n, M)
    r = shardopt.algorithms.lowrank.dion_rank(m, n, 0.25, 1)
    # the exchange itself (the step's checks, 42 bytes at step 1, are separate; see _check_bytes)
    vote_sent, dion_sent = result["signmuon"] - _check_bytes(M), result["dion"] - _check_bytes(M)
    assert vote_sent == m * n * (M - 1) // (4 * M) + (M - 1)    # + one silence-flag byte from each other replica
    assert vote_sent <= fp32_allreduce / 32 + (M - 1)
    assert dion_sent == 2 * (M - 1) * (m + n) * r * 2 // M       # bfloat16 P and R (the default wire_dtype)
    assert dion_sent / fp32_allreduce <= (m + n) * r / (2 * m * n)
    # whole step, check (and Sign-Muon's flag byte) included: within 0.02 % of those ratios
    assert result["signmuon"] / fp32_allreduce <= 1 / 32 * (1 + 2e-4)
    assert result["dion"] / fp32_allreduce <= (m + n) * r / (2 * m * n) * (1 + 1e-4)
    assert result["signmuon_consistent"] and result["dion_consistent"]


# ---- tests: bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_process_group_without_this_rank_raises_value_error(pools, world_size):
    messages = pools(world_size).run(_bad_replicate_mesh, "not_a_member", timeout_s=TIMEOUT_S)
    assert messages[0] is None                     # rank 0 is the group's only member: a 1-replica axis
    for message in messages[1:]:
        assert message is not None and "replicate_mesh" in message and "not a member" in message


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_two_d_device_mesh_as_replicate_mesh_raises_value_error(pools, world_size):
    messages = pools(world_size).run(_bad_replicate_mesh, "two_d_mesh", timeout_s=TIMEOUT_S)
    for message in messages:
        assert message is not None and "replicate_mesh" in message and "1-D DeviceMesh" in message


def test_unknown_vote_raises_value_error(pools):
    messages = pools(2).run(_bad_replicate_mesh, "unknown_vote", timeout_s=TIMEOUT_S)
    for message in messages:
        assert message is not None and "vote" in message and "allreduce_2bit" in message
    with pytest.raises(ValueError, match="vote"):
        shardopt.SignMuon([torch.nn.Parameter(torch.randn(4, 4))], lr=0.01, vote="1bit")
    with pytest.raises(ValueError, match="vote"):
        resolve_vote("1bit", 64, 4)
    with pytest.raises(ValueError, match="vote"):
        vote_bytes("1bit", 64, 4)


# ---- tests: Lion with the 1-bit vote (docs/design.md §3) ----------------------------------------------------
LION_SHAPES = [(40,), (8, 5), (24,)]          # one flat vote of n = 104 entries (a multiple of 8·M for M = 2, 4)
LION_BETAS = (0.9, 0.99)


def _lion_run(fmt, steps=4, zero_index=None):
    """A "lion" group on this replica's gradients (parameter `zero_index`, if given, gets a zero
    gradient on every replica). Returns every step's params and each replica's own momenta."""
    rank = dist.get_rank()
    params = _matrices(LION_SHAPES)
    opt = shardopt.SignMuon([{"params": params, "algorithm": "lion", "lr": 0.01, "weight_decay": 0.1,
                              "betas": LION_BETAS, "vote": fmt}], lr=0.01, replicate_mesh=dist.group.WORLD,
                            seed=OPT_SEED)
    trajectory, stats = [], []
    for step in range(steps):
        for index, param in enumerate(params):
            param.grad = torch.zeros_like(param) if index == zero_index else _gradient(rank, step, index, param.shape)
        opt.reset_comm_stats()
        opt.step()
        stats.append(opt.comm_stats()["replicate"])
        trajectory.append(_flat(params))
    momenta = _flat(opt.state[p]["exp_avg"] for p in params)
    opt.synchronize_for_checkpoint()
    return {"trajectory": trajectory, "momenta": momenta, "synced": _flat(opt.state[p]["exp_avg"] for p in params),
            "stats": stats, "consistent": opt.replicas_consistent()}


def _reference_lion_vote(world, steps, zero_index=None):
    """Distributed Lion from docs/design.md §3 as loops: every replica's own momentum and sign, the majority
    vote (0 on ties and where every replica abstains), float64. Returns the params after each step."""
    x = _flat(_matrices(LION_SHAPES)).clone()
    momenta = [torch.zeros_like(x) for _ in range(world)]
    beta1, beta2 = LION_BETAS
    out = []
    for step in range(steps):
        grads = [_flat(torch.zeros(s, dtype=torch.float64) if i == zero_index else _gradient(j, step, i, s)
                       for i, s in enumerate(LION_SHAPES)) for j in range(world)]
        signs = [torch.sign(beta1 * m + (1 - beta1) * g) for m, g in zip(momenta, grads)]
        V = torch.sign(sum(signs))
        x = (1 - 0.01 * 0.1) * x - 0.01 * V
        momenta = [beta2 * m + (1 - beta2) * g for m, g in zip(momenta, grads)]
        out.append(x)
    return out, momenta


@pytest.mark.parametrize("fmt", ["allreduce_int8", "allgather_1bit", "alltoall_1bit"])
@pytest.mark.parametrize("world_size", [3])
def test_lion_vote_matches_distributed_lion_reference_without_ties(pools, world_size, fmt):
    """Odd replica count and Gaussian gradients: no ties, no zeros, so every format gives the exact vote."""
    results = pools(world_size).run(_lion_run, fmt, timeout_s=TIMEOUT_S)
    want, want_momenta = _reference_lion_vote(world_size, 4)
    for rank, result in enumerate(results):
        for got, expected in zip(result["trajectory"], want):
            assert torch.allclose(got, expected, rtol=0, atol=1e-12)
        assert torch.allclose(result["momenta"], want_momenta[rank], rtol=0, atol=1e-14)   # decoupled: its own
        assert torch.allclose(result["synced"], sum(want_momenta) / world_size, rtol=0, atol=1e-14)
        assert result["consistent"]
        n = sum(math.prod(s) for s in LION_SHAPES)
        for step, stats in enumerate(result["stats"]):   # one vote of n entries, plus the step's checks
            assert stats["bytes_sent"] == vote_bytes(fmt, n, world_size) \
                + _check_bytes(world_size, step + 1) - _check_bytes(world_size, step)


@pytest.mark.parametrize("fmt", ["allreduce_int8", "allgather_1bit", "alltoall_1bit"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_lion_vote_zero_gradient_abstains_and_replicas_stay_identical(pools, world_size, fmt):
    """A parameter with zero gradient and zero momentum on every replica: Lion's sign(0) = 0.
    allreduce_int8 carries the 0, so the parameter only decays; a 1-bit format sends a shared fair
    coin instead (every replica the same, about half the entries each way). Even M: ties exist."""
    zero = 1
    results = pools(world_size).run(_lion_run, fmt, 1, zero, timeout_s=TIMEOUT_S)
    start = _flat(_matrices(LION_SHAPES))
    sizes = [math.prod(s) for s in LION_SHAPES]
    moved = (results[0]["trajectory"][0] - (1 - 0.01 * 0.1) * start).split(sizes)[zero] / -0.01
    assert all(torch.equal(r["trajectory"][0], results[0]["trajectory"][0]) for r in results)
    if fmt == "allreduce_int8":
        assert torch.allclose(moved, torch.zeros_like(moved), atol=1e-12)
    else:
        assert torch.allclose(moved.abs(), torch.ones_like(moved), atol=1e-12)
        assert 0.2 < (moved > 0).double().mean() < 0.8
