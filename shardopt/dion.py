"""Dion: low-rank power iteration with error feedback (docs/design.md §1).

For a stack of k same-shape matrices, in the orientation B (a×b) where the
row splits (shard axis, tensor axis under ColwiseParallel) split b, and with
columns split alone (tensor parallelism Shard(1)) the tensor axis splits b (see
`MatrixLayout.transpose`); this rank holds the block B_ij, a_i × b_j (the a-axis,
if any, splits a; the b-axes split b):

    B ← M + G                                  (k, a_i, b_j)
    P ← B·Q                                    (k, a_i, r) b-axes: Σ over blocks; replicate: mean
    P ← orthonormalize(P)                      whole P: gathered over the a-axis when a is split
    R ← Bᵀ·P                                   (k, b_j, r) a-axis: Σ over blocks; replicate: mean
                                               (P, R cross the replicate axis in `wire_dtype`,
                                               rounded first: every replica holds the same values,
                                               and the error feedback below uses them)
    M ← B − (1−μ)·P·Rᵀ                         error feedback, local to the replica
    Q ← R / (‖R[:, j]‖₂ + ε)                   column norms summed over the b-axes
    X ← (1 − lr·wd)·X − lr·√(m/n)·P·Qᵀ         X is m×n (fan_out×fan_in)

When low rank saves nothing on the wire (rank_fraction = 1 or (a+b)·r ≥ a·b)
the replicate axis averages G instead and P, R need no averaging.
"""

from __future__ import annotations

import math

import torch

from .buckets import compute_dtype, stack_as
from .comm import Axis
from .hyperparams import state_dtype
from .lowrank import column_normalize, dion_rank, orthonormalize
from .matrices import matrix_blocks, matrix_seed, param_matrices, single_matrix
from .placement import MatrixLayout, dim0_shards, like_param, local
from .signs import padded_length


def oriented_shape(layout: MatrixLayout) -> tuple[int, int]:
    """(a, b) of B: B = Xᵀ when layout.transpose."""
    m, n = layout.shape
    return (n, m) if layout.transpose else (m, n)


def oriented_block(layout: MatrixLayout) -> tuple[tuple[int, int], tuple[int, int]]:
    """((a_start, a_i), (b_start, b_j)): where this rank's block of B starts and its size, per side."""
    rows, cols = (layout.row_start, layout.rows), (layout.col_start, layout.cols)
    return (cols, rows) if layout.transpose else (rows, cols)


def oriented_axes(layout: MatrixLayout) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(a-axes, b-axes): the axes that split a and b, outer first."""
    return (layout.col_axes, layout.row_axes) if layout.transpose else (layout.row_axes, layout.col_axes)


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
    (so every replica, shard and tensor rank draws the same matrix), then this rank's rows of b."""
    a, b = oriented_shape(layout)
    generator = torch.Generator().manual_seed(seed)
    Q = torch.randn(b, rank_of(layout, group), generator=generator, dtype=torch.float32)
    _, (b_start, b_rows) = oriented_block(layout)
    return Q[b_start:b_start + b_rows].to(device=device, dtype=dtype)


def q_shape(param: torch.Tensor, group: dict, label: str = "") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global, local) shape of a param's Q state. One matrix (`single_matrix`): b×r, locally this
    rank's block of b (split like X's b side over the shard / tensor axes). A 3-D stack or a param
    split into blocks (its matrices j, the blocks of one slab, shardopt/matrices.py): (*E, Σ_j b_j, max_j r_j), the
    local rows following the param's dim 0 (rows, or experts) when the param is sharded."""
    blocks = matrix_blocks(param, group, label)
    if single_matrix(param, group):
        layout = blocks[0].layout
        b, r = oriented_shape(layout)[1], rank_of(layout, group)
        return (b, r), (oriented_block(layout)[1][1], r)
    layouts = [block.layout for block in blocks]
    shape = (*param.shape[:-2], sum(oriented_shape(layout)[1] for layout in layouts),
             max(rank_of(layout, group) for layout in layouts))
    return shape, ((local(param).shape[0], *shape[1:]) if dim0_shards(param, label) else shape)


