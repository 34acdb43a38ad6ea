"""HSDP + DCP: Dion and Sign-Muon saved at 2 replicas × 2 shards (FSDP2 on the shard axis, the
optimizer on the replicate axis, as integrations/fsdp/train.py) after synchronize_for_checkpoint(),
resumed at 1 × 2 and at 2 × 1 through torch.distributed.checkpoint, continue like a float64
reference of the equations run without interruption (weights and momenta); a checkpoint whose
state has the wrong shape is refused with an error naming the param and the tensor.
"""

import pytest
import torch

import reference
import shardopt

SHAPES = [(24, 16), (16, 40), (3, 64)]   # tall, wide, an empty shard at 2 shards (2, 1)
SAVE_AT, TOTAL = 3, 6
DION = dict(lr=0.02, mu=0.9, weight_decay=0.1)
SIGNMUON = dict(lr=0.01, momentum=0.8)
SEED = 3


# ---- the gradients: two streams, as many replicas as the mesh has ------------------------------
def _stream_gradient(stream, step, index, shape):
    generator = torch.Generator().manual_seed(10_000 * stream + 100 * step + index)
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def _replica_gradients(replicas, step, index, shape):
    """What each of `replicas` replicas sees at `step`: the two streams at two replicas, their mean
    at one (the same mean gradient either way, so Dion's trajectory does not depend on the mesh)."""
    streams = [_stream_gradient(j, step, index, shape) for j in range(2)]
    return streams if replicas == 2 else [sum(streams) / 2]


# ---- workers -----------------------------------------------------------------------------------
class Matrices(torch.nn.Module):
    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(*shape, generator=generator, dtype=torch.float64)) for shape in SHAPES)


def _build(algorithm, replicate, shard, rank_fraction=0.5):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
    model = Matrices()
    fully_shard(model, mesh=mesh["shard"])
    params = list(model.parameters())
    if algorithm == "dion":
        opt = shardopt.Dion(params, rank_fraction=rank_fraction, wire_dtype=torch.float32, seed=SEED,
                            replicate_mesh=mesh["replicate"], **DION)
    else:
        opt = shardopt.SignMuon(params, orthogonalize="full", vote="allreduce_int8", ns_dtype="float64", seed=SEED,
                                replicate_mesh=mesh["replicate"], **SIGNMUON)
    return mesh, model, params, opt


def _train(mesh, params, opt, steps):
    from torch.distributed.tensor import DTensor
    replicas, replica = mesh["replicate"].size(), mesh.get_local_rank("replicate")
    for step in steps:
        for index, param in enumerate(params):
            G = _replica_gradients(replicas, step, index, param.shape)[replica]
            layout = shardopt.layout.placement.matrix_layout(param)
            param.grad = DTensor.from_local(G[layout.row_start:layout.row_start + layout.rows], param.device_mesh,
                                            param.placements, run_check=False, shape=param.shape, stride=param.stride())
        opt.step()


def _final(opt, params):
    """Weights and (averaged over the replicas) momenta, whole."""
    opt.synchronize_for_checkpoint()
    return {"weights": [p.full_tensor() for p in params],
            "momenta": [opt.state[p]["momentum"].full_tensor() for p in params],
            "consistent": opt.replicas_consistent()}


def _save_then_continue(directory, algorithm):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    mesh, model, params, opt = _build(algorithm, 2, 2)
    _train(mesh, params, opt, range(SAVE_AT))
    opt.synchronize_for_checkpoint()   # one momentum every replica agrees on
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    _train(mesh, params, opt, range(SAVE_AT, TOTAL))
    return _final(opt, params)


def _load_then_continue(directory, algorithm, replicate, shard, rank_fraction=0.5):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    mesh, model, params, opt = _build(algorithm, replicate, shard, rank_fraction)
    model_state, optim_state = get_state_dict(model, opt)   # (initializes the optimizer state)
    state = {"model": model_state, "optim": optim_state}
    before = [p.detach().clone() for p in params] + [v.detach().clone() for s in opt.state.values() for v in s.values()]
    try:
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except (ValueError, CheckpointException) as error:
        after = [p.detach() for p in params] + [v.detach() for s in opt.state.values() for v in s.values()]
        return {"error": f"{type(error).__name__}: {error}",
                "untouched": all(torch.equal(a, b) for a, b in zip(before, after))}
    _train(mesh, params, opt, range(SAVE_AT, TOTAL))
    return _final(opt, params)


