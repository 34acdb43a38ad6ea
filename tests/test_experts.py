"""3-D expert stacks (E, m, n) and split (fused) params in the matrix groups (shardopt/layout/matrices.py).

Each expert, and each block of a `split` param, must be stepped exactly as a 2-D param of its
shape would be: checked against the float64 references of tests/reference.py per matrix, on one
process, on 2 replicas, and under FSDP2 `Shard(0)` (whole experts per rank, E not divisible by
the shard size, ranks with no expert), and a fused QKV weight against three separate params.
"""

import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import reference
import shardopt
from shardopt.checkpoint import load_optimizer_state, save_optimizer_state
from shardopt.wire.comm import collective_bytes
from shardopt.algorithms.lowrank import dion_rank
from shardopt.layout.placement import dim0_shards, local
from shardopt.optim.traffic import double_averaging_check_bytes, nonfinite_check_bytes

EXPERT_SHAPES = [(3, 12, 8), (5, 6, 10)]     # tall and wide experts; over 4 ranks (1,1,1,0) and (2,2,1,0)
D, D_KV, N = 8, 4, 8                          # fused QKV: (D + 2·D_KV) × N, split (0, (D, D_KV, D_KV))
DION = dict(lr=0.02, mu=0.9, weight_decay=0.1)
SEED = 3


# ---- helpers (run on the workers, or in this process) -------------------------------------------
class Tensors(nn.Module):
    def __init__(self, tensors):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(t.clone()) for t in tensors)


def _random(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _gradient(replica, step, index, shape):
    return _random(shape, 10_000 * replica + 100 * step + index)


def _mesh(replicate, shard):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))


def _params(tensors, mesh):
    """Params holding `tensors`: plain, or sharded by FSDP2 fully_shard over mesh["shard"]."""
    model = Tensors(tensors)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=mesh["shard"])
    return list(model.parameters())


def _set_grad(param, full_grad):
    """param.grad ← this rank's rows (dim 0) of the full gradient, placed like the param."""
    shards = dim0_shards(param)
    if shards is None:
        param.grad = full_grad.clone()
        return
    from torch.distributed.tensor import DTensor
    sizes, index = shards
    start = sum(sizes[:index])
    param.grad = DTensor.from_local(full_grad[start:start + sizes[index]].clone(), param.device_mesh,
                                    param.placements, run_check=False, shape=param.shape, stride=param.stride())


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _expert_dion_references(tensors, rank_fraction):
    """[X, M, Q, transpose] per matrix of each tensor (each expert of a 3-D one), Q₀ per matrix seed."""
    refs = []
    for index, X in enumerate(tensors):
        experts = X if X.ndim == 3 else X.unsqueeze(0)
        param_seed = reference.optimizer_param_seed(SEED, index)
        matrices = []
        for e, Xe in enumerate(experts):
            m, n = Xe.shape
            transpose = X.ndim == 2 or m < n     # the 2-D params here are row-sharded (or tall: never transposed)
            b = m if transpose else n
            Q = reference.initial_q(b, dion_rank(m, n, rank_fraction, 1), reference.matrix_seed(param_seed, e))
            matrices.append([Xe.clone(), torch.zeros_like(Xe), Q, transpose])
        refs.append(matrices)
    return refs