def init_state(param: torch.Tensor, group: dict, seed: int) -> dict:
    """momentum: zeros like X (a DTensor placed like X when X is one); Q (`q_shape`): matrix j's
    block is `initial_q` from matrix_seed(seed, j) (this rank's rows of it), its padding columns
    zero; when X is split, a DTensor placed like X's b side (a 2-D param: split like it over the
    b-axes, replicated over the a-axis; otherwise like X's dim 0); both in the group's state dtype."""
    dtype = state_dtype(group, param)
    device = local(param).device
    global_shape, local_shape = q_shape(param, group)
    Q = torch.zeros(local_shape, dtype=dtype, device=device)
    matrices = param_matrices(param, group)
    for matrix in matrices:
        block = matrix.of_state(Q)
        block[:, :rank_of(matrix.layout, group)] = initial_q(matrix.layout, group, matrix_seed(seed, matrix.index),
                                                            dtype, device)
    if single_matrix(param, group):
        layout = matrices[0].layout
        Q = like_param(param, Q, global_shape[0], 0 if layout.transpose else 1) if layout.split else Q
    elif dim0_shards(param):
        Q = like_param(param, Q, global_shape[0])
    return {"momentum": torch.zeros_like(param, dtype=dtype), "Q": Q}


def work_split(layout: MatrixLayout, group: dict, replicas: int) -> int:
    """How many ranks share a bucket's orthonormalization: the ranks of the innermost b-axis (the
    shard ranks under FSDP2), times the replicas when P crosses the replicate axis (compressed); on
    the fallback the replicate axis carries G, and splitting there would add bytes. None split it
    when an axis splits a (`gathered_orthonormalize`: every rank orthonormalizes whole P)."""
    a_axes, b_axes = oriented_axes(layout)
    if a_axes:
        return 1
    inner = len(layout.axis_parts(b_axes[-1])) if b_axes else 1
    return inner * (replicas if compressed(layout, group) else 1)


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


def split_orthonormalize(P: torch.Tensor, shard: Axis, replicate: Axis, average_replicas: bool, orthonormalize_share,
                         wire: torch.dtype):
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


def exchange_orthonormalize(P: torch.Tensor, shard: Axis, replicate: Axis, average_replicas: bool,
                            orthonormalize_share, wire: torch.dtype):
    """orthonormalize(mean_replicas(Σ_shards P)) for P (k, a, r) (a generator of collectives). The
    first k − (k mod S) matrices go through `split_orthonormalize` (work split over S = F·W ranks);
    the rest, fewer than S, are exchanged whole and orthonormalized by every rank."""
    split = shard.size * (replicate.size if average_replicas else 1)
    even = P.shape[0] - P.shape[0] % split
    parts = []
    if even:
        parts.append((yield from split_orthonormalize(P[:even], shard, replicate, average_replicas,
                                                      orthonormalize_share, wire)))
    if even < P.shape[0]:
        rest = yield from sum_shards_mean_replicas(P[even:], shard, replicate, average_replicas, wire)
        parts.append(orthonormalize_share(rest))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def gathered_orthonormalize(P: torch.Tensor, a_axis: Axis, a_parts: tuple[int, ...], a_index: int, b_axes,
                            replicate: Axis, average_replicas: bool, orthonormalize_whole, wire: torch.dtype):
    """This rank's rows of orthonormalize(mean_replicas(Σ_b-axes P)) when an axis splits a (a generator).

    P: (k, a_i, r), rows a_i of `a_parts` (rows per a-axis rank). Σ over each b-axis (all-reduce
    sum), mean over the replicate axis in `wire` (only this rank's a_i rows cross it), then an
    all-gather of the a-axis row blocks (padded to ⌈a/A⌉, in `wire` when the replicate mean rounded
    them: lossless) gives every a-axis rank the whole P (k, a, r); each orthonormalizes it and keeps
    its rows. A-axis bytes: (A−1)·k·⌈a/A⌉·r elements.
    """
    for axis in b_axes:
        P = yield axis.all_reduce(P, "sum", async_op=True)
    if average_replicas:
        P = yield from replicate_mean(P, replicate, wire)
    exchanged = P.to(wire) if average_replicas and replicate.size > 1 else P
    rows = max(a_parts)
    padded = torch.nn.functional.pad(exchanged, (0, 0, 0, rows - P.shape[1]))
    blocks = yield a_axis.all_gather(padded, async_op=True)                        # (A, k, ⌈a/A⌉, r)
    whole = torch.cat([block[:, :size] for block, size in zip(blocks, a_parts)], dim=1).to(P.dtype)
    start = sum(a_parts[:a_index])
    return orthonormalize_whole(whole)[:, start:start + a_parts[a_index]]


