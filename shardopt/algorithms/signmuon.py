"""Sign-Muon (docs/design.md §2) and the Muon baseline: momentum → polar direction → exchange → update.

For a stack of k same-shape matrices X (m×n, local block m_i×n_j) with gradient G:

    M ← β·M + (1−β)·G                      EMA momentum (one buffer)
    U ← polar((1−β)·G + β·M if nesterov else M)   Newton–Schulz, `ns_steps` steps of `ns_coefficients`
    Sign-Muon:  V ← vote(sign(U))          majority over the replicate axis, sign(0) = +1; a matrix
                                           whose U-input is exactly zero (so U = 0) is silent: it
                                           votes on none of its entries (vote.py), and where every
                                           replica is silent V = 0 there
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

from . import hyperparams as H
from .record import Algorithm
from ..layout.buckets import compute_dtype, stack_as
from ..wire.comm import Axis
from ..wire.exchange import MEAN, Mean, Vote
from .hyperparams import state_dtype
from ..layout.placement import MatrixLayout, local
from .polar import polar
from ..wire.signs import positive_signs
from ..wire.vote import vote_format


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


def init_state(param: torch.Tensor, group: dict, seed: int) -> dict:
    """momentum: zeros like the param (all its matrices: shardopt/layout/matrices.py)."""
    return {"momentum": torch.zeros_like(param, dtype=state_dtype(group, param))}


def state_shapes(param: torch.Tensor, group: dict) -> dict:
    return {"momentum": (tuple(param.shape), tuple(local(param).shape))}


def work_ranks(layout: MatrixLayout, group: dict, replicas: int) -> int:
    """How many ranks share a bucket's Newton–Schulz work: the ranks of the axes splitting the matrix
    with orthogonalize="full" (`full_polar`). The replicate axis never splits it: each replica
    orthogonalizes its own momentum."""
    if group["orthogonalize"] != "full":
        return 1
    return math.prod(len(layout.axis_parts(name)) for name in layout.row_axes + layout.col_axes)


def options(group: dict) -> dict:
    """The step's keyword arguments; `polar`: polar with the group's Newton–Schulz steps, coefficient
    schedule, dtype (None: bf16 on CUDA, fp32 elsewhere) and `compile` option."""
    ns_dtype = getattr(torch, group["ns_dtype"]) if group["ns_dtype"] else None
    return {"lr": group["lr"], "weight_decay": group["weight_decay"], "momentum": group["momentum"],
            "nesterov": group["nesterov"], "orthogonalize": group["orthogonalize"],
            "wire_dtype": getattr(torch, group["wire_dtype"]),
            "polar": functools.partial(polar, steps=group["ns_steps"], dtype=ns_dtype, compile=group["compile"],
                                       coefficients=group["ns_coefficients"]),
            "post_polar": group["post_polar"], "lr_scale": group["lr_scale"]}


def direction(grads, states, *, layout: MatrixLayout, axes, momentum: float, nesterov: bool, orthogonalize: str,
              polar, wire_dtype: torch.dtype):
    """The polar direction U (k, m_i, n_j) of the new momentum M ← β·M + (1−β)·G, which is written
    back to the state first, so that only U's working copy outlives Newton–Schulz. With
    orthogonalize="shard" polar runs on the local block; with "full" on whole matrices (a
    generator of collectives)."""
    dtype = compute_dtype(grads[0].dtype)
    M = stack_as([s["momentum"] for s in states], dtype)
    for buffer, grad in zip(M, grads):
        buffer.lerp_(grad.to(dtype), 1 - momentum)
    for state, buffer in zip(states, M):
        state["momentum"].copy_(buffer)
    if nesterov:
        for buffer, grad in zip(M, grads):          # U-input (1−β)·G + β·M, in M's memory
            buffer.lerp_(grad.to(dtype), 1 - momentum)
    if orthogonalize == "full":
        return (yield from full_polar(M, polar_stages(layout, axes.shard, axes.tensor), polar, wire_dtype))
    return polar(M)


def apply(params, update, *, lr: float, weight_decay: float, scale: float) -> None:
    """X ← (1 − lr·wd)·X − lr·scale·update, matrix by matrix (update: (k, m_i, n), any dtype)."""
    for param, matrix in zip(params, update):
        param.mul_(1 - lr * weight_decay).add_(matrix.to(param.dtype), alpha=-lr * scale)


def silence_flags(layout: MatrixLayout, numel: int) -> int:
    """The silence flags of a bucket's vote (vote.py): one per matrix block, none on a rank whose
    blocks are empty (nothing to vote on)."""
    return numel // (layout.rows * layout.cols) if numel else 0


def step(params, grads, states, *, layout: MatrixLayout, exchange: Vote, axes, seed: int, lr: float,
         weight_decay: float, post_polar: bool, lr_scale: str, polar, **direction_options):
    """One Sign-Muon step on a bucket of same-layout matrices (local tensors, updated in place), the
    equations of the module docstring; a generator that yields each collective (schedule.pipeline)."""
    U = yield from direction(grads, states, layout=layout, axes=axes, polar=polar, **direction_options)
    shape = U.shape
    positive = positive_signs(U).reshape(-1)
    silent = ~U.reshape(shape[0], -1).any(1) if U.numel() else None   # (k,): a zero momentum has no direction
    del U
    V = (yield from exchange.signs(positive, axes.replicate, seed, silent=silent)).view(shape)
    update = polar(V.to(compute_dtype(params[0].dtype))) if post_polar else V
    apply(params, update, lr=lr, weight_decay=weight_decay, scale=1.0 if lr_scale == "none" else 1 / math.sqrt(layout.shape[1]))


def muon_step(params, grads, states, *, layout: MatrixLayout, exchange: Mean, axes, seed: int, lr: float,
              weight_decay: float, post_polar: bool, lr_scale: str, **direction_options):
    """One Muon step (baseline): full-precision gradient mean, then polar of the momentum (a generator)."""
    G = yield from exchange.stacked(grads, compute_dtype(grads[0].dtype), axes.replicate)
    U = yield from direction(list(G), states, layout=layout, axes=axes, **direction_options)
    m, n = layout.shape
    apply(params, U, lr=lr, weight_decay=weight_decay, scale=math.sqrt(max(1.0, m / n)))


_MUON_KEYS = {"lr": H.LR, "weight_decay": H.WEIGHT_DECAY, "momentum": H.MOMENTUM, "nesterov": H.NESTEROV,
              "ns_steps": H.NS_STEPS, "ns_coefficients": H.NS_COEFFICIENTS, "ns_dtype": H.NS_DTYPE}
_MATRIX_KEYS = {"orthogonalize": H.ORTHOGONALIZE_KEY, "wire_dtype": H.WIRE_DTYPE, "state_dtype": H.STATE_DTYPE,
                "compile": H.COMPILE, "split": H.SPLIT}
_COMMON = dict(matrix=True, state_keys=("momentum",), init_state=init_state, state_shapes=state_shapes,
               options=options, decoupled_momentum="momentum", momentum="momentum", work_ranks=work_ranks)

SIGN_MUON = Algorithm(
    name="signmuon", step=step,
    hyperparameters={**_MUON_KEYS, "post_polar": H.POST_POLAR, "lr_scale": H.LR_SCALE, "vote": H.VOTE,
                     **_MATRIX_KEYS},
    plan_keys=("vote", "orthogonalize", "split"),
    exchange=lambda group, layout, numel, replicas: Vote(vote_format(group["vote"], numel, replicas,
                                                                     silence_flags(layout, numel))),
    describe_exchange=lambda group: f"1-bit vote ({group['vote']})", **_COMMON)

MUON = Algorithm(
    name="muon", step=muon_step, hyperparameters={**_MUON_KEYS, **_MATRIX_KEYS},
    plan_keys=("orthogonalize", "split"), exchange=lambda group, layout, numel, replicas: MEAN,
    describe_exchange=lambda group: "full-precision gradient mean", **_COMMON)
