"""Shard axis: FSDP2 / DTensor parameters, HSDP with a compressed replicate axis, DCP checkpoints.

Every case runs on a gloo worker pool and is checked against the float64
references in tests/reference.py written from docs/design.md's equations.
"""

import math
import os

import pytest
import torch
import torch.distributed as dist

import reference
import shardopt
from shardopt.optim import traffic
from shardopt.wire.comm import collective_bytes
from shardopt.layout.placement import MatrixLayout, chunk_rows
from workers import WorkerPool

SHAPES = [(24, 16), (16, 40), (18, 64), (3, 64)]   # tall, wide, uneven over 4 (5,5,5,3), empty shard (1,1,1,0)


# ---- helpers run on the workers ---------------------------------------------------------------
class Matrices(torch.nn.Module):
    def __init__(self, shapes, seed=0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(*shape, generator=generator, dtype=torch.float64)) for shape in shapes)


def _mesh(replicate, shard):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))


def _sharded_matrices(mesh, shapes):
    from torch.distributed.fsdp import fully_shard
    model = Matrices(shapes)
    initial = [p.detach().clone() for p in model.parameters()]
    fully_shard(model, mesh=mesh["shard"])
    return model, list(model.parameters()), initial


def _replica_gradient(replica, step, index, shape):
    """The gradient replica `replica` sees (its shard group's mean, already reduced by FSDP)."""
    generator = torch.Generator().manual_seed(10_000 * replica + 100 * step + index)
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def _set_local_grads(params, replica, step):
    from torch.distributed.tensor import DTensor
    for index, param in enumerate(params):
        G = _replica_gradient(replica, step, index, param.shape)
        layout = shardopt.layout.placement.matrix_layout(param)
        rows = G[layout.row_start:layout.row_start + layout.rows]
        param.grad = DTensor.from_local(rows, param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())


def _run_dion(replicate, shard, rank_fraction, steps=10, wire_dtype="float32"):
    mesh = _mesh(replicate, shard)
    _, params, initial = _sharded_matrices(mesh, SHAPES)
    hyper = dict(lr=0.02, mu=0.9, weight_decay=0.1)
    opt = shardopt.Dion(params, rank_fraction=rank_fraction, replicate_mesh=mesh["replicate"], seed=3,
                        wire_dtype=wire_dtype, **hyper)
    replica = mesh.get_local_rank("replicate")
    refs = []
    for index, X in enumerate(initial):
        m, n = X.shape
        r = shardopt.algorithms.lowrank.dion_rank(m, n, rank_fraction, 1)
        refs.append([X, torch.zeros_like(X), reference.initial_q(m, r, reference.optimizer_param_seed(3, index))])
    for step in range(steps):
        _set_local_grads(params, replica, step)
        opt.step()
        for index, ref in enumerate(refs):
            G = sum(_replica_gradient(j, step, index, ref[0].shape) for j in range(replicate)) / replicate
            refs[index] = list(reference.dion_step(ref[0], G, ref[1], ref[2], transpose=True, **hyper))
    errors = [((p.full_tensor() - ref[0]).norm() / ref[0].norm()).item() for p, ref in zip(params, refs)]
    stats = opt.comm_stats()
    full = torch.cat([p.full_tensor().reshape(-1) for p in params])
    return {"errors": errors, "full": full, "stats": stats, "consistent": opt.replicas_consistent()}


def _run_signmuon(replicate, shard, orthogonalize, vote, steps=4):
    mesh = _mesh(replicate, shard)
    _, params, initial = _sharded_matrices(mesh, SHAPES)
    beta, lr = 0.8, 0.01
    opt = shardopt.SignMuon(params, lr=lr, momentum=beta, orthogonalize=orthogonalize, vote=vote,
                            ns_dtype="float64", replicate_mesh=mesh["replicate"])
    replica = mesh.get_local_rank("replicate")
    X = [x.clone() for x in initial]
    M = [[torch.zeros_like(x) for x in initial] for _ in range(replicate)]
    ties = 0
    for step in range(steps):
        _set_local_grads(params, replica, step)
        opt.step()
        for index, x in enumerate(X):
            directions = []
            for j in range(replicate):
                M[j][index] = beta * M[j][index] + (1 - beta) * _replica_gradient(j, step, index, x.shape)
                if orthogonalize == "full":
                    directions.append(reference.newton_schulz(M[j][index]))
                else:
                    blocks = M[j][index].split(chunk_rows(x.shape[0], shard))
                    directions.append(torch.cat([reference.newton_schulz(b) if b.numel() else b for b in blocks]))
            V = reference.vote_signs(directions)
            tie = V == 0
            ties += int(tie.sum())
            if vote != "allreduce_int8":   # 1-bit formats break ties with a shared coin: take the optimizer's
                V = torch.where(tie, -(params[index].full_tensor() - x) / lr, V)
            X[index] = x - lr * V
    mismatch = max(((p.full_tensor() - x).abs().max().item() for p, x in zip(params, X)))
    return {"mismatch": mismatch, "ties": ties, "consistent": opt.replicas_consistent()}