def _run_dion(replicate, shard, tensors, steps=5, rank_fraction=0.5):
    """Dion (float32 wire) on `tensors` (3-D stacks, 2-D matrices) over a (replicate, shard) mesh
    (1, 1: one process, plain tensors; shard 1: plain tensors, replicas on the world), against the
    float64 reference per matrix. Returns the worst relative error, the bytes and the formulas."""
    distributed = dist.is_initialized()
    mesh = _mesh(replicate, shard) if shard > 1 else None
    replica = mesh.get_local_rank("replicate") if mesh is not None else (dist.get_rank() if distributed else 0)
    params = _params(tensors, mesh)
    if any(X.ndim == 2 for X in tensors):
        assert mesh is not None   # (the references take 2-D params as row-sharded)
    replicate_mesh = mesh["replicate"] if mesh is not None else (dist.group.WORLD if replicate > 1 else None)
    opt = shardopt.Dion(params, rank_fraction=rank_fraction, wire_dtype=torch.float32, replicate_mesh=replicate_mesh,
                        seed=SEED, **DION)
    refs = _expert_dion_references(tensors, rank_fraction)
    for step in range(steps):
        for index, param in enumerate(params):
            _set_grad(param, _gradient(replica, step, index, param.shape))
        opt.step()
        for index, (X, matrices) in enumerate(zip(tensors, refs)):
            G = sum(_gradient(j, step, index, X.shape) for j in range(replicate)) / replicate
            for e, ref in enumerate(matrices):
                Ge = G[e] if X.ndim == 3 else G
                ref[:3] = reference.dion_step(ref[0], Ge, ref[1], ref[2], transpose=ref[3], **DION)
    errors = []
    for param, X, matrices in zip(params, tensors, refs):
        want = torch.stack([ref[0] for ref in matrices]).reshape(X.shape)
        errors.append(((_full(param) - want).norm() / want.norm()).item())
    stats = opt.comm_stats()
    formula = steps * (sum(opt.replicate_bytes_per_step()) + nonfinite_check_bytes(replicate)) \
        + reference.double_averaging_checks(steps) * double_averaging_check_bytes(replicate)   # step 1's guard
    return {"error": max(errors), "replicate_bytes": stats["replicate"]["bytes_sent"], "formula": formula,
            "shard_bytes": stats["shard"]["bytes_sent"], "shard_calls": stats["shard"]["calls"],
            "local_experts": [local(p).shape[0] for p in params if p.ndim == 3],
            "consistent": opt.replicas_consistent(),
            "q_shapes": [tuple(opt.state[p]["Q"].shape) for p in params]}


def _run_signmuon(replicate, shape=(4, 10, 6), steps=4, beta=0.8):
    """Sign-Muon (lr 1, wd 0, from X = 0, so X_old − X_new = V exactly) on a 3-D stack, each replica its
    own gradient; the reference votes on every replica's float64 Newton–Schulz direction per expert
    (ties abstain: vote "allreduce_int8"). Returns the sign agreement, the exact-match flag, ties, bytes."""
    replica = dist.get_rank() if replicate > 1 else 0
    param = nn.Parameter(torch.zeros(*shape, dtype=torch.float64))
    opt = shardopt.SignMuon([param], lr=1.0, momentum=beta, weight_decay=0.0, ns_dtype="float64",
                            vote="allreduce_int8", replicate_mesh=dist.group.WORLD if replicate > 1 else None)
    momenta = [torch.zeros(shape, dtype=torch.float64) for _ in range(replicate)]
    agree = total = ties = 0
    for step in range(steps):
        before = param.detach().clone()
        param.grad = _gradient(replica, step, 0, shape)
        opt.step()
        directions = []
        for j in range(replicate):
            momenta[j] = beta * momenta[j] + (1 - beta) * _gradient(j, step, 0, shape)
            directions.append(torch.stack([reference.newton_schulz(M) for M in momenta[j]]))
        want = reference.vote_signs(directions)
        got = before - param.detach()
        assert set(got.unique().tolist()) <= {-1.0, 0.0, 1.0}
        agree += int((got == want).sum())
        total += want.numel()
        ties += int((want == 0).sum())
    stats = opt.comm_stats()["replicate"]["bytes_sent"]
    formula = steps * (sum(opt.replicate_bytes_per_step()) + nonfinite_check_bytes(replicate)) \
        + reference.double_averaging_checks(steps) * double_averaging_check_bytes(replicate)   # step 1's guard
    return {"agreement": agree / total, "ties": ties, "bytes": stats, "formula": formula,
            "consistent": opt.replicas_consistent()}


