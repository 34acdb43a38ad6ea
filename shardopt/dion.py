"""Dion: low-rank power iteration with error feedback (DESIGN §1).

For a stack of k same-shape matrices, in the orientation B (a×b) where the
shard axis splits b (see `MatrixLayout.transpose`), with local rows b_i:

    B ← M + G                                  (k, a, b_i)
    P ← B·Q                                    (k, a, r)   shard: Σ over blocks; replicate: mean
    P ← orthonormalize(P)
    R ← Bᵀ·P                                   (k, b_i, r) replicate: mean
                                               (P, R cross the replicate axis in `wire_dtype`,
                                               rounded first: every replica holds the same values,
                                               and the error feedback below uses them)
    M ← B − (1−μ)·P·Rᵀ                         error feedback, local to the replica
    Q ← R / (‖R[:, j]‖₂ + ε)                   column norms summed over the shard axis
    X ← (1 − lr·wd)·X − lr·√(m/n)·P·Qᵀ         X is m×n (fan_out×fan_in)

When low rank saves nothing on the wire (rank_fraction = 1 or (a+b)·r ≥ a·b)
the replicate axis averages G instead and P, R need no averaging.
"""

from __future__ import annotations

import math

import torch

from .comm import Axis
from .lowrank import column_normalize, dion_rank, orthonormalize
from .placement import MatrixLayout, like_param, local
from .signs import padded_length


def oriented_shape(layout: MatrixLayout) -> tuple[int, int]:
    """(a, b) of B: B = Xᵀ when layout.transpose."""
    m, n = layout.shape
    return (n, m) if layout.transpose else (m, n)


def rank_of(layout: MatrixLayout, group: dict) -> int:
    m, n = layout.shape
    return dion_rank(m, n, group["rank_fraction"], group["rank_multiple_of"])


def compressed(layout: MatrixLayout, group: dict) -> bool:
    """True when the replicate axis exchanges P and R ((a+b)·r numbers) rather than G (a·b)."""
    a, b = oriented_shape(layout)
    r = rank_of(layout, group)
    return group["rank_fraction"] < 1 and (a + b) * r < a * b


def initial_q(layout: MatrixLayout, group: dict, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Q₀ ~ N(0, 1), b×r, drawn in float32 from torch.Generator().manual_seed(seed) on the CPU
    (so every replica and every shard rank draws the same matrix), then this rank's rows of b."""
    a, b = oriented_shape(layout)
    generator = torch.Generator().manual_seed(seed)
    Q = torch.randn(b, rank_of(layout, group), generator=generator, dtype=torch.float32)
    if layout.transpose:
        Q = Q[layout.row_start:layout.row_start + layout.rows]
    return Q.to(device=device, dtype=dtype)


def init_state(param: torch.Tensor, layout: MatrixLayout, group: dict, seed: int) -> dict:
    """momentum: zeros like X (a DTensor placed like X when X is one); Q: b×r, a DTensor with X's
    row placement when the shard axis splits b."""
    Q = initial_q(layout, group, seed, param.dtype, local(param).device)
    return {"momentum": torch.zeros_like(param), "Q": like_param(param, Q, layout.shape[0]) if layout.sharded else Q}


def wire_dtype(group: dict) -> torch.dtype:
    """The group's replicate-axis precision of P and R (torch.bfloat16 or torch.float32)."""
    return getattr(torch, group["wire_dtype"])


def replicate_mean(T: torch.Tensor, replicate: Axis, wire: torch.dtype):
    """T ← mean over the replicate axis, exchanged in `wire`: T is rounded to `wire` before the
    all-reduce, so every replica gets the same values, returned in T's dtype (a generator).
    Nothing is rounded on a replicate axis of size 1 (nothing is exchanged)."""
    if replicate.size == 1:
        return T
    mean = yield replicate.all_reduce(T.to(wire), "mean", async_op=True)
    return mean.to(T.dtype)


def sum_shards_mean_replicas(P: torch.Tensor, shard: Axis, replicate: Axis, average_replicas: bool,
                             wire: torch.dtype):
    """P ← mean_replicas(Σ_shards P) for P (k, a, r); a generator of collectives (see schedule.py).

    With both axes (HSDP) the replicate axis carries only this rank's a/F rows:
    reduce-scatter the rows over the shard axis, average the piece over the
    replicate axis (in `wire`), all-gather it back in `wire` (lossless: the piece
    holds `wire` values; rows padded to a multiple of F).
    """
    if not average_replicas:
        return (yield shard.all_reduce(P, "sum", async_op=True))
    if shard.size == 1:
        return (yield from replicate_mean(P, replicate, wire))
    k, a, r = P.shape
    rows = padded_length(a, shard.size)
    by_rows = torch.nn.functional.pad(P.permute(1, 0, 2), (0, 0, 0, 0, 0, rows - a))   # (rows, k, r)
    piece = yield shard.reduce_scatter(by_rows, async_op=True)                          # (rows/F, k, r)
    piece = yield from replicate_mean(piece, replicate, wire)
    exchanged = piece.to(wire) if replicate.size > 1 else piece
    gathered = yield shard.all_gather(exchanged, async_op=True)
    return gathered.to(P.dtype).reshape(rows, k, r)[:a].permute(1, 0, 2)


def step(params, grads, states, group: dict, layout: MatrixLayout, replicate: Axis, shard: Axis, seed: int):
    """One Dion step on a bucket of same-layout matrices (local tensors, updated in place).
    A generator that yields each collective (schedule.overlap runs it)."""
    dtype = torch.promote_types(params[0].dtype, torch.float32)
    G = torch.stack(grads).to(dtype)
    B = torch.stack([s["momentum"] for s in states]).to(dtype)
    Q = torch.stack([s["Q"] for s in states]).to(dtype)
    low_rank = compressed(layout, group)
    if not low_rank:
        G = yield replicate.all_reduce(G, "mean", async_op=True)
    if layout.transpose:
        G, B = G.mT, B.mT
    B += G

    wire = wire_dtype(group)
    P = yield from sum_shards_mean_replicas(B @ Q, shard, replicate, low_rank, wire)
    P = orthonormalize(P, group["qr_method"])
    R = B.mT @ P
    if low_rank:
        R = yield from replicate_mean(R, replicate, wire)
    B.sub_(P @ R.mT, alpha=1 - group["mu"])
    col_sq_norms = yield shard.all_reduce((R * R).sum(dim=-2), "sum", async_op=True)
    Q = column_normalize(R, col_sq_norms, Q, group["epsilon"])

    update = P @ Q.mT
    if layout.transpose:
        B, update = B.mT, update.mT
    m, n = layout.shape
    lr = group["lr"]
    scale = math.sqrt(m / n)
    for i, (param, state) in enumerate(zip(params, states)):
        state["momentum"].copy_(B[i])
        state["Q"].copy_(Q[i])
        param.mul_(1 - lr * group["weight_decay"]).add_(update[i].to(param.dtype), alpha=-lr * scale)