# ---- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("rank_fraction", [1.0, 0.25])
def test_fsdp_dion_matches_single_process_float64(pool4, pool2, rank_fraction):
    for pool, shape in ((pool4, (1, 4)), (pool2, (1, 2))):
        results = pool.run(_run_dion, *shape, rank_fraction)
        assert max(max(r["errors"]) for r in results) <= 1e-6, [r["errors"] for r in results]


# float64 params; relative weight error after 10 steps: float32 wire measured ≤ 1e-8, bfloat16 ≤ 4.9e-5.
@pytest.mark.parametrize("rank_fraction, wire_dtype, tolerance", [(1.0, "float32", 1e-6), (0.25, "float32", 1e-6),
                                                                  (0.25, "bfloat16", 2e-4)])
def test_hsdp_dion_matches_single_process_float64_and_replicas_identical(pool4, rank_fraction, wire_dtype, tolerance):
    results = pool4.run(_run_dion, 2, 2, rank_fraction, 10, wire_dtype)
    assert max(max(r["errors"]) for r in results) <= tolerance, [r["errors"] for r in results]
    assert all(r["consistent"] for r in results)
    assert all(torch.equal(r["full"], results[0]["full"]) for r in results)


@pytest.mark.parametrize("orthogonalize", ["shard", "full"])
@pytest.mark.parametrize("vote", ["allreduce_int8", "alltoall_1bit"])
def test_hsdp_signmuon_matches_reference(pool4, orthogonalize, vote):
    results = pool4.run(_run_signmuon, 2, 2, orthogonalize, vote)
    assert all(r["consistent"] for r in results)
    assert max(r["mismatch"] for r in results) <= 1e-12, [r["mismatch"] for r in results]
    assert results[0]["ties"] > 0   # two replicas: the tie rule was exercised


@pytest.mark.parametrize("orthogonalize", ["shard", "full"])
def test_fsdp_signmuon_uneven_and_empty_shards_match_reference(pool4, orthogonalize):
    results = pool4.run(_run_signmuon, 1, 4, orthogonalize, "auto", timeout_s=60)
    assert max(r["mismatch"] for r in results) <= 1e-12


def _dion_hsdp_bytes(rank_fraction, wire_itemsize):
    """Bytes per rank and axis for one step of _run_dion's matrices at 2×2, fp64 (reference.dion_bytes: P
    reduce-scattered in fp64, averaged over replicas and all-gathered in the wire dtype; on the replicate
    axis (a/F + b_i)·r per matrix), plus the non-finite check: one all-reduce of one float32 per axis.
    Returns (shard bytes, [replicate bytes of shard rank 0, 1])."""
    F = M = 2
    sizes = {"replicate": M, "shard": F, "tensor": 1}
    per_rank = [[reference.dion_bytes(MatrixLayout((m, n), chunk_rows(m, F), index, sharded=True), rank_fraction,
                                      wire_itemsize, sizes) for m, n in SHAPES] for index in range(F)]
    shard_bytes = collective_bytes("all_reduce", 4, F) + sum(sent["shard"] for sent in per_rank[0])
    replicate_bytes = [collective_bytes("all_reduce", 4, M) + sum(sent["replicate"] for sent in rank)
                       for rank in per_rank]
    return shard_bytes, replicate_bytes


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16"])
def test_hsdp_comm_stats_equal_design_formulas(pool4, wire_dtype):
    steps = 10
    results = pool4.run(_run_dion, 2, 2, 0.25, steps, wire_dtype)
    shard_bytes, replicate_bytes = _dion_hsdp_bytes(0.25, torch.empty(0, dtype=getattr(torch, wire_dtype)).element_size())
    assert all(shardopt.algorithms.dion.compressed(shardopt.layout.placement.MatrixLayout(s, (s[0],), sharded=True),
                                        {"rank_fraction": 0.25, "rank_multiple_of": 1}) for s in SHAPES)
    for rank, result in enumerate(results):
        # + step 1's double-averaging check: (h, −h, nonzero) over the replicas, the verdict over the shards
        assert result["stats"]["shard"]["bytes_sent"] == steps * shard_bytes + traffic.double_averaging_check_bytes(2, 2)
        assert result["stats"]["replicate"]["bytes_sent"] == steps * replicate_bytes[rank % 2] \
            + traffic.double_averaging_check_bytes(2)