def _fused_and_separate(algorithm, shard, steps=3):
    """One fused QKV weight (D + 2·D_KV)×N with split (0, (D, D_KV, D_KV)) against three separate params,
    plain (shard 0) or FSDP2 row-sharded over `shard` ranks. Dion: both start from the same Q (after
    a zero-gradient step that makes the state, the separate params' Q are set to the fused blocks').
    Returns the largest weight and Q difference."""
    mesh = _mesh(1, shard) if shard else None
    full = _random((D + 2 * D_KV, N), 0)
    fused = _params([full], mesh)
    separate = _params(list(full.split((D, D_KV, D_KV))), mesh)
    if algorithm == "dion":
        options = dict(rank_fraction=0.5, wire_dtype=torch.float32, lr=0.02, mu=0.9, weight_decay=0.0)
        make = shardopt.Dion
    else:
        options = dict(lr=0.01, momentum=0.8, ns_dtype="float64", orthogonalize="full" if shard else "shard")
        make = shardopt.SignMuon
    fused_opt = make([{"params": fused, "split": (0, (D, D_KV, D_KV))}], **options)
    separate_opt = make(separate, **options)
    blocks = []   # (Q rows, rank) of each block in the fused Q: every block's b side is its rows here
    start = 0
    for rows in (D, D_KV, D_KV):
        blocks.append((slice(start, start + rows), dion_rank(rows, N, 0.5, 1)))
        start += rows
    if algorithm == "dion":
        for param in fused + separate:
            _set_grad(param, torch.zeros(param.shape, dtype=torch.float64))
        fused_opt.step()
        separate_opt.step()
        fused_q = _full(fused_opt.state[fused[0]]["Q"])
        for param, (rows, rank) in zip(separate, blocks):
            _set_local_rows(separate_opt.state[param]["Q"], fused_q[rows, :rank])
    for step in range(steps):
        G = _gradient(0, step, 0, full.shape)
        _set_grad(fused[0], G)
        for param, block in zip(separate, G.split((D, D_KV, D_KV))):
            _set_grad(param, block)
        fused_opt.step()
        separate_opt.step()
    weights = (_full(fused[0]) - torch.cat([_full(p) for p in separate])).abs().max().item()
    q_difference = 0.0
    if algorithm == "dion":
        fused_q = _full(fused_opt.state[fused[0]]["Q"])
        q_difference = max((fused_q[rows, :rank] - _full(separate_opt.state[p]["Q"])).abs().max().item()
                           for p, (rows, rank) in zip(separate, blocks))
        assert (fused_q[D:, 2:] == 0).all()   # the narrower blocks' padding columns stay zero
    moved = (_full(fused[0]) - full).abs().max().item()
    return {"weights": weights, "q": q_difference, "moved": moved}


def _set_local_rows(state_tensor, full_rows):
    """A state tensor whose dim 0 follows its param's rows ← this rank's rows of `full_rows`."""
    shards = dim0_shards(state_tensor)
    if shards is None:
        state_tensor.copy_(full_rows)
        return
    sizes, index = shards
    start = sum(sizes[:index])
    local(state_tensor).copy_(full_rows[start:start + sizes[index]])


# ---- Sign-Muon ---------------------------------------------------------------------------------------
def test_signmuon_moves_each_expert_by_sign_of_its_polar_momentum_single_process():
    result = _run_signmuon(1)
    assert result["agreement"] == 1.0, result      # no vote, no tie: exact
    assert result["bytes"] == result["formula"] == 0


def test_signmuon_experts_vote_per_expert_on_two_replicas(pool2):
    results = pool2.run(_run_signmuon, 2)
    for result in results:
        assert result["agreement"] >= 0.999, result
        assert result["bytes"] == result["formula"] > 0
        assert result["consistent"]
    assert results[0]["ties"] > 0   # two replicas: abstentions were exercised


