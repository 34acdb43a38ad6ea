"""Sign-Muon (docs/design.md §2) and the Muon baseline: momentum → polar direction → exchange → update.

For a stack of k same-shape matrices X (m×n, local rows m_i) with gradient G:

    M ← β·M + (1−β)·G                      EMA momentum (one buffer)
    U ← polar((1−β)·G + β·M if nesterov else M)   Newton–Schulz, `ns_steps` steps
    Sign-Muon:  V ← vote(sign(U))          majority over the replicate axis, sign(0) = +1
                V ← polar(V) if post_polar
                X ← (1 − lr·wd)·X − lr·s·V,  s = 1 ("none") or 1/√n ("unit_gain")
    Muon:       G is first averaged over the replicate axis (full-precision all-reduce);
                X ← (1 − lr·wd)·X − lr·√max(1, m/n)·U

With orthogonalize="shard" (default), polar runs on the local row block (no
shard-axis traffic); with "full" each shard rank orthogonalizes whole matrices
(`full_polar`), the exact Muon direction.
"""

from __future__ import annotations

import functools
import math

import torch

from .buckets import compute_dtype, stack_as
from .comm import Axis
from .hyperparams import state_dtype
from .placement import MatrixLayout
from .polar import polar
from .vote import resolve_vote, vote_exchange


def init_state(param: torch.Tensor, group: dict, seed: int) -> dict:
    """momentum: zeros like the param (all its matrices: shardopt/matrices.py)."""
    return {"momentum": torch.zeros_like(param, dtype=state_dtype(group, param))}


def _polar(group: dict):
    """polar with the group's Newton–Schulz steps, dtype (None: bf16 on CUDA, fp32 elsewhere) and
    `compile` option."""
    dtype = getattr(torch, group["ns_dtype"]) if group["ns_dtype"] else None
    return functools.partial(polar, steps=group["ns_steps"], dtype=dtype, compile=group["compile"])


def full_polar(U_in: torch.Tensor, layout: MatrixLayout, shard: Axis, orthogonalize, wire: torch.dtype):
    """polar of whole matrices whose rows are split over the shard axis, returned as this rank's rows
    (a generator of collectives).

    U_in: (k, m_i, n). Matrix j is owned by shard rank j mod F: an all-to-all sends every
    row block to its owner, the owner orthogonalizes whole m×n matrices (`orthogonalize`, a
    polar with the group's settings), and a second all-to-all returns the row blocks: each
    rank does 1/F of the bucket's Newton–Schulz work. Both all-to-alls carry `wire` (bf16 halves
    the bytes; only the signs of the result are used). Shard-axis bytes: 2·(1 − own share)·k·m·n
    elements.
    """
    if not layout.sharded:
        return orthogonalize(U_in)
    k, rows, n = U_in.shape
    owners = [list(range(owner, k, shard.size)) for owner in range(shard.size)]
    mine = owners[shard.rank]
    to_owner = [len(matrices) * rows for matrices in owners]
    from_ranks = [len(mine) * rows_s for rows_s in layout.shard_rows]
    received = yield shard.all_to_all(torch.cat([U_in[m].reshape(-1, n) for m in owners]).to(wire), to_owner,
                                      from_ranks, async_op=True)
    received = received.to(U_in.dtype)
    blocks = [piece.view(len(mine), rows_s, n) for piece, rows_s in zip(received.split(from_ranks), layout.shard_rows)]
    U = orthogonalize(torch.cat(blocks, dim=1))                                     # (len(mine), m, n)
    back = torch.cat([block.reshape(-1, n) for block in U.split(layout.shard_rows, dim=1)]).to(wire)
    returned = (yield shard.all_to_all(back, from_ranks, to_owner, async_op=True)).to(U.dtype)
    out = U.new_empty((k, rows, n))
    for matrices, piece in zip(owners, returned.split(to_owner)):
        out[matrices] = piece.view(len(matrices), rows, n)
    return out


def work_split(layout: MatrixLayout, group: dict, replicas: int) -> int:
    """How many ranks share a bucket's Newton–Schulz work: the shard ranks with orthogonalize="full"
    (`full_polar`). The replicate axis never splits it: each replica orthogonalizes its own momentum."""
    return len(layout.shard_rows) if group["orthogonalize"] == "full" and layout.sharded else 1


def _direction(grads, states, group: dict, layout: MatrixLayout, shard: Axis):
    """The polar direction U (k, m_i, n) of the new momentum, which is written back to the state
    first, so that only U's working copy outlives Newton–Schulz. With orthogonalize="shard" polar
    runs on the local row block; with "full" on whole matrices (a generator of collectives)."""
    dtype = compute_dtype(grads[0].dtype)
    M = stack_as([s["momentum"] for s in states], dtype)
    beta = group["momentum"]
    for momentum, grad in zip(M, grads):
        momentum.lerp_(grad.to(dtype), 1 - beta)
    for state, momentum in zip(states, M):
        state["momentum"].copy_(momentum)
    if group["nesterov"]:
        for momentum, grad in zip(M, grads):          # U-input (1−β)·G + β·M, in M's memory
            momentum.lerp_(grad.to(dtype), 1 - beta)
    if group["orthogonalize"] == "full":
        return (yield from full_polar(M, layout, shard, _polar(group), getattr(torch, group["wire_dtype"])))
    return _polar(group)(M)


def _apply(params, update, group: dict, scale: float) -> None:
    """X ← (1 − lr·wd)·X − lr·scale·update, matrix by matrix (update: (k, m_i, n), any dtype)."""
    lr = group["lr"]
    for param, matrix in zip(params, update):
        param.mul_(1 - lr * group["weight_decay"]).add_(matrix.to(param.dtype), alpha=-lr * scale)


def voted_direction(grads, states, group: dict, layout: MatrixLayout, replicate: Axis, shard: Axis, seed: int):
    """The voted ±1/0 direction (k, m_i, n) as int8 (a generator); the new momentum is in the states."""
    U = yield from _direction(grads, states, group, layout, shard)
    positive = (U >= 0).reshape(-1)
    shape = U.shape
    del U
    fmt = resolve_vote(group["vote"], positive.numel(), replicate.size)
    return (yield from vote_exchange(positive, replicate, fmt, seed)).view(shape)


def step(params, grads, states, group: dict, layout: MatrixLayout, replicate: Axis, shard: Axis, seed: int):
    """One Sign-Muon step on a bucket of same-layout matrices (local tensors, updated in place).
    A generator that yields each collective (schedule.overlap runs it)."""
    V = yield from voted_direction(grads, states, group, layout, replicate, shard, seed)
    update = _polar(group)(V.to(compute_dtype(params[0].dtype))) if group["post_polar"] else V
    m, n = layout.shape
    scale = 1.0 if group["lr_scale"] == "none" else 1 / math.sqrt(n)
    _apply(params, update, group, scale)


def muon_step(params, grads, states, group: dict, layout: MatrixLayout, replicate: Axis, shard: Axis, seed: int):
    """One Muon step (baseline): full-precision gradient mean, then polar of the momentum (a generator)."""
    G = yield replicate.all_reduce(stack_as(grads, compute_dtype(grads[0].dtype)), "mean", async_op=True)
    U = yield from _direction(list(G), states, group, layout, shard)
    m, n = layout.shape
    _apply(params, U, group, math.sqrt(max(1.0, m / n)))