# ---- the float64 reference ---------------------------------------------------------------------
def _reference(algorithm, resumed_replicas):
    """The equations without interruption: two replicas before SAVE_AT, then `resumed_replicas`;
    the momenta averaged at SAVE_AT (synchronize_for_checkpoint). Dion: one matrix on the mean
    gradient (its replicas' momenta differ, their mean follows it exactly). Sign-Muon: each
    replica's momentum, the int8 vote of their Newton–Schulz signs (0 on a tie)."""
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in SHAPES]
    weights, momenta = [], []
    for index, X in enumerate(initial):
        m, n = X.shape
        if algorithm == "dion":
            r = shardopt.algorithms.lowrank.dion_rank(m, n, 0.5, 1)
            M, Q = torch.zeros_like(X), reference.initial_q(m, r, reference.optimizer_param_seed(SEED, index))
            for step in range(TOTAL):
                G = sum(_replica_gradients(2, step, index, X.shape)) / 2
                X, M, Q = reference.dion_step(X, G, M, Q, transpose=True, **DION)
            weights.append(X), momenta.append(M)
            continue
        beta, lr = SIGNMUON["momentum"], SIGNMUON["lr"]
        M = [torch.zeros_like(X)] * 2
        for step in range(TOTAL):
            if step == SAVE_AT:
                M = [sum(M) / len(M)] * resumed_replicas
            grads = _replica_gradients(len(M), step, index, X.shape)
            M = [beta * Mj + (1 - beta) * Gj for Mj, Gj in zip(M, grads)]
            X = X - lr * reference.vote_signs([reference.newton_schulz(Mj) for Mj in M])
        weights.append(X), momenta.append(sum(M) / len(M))
    return weights, momenta


def _relative(got, want):
    return max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want))


# Relative error after TOTAL steps against the reference, measured (2×2 saver, 1×2, 2×1 resumed): Dion
# weights 1.1e-9, momenta 4.9e-8 (P and R rounded to float32 on the wire), held to the reference's 1e-6;
# Sign-Muon weights 0, momenta 1.6e-16 (float64 Newton–Schulz, int8 vote), held to 1e-12.
@pytest.mark.parametrize("algorithm, tolerance", [("dion", 1e-6), ("signmuon", 1e-12)])
def test_hsdp_dcp_save_2x2_resume_1x2_and_2x1_continue_like_float64(pool4, pool2, tmp_path, algorithm, tolerance):
    directory = str(tmp_path / "ckpt")
    saved = pool4.run(_save_then_continue, directory, algorithm)
    want = _reference(algorithm, 2)
    assert all(r["consistent"] for r in saved)
    errors = {"2x2": (_relative(saved[0]["weights"], want[0]), _relative(saved[0]["momenta"], want[1]))}
    for replicate, shard in ((1, 2), (2, 1)):
        want = _reference(algorithm, replicate)
        resumed = pool2.run(_load_then_continue, directory, algorithm, replicate, shard)
        assert all(r["consistent"] for r in resumed)
        errors[f"{replicate}x{shard}"] = (_relative(resumed[0]["weights"], want[0]),
                                          _relative(resumed[0]["momenta"], want[1]))
    assert max(max(e) for e in errors.values()) <= tolerance, errors


def test_dcp_checkpoint_with_wrong_q_shape_is_refused_untouched(pool4, pool2, tmp_path):
    """Saved with rank_fraction 0.5, loaded by an optimizer with rank_fraction 0.25 (Q has fewer
    columns): DCP's load plan refuses it (CheckpointException wrapping its ValueError, naming the
    param's state key and Q) before anything is read: weights and state untouched."""
    directory = str(tmp_path / "ckpt")
    pool4.run(_save_then_continue, directory, "dion")
    for result in pool2.run(_load_then_continue, directory, "dion", 1, 2, 0.25):
        assert "error" in result, result
        assert "optim.state.weights.0.Q" in result["error"] and "Size mismatch" in result["error"], result["error"]
        assert result["untouched"]


def _load_q_placed_unlike_the_param():
    """The optimizer's own state_dict() whose Q (a DTensor of the right global shape) is replicated
    instead of row-sharded like its param: load_state_dict refuses it, state untouched."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    mesh, model, params, opt = _build("dion", 1, 2)
    _train(mesh, params, opt, range(1))
    state_dict = opt.state_dict()
    Q = state_dict["state"][0]["Q"]
    replicated = distribute_tensor(Q.full_tensor(), Q.device_mesh, [Replicate()])
    state_dict["state"][0] = {**state_dict["state"][0], "Q": replicated}
    before = {key: value.to_local().clone() for key, value in opt.state[params[0]].items() if key != "step"}
    try:
        opt.load_state_dict(state_dict)
    except ValueError as error:
        untouched = all(torch.equal(opt.state[params[0]][key].to_local(), value) for key, value in before.items())
        return {"error": str(error), "untouched": untouched}
    return {"error": None}


def test_q_dtensor_placed_unlike_its_param_is_refused(pool2):
    for result in pool2.run(_load_q_placed_unlike_the_param):
        assert result["error"] is not None and result["untouched"]
        assert "param #0 of param group 0" in result["error"] and "'Q' is a DTensor placed (Replicate(),)" \
            in result["error"] and "local shape (24, 8)" in result["error"] and "(12, 8)" in result["error"], result