@pytest.mark.parametrize("algorithm", ["signmuon", "muon"])
def test_experts_batch_with_same_shape_matrices(algorithm):
    """A (3, 6, 4) stack and a 6×4 matrix form one bucket of 4 matrices; the result equals the
    stack and the matrix stepped in separate groups (Sign-Muon's vote, Muon's polar and scale)."""
    experts, matrix = _random((3, 6, 4), 1), _random((6, 4), 2)
    together = [nn.Parameter(experts.clone()), nn.Parameter(matrix.clone())]
    apart = [nn.Parameter(experts.clone()), nn.Parameter(matrix.clone())]
    options = dict(lr=0.01, ns_dtype="float64")
    opt = shardopt.SignMuon([{"params": together, "algorithm": algorithm}], **options)
    opt_apart = shardopt.SignMuon([{"params": [apart[0]], "algorithm": algorithm},
                                   {"params": [apart[1]], "algorithm": algorithm}], **options)
    group = opt.param_groups[0]
    buckets = list(shardopt.layout.buckets.capped_buckets(together, group, opt.bucket_bytes, lambda layout: 1))
    assert [len(bucket) for _, _, bucket in buckets] == [4]
    for step in range(3):
        for a, b in zip(together, apart):
            a.grad = _gradient(0, step, a.ndim, a.shape)
            b.grad = a.grad.clone()
        opt.step()
        opt_apart.step()
    assert all(torch.equal(a, b) for a, b in zip(together, apart))


# ---- Dion -----------------------------------------------------------------------------------------
def test_dion_experts_match_float64_reference_per_expert_single_process():
    result = _run_dion(1, 1, [_random(shape, i) for i, shape in enumerate(EXPERT_SHAPES)])
    assert result["error"] <= 1e-6, result
    assert result["q_shapes"] == [(3, 8, 4), (5, 6, 3)]     # (E, b, r) per expert


def test_dion_experts_match_float64_reference_on_two_replicas(pool2):
    tensors = [_random(shape, i) for i, shape in enumerate(EXPERT_SHAPES)]
    results = pool2.run(_run_dion, 2, 1, tensors)
    for result in results:
        assert result["error"] <= 1e-6, result
        assert result["replicate_bytes"] == result["formula"] > 0
        assert result["consistent"]


def test_dion_fsdp_shard0_experts_uneven_and_empty_ranks(pool4):
    """E = 3 and 5 over 4 shard ranks: whole experts (1,1,1,0) and (2,2,1,0) per rank, rank 3 holds
    none; no shard-axis collective but the step's non-finite check."""
    tensors = [_random(shape, i) for i, shape in enumerate(EXPERT_SHAPES)]
    results = pool4.run(_run_dion, 1, 4, tensors, timeout_s=120)
    assert [r["local_experts"] for r in results] == [[1, 2], [1, 2], [1, 1], [0, 0]]
    for result in results:
        assert result["error"] <= 1e-6, result
        assert result["shard_bytes"] == 5 * collective_bytes("all_reduce", 4, 4) and result["shard_calls"] == 5
        assert result["replicate_bytes"] == result["formula"] == 0


def test_dion_hsdp_experts_and_matrices_match_reference_and_traffic(pool4):
    """2 replicas × 2 shards: two 3-D stacks (E = 3: experts (2, 1) per shard rank) beside a row-sharded
    2-D matrix (which does use the shard axis); per-expert exchange over the replicas."""
    tensors = [_random(shape, i) for i, shape in enumerate(EXPERT_SHAPES)] + [_random((10, 8), 7)]
    results = pool4.run(_run_dion, 2, 2, tensors, timeout_s=120)
    for result in results:
        assert result["error"] <= 1e-6, result
        assert result["replicate_bytes"] == result["formula"] > 0
        assert result["consistent"]
    assert [r["local_experts"] for r in results] == [[2, 3], [1, 2], [2, 3], [1, 2]]


def _uneven_shards_small_buckets(bucket_bytes, steps=2):
    """Eight 18×64 float64 matrices row-sharded over 4 ranks (5, 5, 5, 3 rows) under a small bucket cap."""
    mesh = _mesh(1, 4)
    params = _params([_random((18, 64), i) for i in range(8)], mesh)
    opt = shardopt.Dion(params, rank_fraction=0.25, seed=SEED, bucket_bytes=bucket_bytes)
    for step in range(steps):
        for index, param in enumerate(params):
            _set_grad(param, _gradient(0, step, index, param.shape))
        opt.step()
    return torch.cat([_full(p).reshape(-1) for p in params])


