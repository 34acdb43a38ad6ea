"""Sign-Muon (docs/design.md §2) and the Muon baseline: momentum → polar direction → exchange → update.

For a stack of k same-shape matrices X (m×n, local block m_i×n_j) with gradient G:

    M ← β·M + (1−β)·G                      EMA momentum (one buffer)
    U ← polar((1−β)·G + β·M if nesterov else M)   Newton–Schulz, `ns_steps` steps
    Sign-Muon:  V ← vote(sign(U))          majority over the replicate axis, sign(0) = +1
                V ← polar(V) if post_polar
                X ← (1 − lr·wd)·X − lr·s·V,  s = 1 ("none") or 1/√n ("unit_gain")
    Muon:       G is first averaged over the replicate axis (full-precision all-reduce);
                X ← (1 − lr·wd)·X − lr·√max(1, m/n)·U

With orthogonalize="shard" (default), polar runs on the local block (no
shard- or tensor-axis traffic); with "full" each rank orthogonalizes whole
matrices (`full_polar`, all-to-alls over the shard and tensor axes), the exact
Muon direction.
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


def polar_stages(layout: MatrixLayout, shard: Axis, tensor: Axis) -> list[tuple[Axis, int, tuple[int, ...]]]:
    """(axis, stack dim, sizes per axis rank) of each split of a (k, rows, cols) stack, innermost
    first: the rows' splits (the shard axis inside the tensor axis's block under FSDP2 over TP),
    then the columns' (tensor parallelism `Shard(1)`)."""
    axes = {"shard": shard, "tensor": tensor}
    return ([(axes[name], 1, layout.axis_parts(name)) for name in reversed(layout.row_axes)]
            + [(axes[name], 2, layout.axis_parts(name)) for name in layout.col_axes])


def full_polar(U_in: torch.Tensor, stages, orthogonalize, wire: torch.dtype):
    """polar of whole matrices split over the axes of `stages` (`polar_stages`), returned as this
    rank's blocks (a generator of collectives).

    U_in: (k, rows_i, cols_j). One stage, on an axis of S ranks splitting stack dim d: matrix j of
    the stack is owned by axis rank j mod S; an all-to-all sends every block to its owner, which
    joins them along d and hands its matrices to the next stage (the next axis, on the matrices it
    owns); the last stage orthogonalizes whole m×n matrices (`orthogonalize`, a polar with the
    group's settings); a second all-to-all per stage returns the blocks. Each rank does 1/Π S of
    the bucket's Newton–Schulz work (k a multiple of Π S). The all-to-alls carry `wire` (bf16
    halves the bytes; only the signs of the result are used). Bytes of a stage, each way:
    (k_s − own matrices)·(block entries) elements, k_s the stage's stack.
    """
    if not stages:
        return orthogonalize(U_in)
    axis, dim, parts = stages[0]
    k = U_in.shape[0]
    block = list(U_in.shape[1:])
    owners = [list(range(owner, k, axis.size)) for owner in range(axis.size)]
    mine = owners[axis.rank]

    def shape_with(size):
        shape = list(block)
        shape[dim - 1] = size
        return shape

    to_owner = [len(matrices) * math.prod(block) for matrices in owners]
    from_ranks = [len(mine) * math.prod(shape_with(size)) for size in parts]
    sent = torch.cat([U_in[matrices].reshape(-1) for matrices in owners]).to(wire)
    received = (yield axis.all_to_all(sent, to_owner, from_ranks, async_op=True)).to(U_in.dtype)
    whole = torch.cat([piece.view(len(mine), *shape_with(size))
                       for piece, size in zip(received.split(from_ranks), parts)], dim=dim)
    U = yield from full_polar(whole, stages[1:], orthogonalize, wire)       # (len(mine), …, whole along dim)
    back = torch.cat([piece.reshape(-1) for piece in U.split(list(parts), dim=dim)]).to(wire)
    returned = (yield axis.all_to_all(back, from_ranks, to_owner, async_op=True)).to(U.dtype)
    out = U.new_empty((k, *block))
    for matrices, piece in zip(owners, returned.split(to_owner)):
        out[matrices] = piece.view(len(matrices), *block)
    return out


def work_split(layout: MatrixLayout, group: dict, replicas: int) -> int:
    """How many ranks share a bucket's Newton–Schulz work: the ranks of the axes splitting the matrix
    with orthogonalize="full" (`full_polar`). The replicate axis never splits it: each replica
    orthogonalizes its own momentum."""
    if group["orthogonalize"] != "full":
        return 1
    return math.prod(len(layout.axis_parts(name)) for name in layout.row_axes + layout.col_axes)


def _direction(grads, states, group: dict, layout: MatrixLayout, shard: Axis, tensor: Axis):
    """The polar direction U (k, m_i, n_j) of the new momentum, which is written back to the state
    first, so that only U's working copy outlives Newton–Schulz. With orthogonalize="shard" polar
    runs on the local block; with "full" on whole matrices (a generator of collectives)."""
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
        return (yield from full_polar(M, polar_stages(layout, shard, tensor), _polar(group),
                                      getattr(torch, group["wire_dtype"])))
    return _polar(group)(M)


def _apply(params, update, group: dict, scale: float) -> None:
    """X ← (1 − lr·wd)·X − lr·scale·update, matrix by matrix (update: (k, m_i, n), any dtype)."""
    lr = group["lr"]
    for param, matrix in zip(params, update):
        param.mul_(1 - lr * group["weight_decay"]).add_(matrix.to(param.dtype), alpha=-lr * scale)


def voted_direction(grads, states, group: dict, layout: MatrixLayout, replicate: Axis, shard: Axis, seed: int,
                    tensor: Axis):
    """The voted ±1/0 direction (k, m_i, n_j) as int8 (a generator); the new momentum is in the states."""
    U = yield from _direction(grads, states, group, layout, shard, tensor)
    positive = (U >= 0).reshape(-1)
    shape = U.shape
    del U
    fmt = resolve_vote(group["vote"], positive.numel(), replicate.size)
    return (yield from vote_exchange(positive, replicate, fmt, seed)).view(shape)


def step(params, grads, states, group: dict, layout: MatrixLayout, replicate: Axis, shard: Axis, seed: int,
         tensor: Axis):
    """One Sign-Muon step on a bucket of same-layout matrices (local tensors, updated in place).
    A generator that yields each collective (schedule.overlap runs it). The layout says which of
    `shard` and `tensor` split the matrices (a whole matrix joins neither's collectives)."""
    V = yield from voted_direction(grads, states, group, layout, replicate, shard, seed, tensor)
    update = _polar(group)(V.to(compute_dtype(params[0].dtype))) if group["post_polar"] else V
    m, n = layout.shape
    scale = 1.0 if group["lr_scale"] == "none" else 1 / math.sqrt(n)
    _apply(params, update, group, scale)


def muon_step(params, grads, states, group: dict, layout: MatrixLayout, replicate: Axis, shard: Axis, seed: int,
              tensor: Axis):
    """One Muon step (baseline): full-precision gradient mean, then polar of the momentum (a generator)."""
    G = yield replicate.all_reduce(stack_as(grads, compute_dtype(grads[0].dtype)), "mean", async_op=True)
    U = yield from _direction(list(G), states, group, layout, shard, tensor)
    m, n = layout.shape
    _apply(params, U, group, math.sqrt(max(1.0, m / n)))
