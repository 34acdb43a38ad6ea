"""Sign-Muon (DESIGN §2) and the Muon baseline: momentum → polar direction → exchange → update.

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

import math

import torch

from .comm import Axis
from .placement import MatrixLayout
from .polar import polar
from .vote import resolve_vote, vote_exchange


def init_state(param: torch.Tensor, layout: MatrixLayout, group: dict, seed: int) -> dict:
    return {"momentum": torch.zeros_like(param)}


def _ns_dtype(group: dict) -> torch.dtype | None:
    """The group's Newton–Schulz dtype (None: bf16 on CUDA, fp32 elsewhere)."""
    return getattr(torch, group["ns_dtype"]) if group["ns_dtype"] else None


def full_polar(U_in: torch.Tensor, layout: MatrixLayout, shard: Axis, steps: int, dtype, wire: torch.dtype):
    """polar of whole matrices whose rows are split over the shard axis, returned as this rank's rows
    (a generator of collectives).

    U_in: (k, m_i, n). Matrix j is owned by shard rank j mod F: an all-to-all sends every
    row block to its owner, the owner orthogonalizes whole m×n matrices, and a second
    all-to-all returns the row blocks. Both all-to-alls carry `wire` (bf16 halves the bytes; only
    the signs of the result are used). Shard-axis bytes: 2·(1 − own share)·k·m·n elements.
    """
    if not layout.sharded:
        return polar(U_in, steps, dtype)
    k, rows, n = U_in.shape
    owners = [list(range(owner, k, shard.size)) for owner in range(shard.size)]
    mine = owners[shard.rank]
    to_owner = [len(matrices) * rows for matrices in owners]
    from_ranks = [len(mine) * rows_s for rows_s in layout.shard_rows]
    received = yield shard.all_to_all(torch.cat([U_in[m].reshape(-1, n) for m in owners]).to(wire), to_owner,
                                      from_ranks, async_op=True)
    received = received.to(U_in.dtype)
    blocks = [piece.view(len(mine), rows_s, n) for piece, rows_s in zip(received.split(from_ranks), layout.shard_rows)]
    U = polar(torch.cat(blocks, dim=1), steps, dtype)                               # (len(mine), m, n)
    back = torch.cat([block.reshape(-1, n) for block in U.split(layout.shard_rows, dim=1)]).to(wire)
    returned = (yield shard.all_to_all(back, from_ranks, to_owner, async_op=True)).to(U.dtype)
    out = U.new_empty((k, rows, n))
    for matrices, piece in zip(owners, returned.split(to_owner)):
        out[matrices] = piece.view(len(matrices), rows, n)
    return out


def _direction(grads, states, group: dict, layout: MatrixLayout, shard: Axis):
    """(U, M): the polar direction and the new momentum, stacked (k, m_i, n). With
    orthogonalize="shard" polar runs on the local row block; with "full" on whole matrices
    (a generator of collectives)."""
    dtype = torch.promote_types(grads[0].dtype, torch.float32)
    G = torch.stack(grads).to(dtype)
    M = torch.stack([s["momentum"] for s in states]).to(dtype)
    beta = group["momentum"]
    M.lerp_(G, 1 - beta)
    U_in = G.lerp(M, beta) if group["nesterov"] else M
    if group["orthogonalize"] == "full":
        return (yield from full_polar(U_in, layout, shard, group["ns_steps"], _ns_dtype(group),
                                      getattr(torch, group["wire_dtype"]))), M
    return polar(U_in, group["ns_steps"], _ns_dtype(group)), M


def _apply(params, states, M, update, group: dict, scale: float) -> None:
    lr = group["lr"]
    for i, (param, state) in enumerate(zip(params, states)):
        state["momentum"].copy_(M[i])
        param.mul_(1 - lr * group["weight_decay"]).add_(update[i].to(param.dtype), alpha=-lr * scale)


def voted_direction(grads, states, group: dict, layout: MatrixLayout, replicate: Axis, shard: Axis, seed: int):
    """(V, M): the voted ±1/0 direction (k, m_i, n) as int8, and the new momentum (a generator)."""
    U, M = yield from _direction(grads, states, group, layout, shard)
    positive = (U >= 0).reshape(-1)
    fmt = resolve_vote(group["vote"], positive.numel(), replicate.size)
    return (yield from vote_exchange(positive, replicate, fmt, seed)).view(U.shape), M


def step(params, grads, states, group: dict, layout: MatrixLayout, replicate: Axis, shard: Axis, seed: int):
    """One Sign-Muon step on a bucket of same-layout matrices (local tensors, updated in place).
    A generator that yields each collective (schedule.overlap runs it)."""
    V, M = yield from voted_direction(grads, states, group, layout, replicate, shard, seed)
    update = V.to(M.dtype)
    if group["post_polar"]:
        update = polar(update, group["ns_steps"], _ns_dtype(group))
    m, n = layout.shape
    scale = 1.0 if group["lr_scale"] == "none" else 1 / math.sqrt(n)
    _apply(params, states, M, update, group, scale)


def muon_step(params, grads, states, group: dict, layout: MatrixLayout, replicate: Axis, shard: Axis, seed: int):
    """One Muon step (baseline): full-precision gradient mean, then polar of the momentum (a generator)."""
    G = torch.stack(grads).to(torch.promote_types(grads[0].dtype, torch.float32))
    G = yield replicate.all_reduce(G, "mean", async_op=True)
    U, M = yield from _direction(list(G), states, group, layout, shard)
    m, n = layout.shape
    _apply(params, states, M, U, group, math.sqrt(max(1.0, m / n)))