def test_uneven_shards_cut_buckets_alike_on_every_rank(pool4):
    """A matrix counts at its largest shard (5·64·8 B), not at this rank's rows: with a 15,000 B cap
    counting local rows would give ranks 0–2 buckets of 4 and rank 3 (3 rows) one of 8, whose
    shard-axis collectives would not match."""
    capped = pool4.run(_uneven_shards_small_buckets, 15_000, timeout_s=60)
    uncapped = pool4.run(_uneven_shards_small_buckets, 2**24, timeout_s=60)
    assert ((capped[0] - uncapped[0]).abs().max()).item() <= 1e-12


# ---- fused projections -----------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["dion", "signmuon"])
def test_fused_qkv_split_equals_three_separate_params_single_process(algorithm):
    result = _fused_and_separate(algorithm, 0)
    assert result["weights"] == 0.0 and result["q"] == 0.0, result
    assert result["moved"] > 0


@pytest.mark.parametrize("algorithm", ["dion", "signmuon"])
def test_fused_qkv_split_equals_three_separate_params_fsdp_two_shards(pool2, algorithm):
    """Row-sharded over 2 ranks the fused rows split (8, 8): rank 0 holds all of Q, rank 1 K and V, while
    separate params split each block (4, 4) and (2, 2). Dion sums P over the shard axis in another
    order (float64 rounding); Sign-Muon (orthogonalize="full") sees the same whole matrices."""
    results = pool2.run(_fused_and_separate, algorithm, 2)
    for result in results:
        assert result["weights"] <= 1e-12 and result["q"] <= 1e-12, result
        assert result["moved"] > 0
    if algorithm == "signmuon":
        assert all(r["weights"] == 0.0 for r in results)


def _split_traffic(algorithm, steps=2):
    """A fused QKV weight with split on 2 replicas: measured replicate bytes and the traffic formula."""
    param = nn.Parameter(_random((D + 2 * D_KV, N), 0))
    if algorithm == "dion":
        opt = shardopt.Dion([{"params": [param], "split": (0, (D, D_KV, D_KV))}], rank_fraction=0.5,
                            wire_dtype=torch.float32, replicate_mesh=dist.group.WORLD)
    else:
        opt = shardopt.SignMuon([{"params": [param], "split": (0, (D, D_KV, D_KV))}], lr=0.01,
                                replicate_mesh=dist.group.WORLD)
    for step in range(steps):
        param.grad = _gradient(dist.get_rank(), step, 0, param.shape)
        opt.step()
    formula = steps * (sum(opt.replicate_bytes_per_step()) + nonfinite_check_bytes(2)) \
        + reference.double_averaging_checks(steps) * double_averaging_check_bytes(2)   # step 1's guard
    return opt.comm_stats()["replicate"]["bytes_sent"], formula, opt.replicas_consistent()


@pytest.mark.parametrize("algorithm", ["dion", "signmuon"])
def test_split_traffic_equals_formula_on_two_replicas(pool2, algorithm):
    """Dion: the 8×8 Q block saves nothing at rank 4 ((8+8)·4 = 8·8: gradient mean, fp64,
    AR(512 B) = 512 B), the 4×8 K and V blocks are compressed (a = 8, b = 4, r = 2, float32 wire, one
    bucket of 2 split over the 2 replicas: AR(2·8·2·4) + AR(2·4·2·4) = 192 B), plus the non-finite check
    (4 B): 708 B per step; step 1 adds the double-averaging check, AR(24 B) = 24 B."""
    for measured, formula, consistent in pool2.run(_split_traffic, algorithm):
        assert measured == formula > 0 and consistent
        if algorithm == "dion":
            assert measured == 2 * 708 + 24


