"""Dion's factor exchange (docs/design.md §1): the mean of P = B·Q and R = Bᵀ·P over the replicas, in the
layouts a bucket can have (whole, split over the shard / tensor axes, gathered over the a-axis), with the
orthonormalization of P split over the ranks that hold the same P. Each function is a generator of
collectives (optim/schedule.py), as the exchanges of wire/exchange.py are."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..wire.comm import Axis
from ..wire.signs import padded_length


@dataclass(frozen=True)
class FactorMean:
    """Dion's exchange of a bucket: with `low_rank`, the mean of P = B·Q and R = Bᵀ·P over the
    replicas in `wire` (rounded first, so every replica applies the same values); without (rank
    fraction 1, or (a+b)·r ≥ a·b) the gradients are averaged instead (`Mean`) and P, R only summed
    over the shard / tensor axes. `rank`: r of the bucket's matrices."""

    low_rank: bool
    wire: torch.dtype
    rank: int

    def basis(self, P: torch.Tensor, a_axes: list, a_parts, b_axes: list, replicate: Axis, orthonormalize_share):
        """orthonormalize(mean_replicas(Σ_b-axes P)) for P (k, a_i, r): gathered over the a-axis when one
        splits a (`gathered_orthonormalize`), else the work split over the ranks (`shared_orthonormalize`)."""
        if a_axes:
            return (yield from gathered_orthonormalize(P, a_axes[0], a_parts, b_axes, replicate, self.low_rank,
                                                       orthonormalize_share, self.wire))
        for axis in b_axes[:-1]:                                     # the outer b-axis of FSDP2 over TP
            P = yield axis.all_reduce(P, "sum", async_op=True)
        return (yield from orthonormalized_mean(P, b_axes[-1] if b_axes else Axis("shard"), replicate,
                                                self.low_rank, orthonormalize_share, self.wire))

    def r_sum(self, R: torch.Tensor, a_axes: list):
        """Σ_a-axis R for R (k, b_j, r): this replica's R, the one `r_mean` averages."""
        if a_axes:
            R = yield a_axes[0].all_reduce(R, "sum", async_op=True)
        return R

    def r_mean(self, R: torch.Tensor, replicate: Axis):
        """mean_replicas(R) for this replica's R (k, b_j, r) (`r_sum`), in `wire` when low rank."""
        if self.low_rank:
            R = yield from replicate_mean(R, replicate, self.wire)
        return R


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
    """P ← mean_replicas(Σ_shards P) for P (k, a, r); a generator of collectives.

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
    sent = piece.to(wire) if replicate.size > 1 else piece   # what the all-gather carries: `wire` values, lossless
    gathered = yield shard.all_gather(sent, async_op=True)
    return gathered.to(P.dtype).reshape(rows, k, r)[:a].permute(1, 0, 2)


def shared_orthonormalize(P: torch.Tensor, shard: Axis, replicate: Axis, average_replicas: bool,
                          orthonormalize_share, wire: torch.dtype):
    """orthonormalize(mean_replicas(Σ_shards P)) for P (k, a, r), k a multiple of S = F·W
    (W = replicate size when averaging, else 1), each rank orthonormalizing k/S matrices
    (a generator of collectives).

    Shard axis: reduce-scatter the matrices (rank i gets the sum of its k/F), all-gather at the
    end. Replicate axis, in `wire` (as the all-reduce it replaces): reduce-scatter that piece (rank
    j gets the sum of its k/S), divide by W, orthonormalize in P's dtype, all-gather the result
    rounded to `wire`, so every replica (the owner too) applies the same values. A reduce-scatter
    plus an all-gather moves 2(M−1)/M of the input: the bytes of the all-reduce of P it replaces.
    """
    k, a, r = P.shape
    piece = (yield shard.reduce_scatter(P, async_op=True)) if shard.size > 1 else P
    voters = replicate.size if average_replicas else 1
    if voters > 1:
        summed = yield replicate.reduce_scatter(piece.to(wire), async_op=True)
        piece = summed.div_(voters).to(P.dtype)
    piece = orthonormalize_share(piece)
    if voters > 1:
        piece = (yield replicate.all_gather(piece.to(wire), async_op=True)).reshape(-1, a, r)
    if shard.size > 1:
        piece = (yield shard.all_gather(piece, async_op=True)).reshape(k, a, r)
    return piece.to(P.dtype)


def orthonormalized_mean(P: torch.Tensor, shard: Axis, replicate: Axis, average_replicas: bool,
                         orthonormalize_share, wire: torch.dtype):
    """orthonormalize(mean_replicas(Σ_shards P)) for P (k, a, r) (a generator of collectives). The
    first k − (k mod S) matrices go through `shared_orthonormalize` (work split over S = F·W
    ranks); the rest, fewer than S, are exchanged whole and orthonormalized by every rank."""
    share = shard.size * (replicate.size if average_replicas else 1)
    even = P.shape[0] - P.shape[0] % share
    parts = []
    if even:
        parts.append((yield from shared_orthonormalize(P[:even], shard, replicate, average_replicas,
                                                       orthonormalize_share, wire)))
    if even < P.shape[0]:
        rest = yield from sum_shards_mean_replicas(P[even:], shard, replicate, average_replicas, wire)
        parts.append(orthonormalize_share(rest))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def gathered_orthonormalize(P: torch.Tensor, a_axis: Axis, a_parts: tuple[int, ...], b_axes, replicate: Axis,
                            average_replicas: bool, orthonormalize_whole, wire: torch.dtype):
    """This rank's rows of orthonormalize(mean_replicas(Σ_b-axes P)) when an axis splits a (a generator).

    P: (k, a_i, r), rows a_i of `a_parts` (rows per a-axis rank; this rank is a_axis.rank). Σ over
    each b-axis (all-reduce sum), mean over the replicate axis in `wire` (only this rank's a_i rows
    cross it), then an all-gather of the a-axis row blocks (padded to ⌈a/A⌉, in `wire` when the
    replicate mean rounded them: lossless) gives every a-axis rank the whole P (k, a, r); each
    orthonormalizes it and keeps its rows. A-axis bytes: (A−1)·k·⌈a/A⌉·r elements.
    """
    for axis in b_axes:
        P = yield axis.all_reduce(P, "sum", async_op=True)
    if average_replicas:
        P = yield from replicate_mean(P, replicate, wire)
    sent = P.to(wire) if average_replicas and replicate.size > 1 else P   # (`wire` values after the mean: lossless)
    rows = max(a_parts)
    padded = torch.nn.functional.pad(sent, (0, 0, 0, rows - P.shape[1]))
    blocks = yield a_axis.all_gather(padded, async_op=True)                        # (A, k, ⌈a/A⌉, r)
    whole = torch.cat([block[:, :size] for block, size in zip(blocks, a_parts)], dim=1).to(P.dtype)
    start = sum(a_parts[:a_axis.rank])
    return orthonormalize_whole(whole)[:, start:start + a_parts[a_axis.rank]]