def step(params, grads, states, group: dict, layout: MatrixLayout, replicate: Axis, shard: Axis, seed: int,
         tensor: Axis):
    """One Dion step on a bucket of same-layout matrices (local tensors, updated in place).
    A generator that yields each collective (schedule.overlap runs it). The layout says which of
    `shard` and `tensor` split the matrices (a whole matrix joins neither's collectives).

    Working memory: one fp32 copy of the bucket's momenta (B, updated in place), k·(a + b)·r for
    P, Q, R, and one matrix's update at a time."""
    axes = {"shard": shard, "tensor": tensor}
    a_names, b_names = oriented_axes(layout)
    b_axes = [axes[name] for name in b_names]
    dtype = compute_dtype(params[0].dtype)
    low_rank = compressed(layout, group)
    M = stack_as([s["momentum"] for s in states], dtype)            # (k, m_i, n_j), X's orientation
    if low_rank:
        for momentum, grad in zip(M, grads):
            momentum.add_(grad)
    else:
        G = yield replicate.all_reduce(stack_as(grads, dtype), "mean", async_op=True)
        M += G
        del G
    B = M.mT if layout.transpose else M                              # (k, a_i, b_j)
    r = rank_of(layout, group)
    Q = stack_as([s["Q"][:, :r] for s in states], dtype)            # (a split param's Q is padded to its largest r)

    def orthonormalize_share(P):
        return orthonormalize(P, group["qr_method"], seed)

    wire = wire_dtype(group)
    if a_names:
        a_axis = axes[a_names[0]]
        parts = layout.axis_parts(a_names[0])
        P = yield from gathered_orthonormalize(B @ Q, a_axis, parts, a_axis.rank, b_axes, replicate, low_rank,
                                               orthonormalize_share, wire)
    else:
        P = B @ Q
        for axis in b_axes[:-1]:                                     # the outer b-axis of FSDP2 over TP
            P = yield axis.all_reduce(P, "sum", async_op=True)
        P = yield from exchange_orthonormalize(P, b_axes[-1] if b_axes else Axis("shard"), replicate, low_rank,
                                               orthonormalize_share, wire)
    R = B.mT @ P
    if a_names:
        R = yield axes[a_names[0]].all_reduce(R, "sum", async_op=True)
    if low_rank:
        R = yield from replicate_mean(R, replicate, wire)
    # error feedback B ← B − (1−μ)·P·Rᵀ, in place on M's memory (Mᵀ ← Mᵀ − (1−μ)·R·Pᵀ when transposed)
    if layout.transpose:
        M.baddbmm_(R, P.mT, alpha=-(1 - group["mu"]))
    else:
        M.baddbmm_(P, R.mT, alpha=-(1 - group["mu"]))
    for state, momentum in zip(states, M):
        state["momentum"].copy_(momentum)
    del B, M
    col_sq_norms = (R * R).sum(dim=-2)
    for axis in b_axes:
        col_sq_norms = yield axis.all_reduce(col_sq_norms, "sum", async_op=True)
    Q = column_normalize(R, col_sq_norms, Q, group["epsilon"])

    m, n = layout.shape
    lr = group["lr"]
    scale = math.sqrt(m / n)
    for i, (param, state) in enumerate(zip(params, states)):
        state["Q"][:, :r].copy_(Q[i])
        update = P[i] @ Q[i].mT                                       # a_i×b_j
        if layout.transpose:
            update = update.mT
        param.mul_(1 - lr * group["weight_decay"]).add_(update.to(param.dtype), alpha=-lr * scale)