def test_dion_expert_stack_with_column_split_matches_float64_reference_per_block():
    """A (2, 6, 10) stack of fused gate/up projections, split (-1, (4, 6)): four matrices, 6×4 (tall,
    b = 4, r = 2) and 6×6 (b = 6, r = 3), matrix e·2 + j seeded matrix_seed(param seed, e·2 + j)."""
    X0 = _random((2, 6, 10), 5)
    param = nn.Parameter(X0.clone())
    opt = shardopt.Dion([{"params": [param], "split": (-1, (4, 6))}], rank_fraction=0.5, seed=SEED, **DION)
    blocks = [slice(0, 4), slice(4, 10)]
    refs = {}
    for e in range(2):
        for j, cols in enumerate(blocks):
            Xb = X0[e][:, cols]
            m, n = Xb.shape
            Q = reference.initial_q(n, dion_rank(m, n, 0.5, 1),
                                    reference.matrix_seed(reference.optimizer_param_seed(SEED, 0), 2 * e + j))
            refs[e, j] = [Xb, torch.zeros_like(Xb), Q]
    for step in range(4):
        G = _gradient(0, step, 0, X0.shape)
        param.grad = G.clone()
        opt.step()
        for (e, j), ref in refs.items():
            refs[e, j] = list(reference.dion_step(ref[0], G[e][:, blocks[j]], ref[1], ref[2], transpose=False, **DION))
    want = torch.stack([torch.cat([refs[e, 0][0], refs[e, 1][0]], dim=1) for e in range(2)])
    assert ((param.detach() - want).norm() / want.norm()).item() <= 1e-6
    assert tuple(opt.state[param]["Q"].shape) == (2, 4 + 6, 3)


def test_signmuon_expert_stack_with_column_split_equals_separate_matrices():
    X0 = _random((2, 6, 10), 5)
    param = nn.Parameter(X0.clone())
    separate = [nn.Parameter(X0[e][:, cols].clone()) for e in range(2) for cols in (slice(0, 4), slice(4, 10))]
    options = dict(lr=0.01, ns_dtype="float64", lr_scale="unit_gain")   # (unit_gain: 1/√n per block)
    opt = shardopt.SignMuon([{"params": [param], "split": (2, (4, 6))}], **options)
    opt_separate = shardopt.SignMuon(separate, **options)
    for step in range(3):
        G = _gradient(0, step, 0, X0.shape)
        param.grad = G.clone()
        for p, (e, cols) in zip(separate, [(e, cols) for e in range(2) for cols in (slice(0, 4), slice(4, 10))]):
            p.grad = G[e][:, cols].clone()
        opt.step()
        opt_separate.step()
    assert torch.equal(param.detach(), torch.stack([torch.cat(separate[2 * e:2 * e + 2], dim=1) for e in range(2)]))


def test_split_blocks_have_their_own_layouts_and_ranks():
    qkv = nn.Parameter(torch.zeros(D + 2 * D_KV, N))
    group = {"algorithm": "dion", "split": (0, (D, D_KV, D_KV)), "rank_fraction": 0.5, "rank_multiple_of": 1}
    matrices = shardopt.layout.matrices.param_matrices(qkv, group)
    assert [m.layout.shape for m in matrices] == [(8, 8), (4, 8), (4, 8)]
    assert [m.of(qkv).shape for m in matrices] == [(8, 8), (4, 8), (4, 8)]
    assert shardopt.algorithms.dion.q_shape(qkv, group) == ((16, 4), (16, 4))    # b: 8 (q: n), 4, 4; ranks 4, 2, 2
    gate_up = nn.Parameter(torch.zeros(2, 6, 10))                       # experts with a column split
    group = {**group, "split": (-1, (4, 6))}
    matrices = shardopt.layout.matrices.param_matrices(gate_up, group)
    assert [(m.index, m.expert, m.layout.shape) for m in matrices] == [(0, 0, (6, 4)), (1, 0, (6, 6)),
                                                                       (2, 1, (6, 4)), (3, 1, (6, 6))]
    assert shardopt.algorithms.dion.q_shape(gate_up, group)[0] == (2, 4 + 6, 3)   # b: 4 (tall 6×4: n), 6 (square: n)