# ---- DCP: save at 4 ranks, load at 2 and 1 ----------------------------------------------------
def _clip_on_2x2(max_norm):
    """Dion on 2 replicas × 2 shards with max_grad_norm: the agreed norm ν = mean over replicas of
    √(Σ_shards ‖g‖²), each rank's local gradients scaled by min(1, max_norm/(ν+1e-6)), the bytes."""
    mesh = _mesh(2, 2)
    _, params, _ = _sharded_matrices(mesh, SHAPES)
    opt = shardopt.Dion(params, rank_fraction=0.25, replicate_mesh=mesh["replicate"], max_grad_norm=max_norm, seed=3)
    replica = mesh.get_local_rank("replicate")
    _set_local_grads(params, replica, 0)
    for param in params:           # replica 1's gradient 3× larger: the replicas' own norms differ
        param.grad.to_local().mul_(1 + 2 * replica)
    replica_norms = [(1 + 2 * r) * math.sqrt(sum(float(_replica_gradient(r, 0, i, p.shape).norm()) ** 2
                                                 for i, p in enumerate(params))) for r in range(2)]
    expected = sum(replica_norms) / 2
    factor = min(1.0, max_norm / (expected + 1e-6))
    opt.reset_comm_stats()
    norm = opt.clip_grad_norm_(max_norm)
    stats = opt.comm_stats()
    errors = []
    for index, param in enumerate(params):
        layout = shardopt.layout.placement.matrix_layout(param)
        rows = (1 + 2 * replica) * _replica_gradient(replica, 0, index, param.shape)[layout.row_start:layout.row_start + layout.rows]
        errors.append(max((param.grad.to_local() - rows * factor).abs().flatten().tolist(), default=0.0))
    for step in range(1, 4):       # clipped steps keep the replicas bit-identical
        _set_local_grads(params, replica, step)
        opt.step()
    return (norm.item(), expected, replica_norms, max(errors), stats["replicate"]["bytes_sent"],
            stats["shard"]["bytes_sent"], opt.replicas_consistent(), opt.last_grad_norm.item())


def test_clip_uses_one_norm_agreed_over_replicas_and_shards(pool4):
    results = pool4.run(_clip_on_2x2, 5.0)
    norm, expected, replica_norms, _, _, _, _, _ = results[0]
    assert replica_norms[1] > 2 * replica_norms[0]   # a local clip would scale the replicas differently
    assert expected > 5.0                                              # so the clip is active
    assert len({r[0] for r in results}) == 1 and len({r[7] for r in results}) == 1   # bitwise the same on every rank
    assert abs(norm - expected) <= 1e-6 * expected
    for _, _, _, error, replicate_bytes, shard_bytes, consistent, _ in results:
        assert error <= 1e-6
        assert replicate_bytes == collective_bytes("all_reduce", 4, 2) and shard_bytes == collective_bytes("all_reduce", 4, 2)
        assert consistent


def _mlp_step(model, opt, step, world):
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 12, generator=generator, dtype=torch.float64)
    y = torch.randn(8, 6, generator=generator, dtype=torch.float64)
    rows = slice(dist.get_rank() * 8 // world, (dist.get_rank() + 1) * 8 // world)
    torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    opt.step()
    opt.zero_grad()


def _build_mlp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU(), torch.nn.Linear(20, 6)).double()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = shardopt.Dion(shardopt.param_groups(model, nonmatrix_options={"lr": 0.01}), lr=0.02, rank_fraction=0.5)
    return model, opt


def _dcp_save_then_continue(directory, save_at, total):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt = _build_mlp()
    for step in range(total):
        if step == save_at:
            model_state, optim_state = get_state_dict(model, opt)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
        _mlp_step(model, opt, step, dist.get_world_size())
    return [p.full_tensor() for p in model.parameters()]


def _dcp_load_and_continue(directory, save_at, total):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, opt = _build_mlp()
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step in range(save_at, total):
        _mlp_step(model, opt, step, dist.get_world_size())
    return [p.full_tensor() for p in model.parameters()]


def test_dcp_save_at_4_ranks_resumes_at_2_and_1_ranks(pool4, pool2, tmp_path):
    directory = str(tmp_path / "ckpt")
    expected = pool4.run(_dcp_save_then_continue, directory, 5, 8)[0]
    pool1 = WorkerPool(1)
    try:
        for pool in (pool2, pool1):
            resumed = pool.run(_dcp_load_and_continue, directory, 5, 8)[0]
            for got, want in zip(resumed, expected):
                assert ((got - want).norm() / want.norm()).item() <= 1e-6
    finally:
        pool1.close()


# ---- bad input ---------------------------------------------------------------------------------
def _bad_input(case):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    mesh = _mesh(2, 2)
    full = torch.randn(8, 4)
    try:
        if case == "wrong_mesh":
            p = torch.nn.Parameter(distribute_tensor(full, mesh["shard"], [Shard(0)]))
            shardopt.Dion([p], shard_mesh=mesh["replicate"])
        elif case == "two_shards_one_dim":
            p = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0), Shard(0)]))
            shardopt.Dion([p])
        elif case == "strided_shard":
            p = torch.nn.Parameter(DTensor.from_local(full[:4], mesh, [Replicate(), _StridedShard(0, split_factor=2)],
                                                      run_check=False))
            shardopt.Dion([p])
        elif case == "mixed_plain":
            p = torch.nn.Parameter(distribute_tensor(full, mesh["shard"], [Shard(0)]))
            shardopt.Dion([p, torch.nn.Parameter(torch.randn(4, 4))])
        elif case == "shard_mesh_plain":
            shardopt.Dion([torch.nn.Parameter(full)], shard_mesh=mesh["shard"])
        elif case in ("plain_grad", "replicated_grad"):   # a step's gradient placed unlike its param
            p = torch.nn.Parameter(distribute_tensor(full, mesh["shard"], [Shard(0)]))
            opt = shardopt.Dion([p], replicate_mesh=mesh["replicate"])
            grad = distribute_tensor(torch.ones(8, 4), mesh["shard"], [Replicate()])
            if case == "plain_grad":
                grad = torch.ones(8, 4)
            p.grad = grad
            opt.step()
        elif case == "param_lists_differ":
            params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(2 + (dist.get_rank() == 1))]
            shardopt.Dion(params, replicate_mesh=dist.group.WORLD, agreement_timeout_s=10)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("case, message", [
    ("wrong_mesh", "sharded on mesh .* but the optimizer was given shard_mesh"),
    ("two_shards_one_dim", "two sharded mesh dims on tensor dim 0"),
    ("strided_shard", "_StridedShard"),
    ("mixed_plain", "mix plain tensors .* with DTensors"),
    ("shard_mesh_plain", "shard_mesh was given but no parameter is a DTensor"),
    ("plain_grad", "param #0 of param group 0 is a DTensor but its gradient is a plain tensor"),
    ("replicated_grad", r"param #0 of param group 0 is placed \(Shard\(dim=0\),\) but its gradient \(Replicate\(\),\)"),
    ("param_lists_differ", "disagree on the number of params \\(rank 0: 2, rank 1: 3"),
])
def test_bad_sharding_raises_clear_error_on_every_rank(pool4, case, message):
    import re
    errors = pool4.run(_bad_input, case, timeout_s=60)
    assert all(e is not None and re.search(message, e) for e in errors), errors


# ---- Sign-Muon "full": the shard-axis all-to-all in bf16 ------------------------------------------
def _run_signmuon_full(wire_dtype, steps=3):
    mesh = _mesh(2, 2)
    _, params, initial = _sharded_matrices(mesh, SHAPES)
    opt = shardopt.SignMuon(params, lr=0.01, momentum=0.8, orthogonalize="full", vote="allreduce_int8",
                            wire_dtype=wire_dtype, replicate_mesh=mesh["replicate"])
    for step in range(steps):
        _set_local_grads(params, mesh.get_local_rank("replicate"), step)
        opt.step()
    moved = torch.cat([(p.full_tensor() - x).reshape(-1) for p, x in zip(params, initial)])
    return {"moved": moved, "shard_bytes": opt.comm_stats()["shard"]["bytes_sent"], "consistent": opt.replicas_consistent()}


def test_signmuon_full_bf16_wire_halves_the_all_to_all_and_keeps_the_signs(pool4):
    """bf16 on the all-to-all of orthogonalize="full": half its shard-axis bytes, replicas identical,
    and the voted direction (only signs are used) agrees with the float32 wire on ≥ 99 % of entries."""
    exact = pool4.run(_run_signmuon_full, "float32")
    halved = pool4.run(_run_signmuon_full, "bfloat16")
    # the non-finite flag, once per step, and step 1's double-averaging verdict
    check = 3 * collective_bytes("all_reduce", 4, 2) + traffic.double_averaging_check_bytes(2, 2)
    for a, b in zip(exact, halved):
        assert a["shard_bytes"] - check == 2 * (b["shard_bytes"] - check) > 0
        assert a["consistent"] and b["consistent"]
    agreement = (torch.sign(exact[0]["moved"]) == torch.sign(halved[0]["moved"])).double().mean().item()
    assert agreement >= 0.99, agreement