# ---- bad split options --------------------------------------------------------------------------------
@pytest.mark.parametrize("param_shape, split, match", [
    ((16, 8), (0, (8, 4, 3)), r"Invalid split .*'attn.qkv.weight'.*sum to 15 but dim 0 has 16"),
    ((16, 8), (2, (8, 8)), r"Invalid split .*'attn.qkv.weight'.*dim must be one of its matrix dims \(0, 1\)"),
    ((3, 16, 8), (0, (1, 2)), r"Invalid split .*'attn.qkv.weight'.*\(1, 2\).*dim 0 of a 3-D stack"),
    ((16, 8), 8, r"Invalid split: 8 \(param group 0\); split must be a pair \(dim, sizes\)"),
    ((16, 8), (0, (16, 0)), r"Invalid split: .* sizes must be integers ≥ 1"),
    ((16, 8), (0, ()), r"Invalid split: .* sizes must be integers ≥ 1"),
    ((16, 8), (0.0, (8, 8)), r"Invalid split: .* dim must be an integer"),
])
def test_bad_split_raises_value_error_naming_the_parameter(param_shape, split, match):
    param = nn.Parameter(torch.zeros(param_shape))
    with pytest.raises(ValueError, match=match):
        shardopt.Dion([{"params": [param], "param_names": ["attn.qkv.weight"], "split": split}])


def test_split_in_an_elementwise_group_is_refused():
    with pytest.raises(ValueError, match=r"Invalid split in param group 0 \(algorithm 'adamw'\): only 'dion', "
                                         r"'signmuon', 'muon' groups read split"):
        shardopt.Dion([{"params": [nn.Parameter(torch.zeros(4))], "algorithm": "adamw", "split": (0, (2, 2))}])


def _column_split_of_row_sharded():
    param = _params([torch.zeros(8, 6, dtype=torch.float64)], _mesh(1, 2))[0]
    try:
        shardopt.Dion([{"params": [param], "param_names": ["mlp.fused"], "split": (1, (2, 4))}])
    except ValueError as error:
        return str(error)
    return None


def test_column_split_of_row_sharded_param_is_refused_on_every_rank(pool2):
    errors = pool2.run(_column_split_of_row_sharded)
    assert all(e and re.search(r"'mlp.fused'.*column split of a row-sharded", e) for e in errors), errors


# ---- state: state_dict, safetensors, checks ------------------------------------------------------------
def _expert_and_split_optimizer(tensors):
    params = [nn.Parameter(t.clone()) for t in tensors]
    opt = shardopt.Dion([{"params": [params[0]]}, {"params": [params[1]], "split": (0, (D, D_KV, D_KV))}],
                        rank_fraction=0.5, seed=1)
    return params, opt


def _step(params, opt, step):
    for index, param in enumerate(params):
        param.grad = _gradient(0, step, index, param.shape)
    opt.step()


def test_state_dict_and_safetensors_round_trip_of_expert_and_split_state(tmp_path):
    tensors = [_random((3, 12, 8), 0), _random((D + 2 * D_KV, N), 1)]
    params, opt = _expert_and_split_optimizer(tensors)
    for step in range(2):
        _step(params, opt, step)
    assert tuple(opt.state[params[0]]["Q"].shape) == (3, 8, 4)
    assert tuple(opt.state[params[1]]["Q"].shape) == (16, 4)
    saved = copy.deepcopy(opt.state_dict())
    save_optimizer_state(opt, tmp_path / "opt.safetensors")
    resumed = []
    for load in (lambda o: o.load_state_dict(saved), lambda o: load_optimizer_state(o, tmp_path / "opt.safetensors")):
        params2, opt2 = _expert_and_split_optimizer([p.detach() for p in params])
        load(opt2)
        assert tuple(opt2.param_groups[1]["split"][1]) == (D, D_KV, D_KV)   # (a list after the JSON metadata)
        resumed.append((params2, opt2))
    for step in range(2, 4):
        _step(params, opt, step)
        for params2, opt2 in resumed:
            _step(params2, opt2, step)
    for params2, opt2 in resumed:
        assert all(torch.equal(a, b) for a, b in zip(params, params2))
        for a, b in zip(params, params2):
            assert torch.equal(opt.state[a]["Q"], opt2.state[b]["Q"])


def test_load_state_dict_checks_expert_and_split_q_shapes():
    tensors = [_random((3, 12, 8), 0), _random((D + 2 * D_KV, N), 1)]
    params, opt = _expert_and_split_optimizer(tensors)
    _step(params, opt, 0)
    for index, bad_shape in ((0, (3, 8, 5)), (1, (8, 4))):
        state = copy.deepcopy(opt.state_dict())
        state["state"][index]["Q"] = torch.zeros(bad_shape)
        with pytest.raises(ValueError, match=rf"'Q' has shape {re.escape(str(bad_shape))} but this optimizer expects"):
            opt.load_state_dict(state)


def _dcp_experts(directory, save):
    """Dion on a (3, 12, 8) stack and a split (16, 8) param, FSDP2 over the world; save the optimizer state
    (DCP) after 2 steps, or load it; then 2 more steps. Returns the full weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = Tensors([_random((3, 12, 8), 0), _random((D + 2 * D_KV, N), 1)])
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    experts, qkv = model.parameters()
    opt = shardopt.Dion([{"params": [experts]}, {"params": [qkv], "split": (0, (D, D_KV, D_KV))}],
                        rank_fraction=0.5, wire_dtype=torch.float32, seed=1)
    first = 0 if save else 2
    if not save:
        model_state, optim_state = get_state_dict(model, opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step in range(first, 4):
        if save and step == 2:
            model_state, optim_state = get_state_dict(model, opt)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
        for index, param in enumerate((experts, qkv)):
            _set_grad(param, _gradient(0, step, index, param.shape))
        opt.step()
    return [p.full_tensor() for p in (experts, qkv)]


def test_dcp_saves_expert_and_split_state_at_4_ranks_and_resumes_at_2(pool4, pool2, tmp_path):
    directory = str(tmp_path / "ckpt")
    expected = pool4.run(_dcp_experts, directory, True)[0]
    resumed = pool2.run(_dcp_experts, directory, False)[0]
    for got, want in zip(resumed, expected):
        assert ((got - want).norm() / want.norm()).item() <= 1e-6


# ---- grouping ---------------------------------------------------------------------------------------
def test_param_groups_puts_expert_stacks_in_the_matrix_group_and_conv_kernels_out():
    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.Parameter(torch.zeros(4, 8, 6))
            self.proj = nn.Linear(6, 8)
            self.conv = nn.Conv1d(3, 5, 2)
    model = MoE()
    matrix, nonmatrix = shardopt.param_groups(model)
    assert matrix["param_names"] == ["experts", "proj.weight"]
    assert set(nonmatrix["param_names"]) == {"proj.bias", "conv.weight", "conv.bias"}


def test_param_groups_splits_give_fused_projections_their_own_group():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(N, D + 2 * D_KV)
            self.out = nn.Linear(D, N)
    model = nn.Sequential(Attention(), Attention())
    groups = shardopt.param_groups(model, splits={"qkv": (0, (D, D_KV, D_KV))}, matrix_options={"rank_fraction": 0.5})
    assert [g["param_names"] for g in groups[:2]] == [["0.out.weight", "1.out.weight"], ["0.qkv.weight", "1.qkv.weight"]]
    assert groups[1]["split"] == (0, (D, D_KV, D_KV)) and groups[1]["rank_fraction"] == 0.5
    opt = shardopt.Dion(groups)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    opt.step()
    assert tuple(opt.state[model[0].qkv.weight]["Q"].shape) == (16, 4)
    with pytest.raises(ValueError, match=r"splits \['attn.qkv'\] match no matrix parameter's name"):
        shardopt.param_groups(model, splits={"attn.qkv": (0, (D, D_KV, D_KV))})
