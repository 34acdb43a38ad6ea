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

The four large products (B·Q, Bᵀ·P, P·Rᵀ, P·Qᵀ; k·a·b·r multiply-adds each) take their inputs rounded to the
group's `matmul_dtype` (lowrank.dion_matmul_dtype: bf16 on CUDA by default, the compute dtype on a CPU); the
orthonormalization, the column norms and every sum stay in the compute dtype (fp32).
"""

from __future__ import annotations

import math

import torch

from . import hyperparams as H
from .record import Algorithm
from ..layout.buckets import compute_dtype, stack_as
from ..wire.exchange import MEAN
from .factors import FactorMean
from .hyperparams import state_dtype
from .lowrank import column_normalize, dion_matmul_dtype, dion_rank, orthonormalize, subtract_product_
from ..layout.matrices import matrix_blocks, matrix_seed, param_matrices, single_matrix
from ..layout.placement import MatrixLayout, dim0_shards, like_param, local


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
    split into blocks (its matrices j, the blocks of one slab, shardopt/layout/matrices.py): (*E, Σ_j b_j, max_j r_j), the
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
        Q = like_param(param, Q, global_shape[0], 0 if layout.transpose else 1) if layout.distributed else Q
    elif dim0_shards(param):
        Q = like_param(param, Q, global_shape[0])
    return {"momentum": torch.zeros_like(param, dtype=dtype), "Q": Q}


def state_shapes(param: torch.Tensor, group: dict) -> dict:
    """momentum: like the param; Q: `q_shape`."""
    return {"momentum": (tuple(param.shape), tuple(local(param).shape)), "Q": q_shape(param, group)}


def work_ranks(layout: MatrixLayout, group: dict, replicas: int) -> int:
    """How many ranks share a bucket's orthonormalization: the ranks of the innermost b-axis (the
    shard ranks under FSDP2), times the replicas when P crosses the replicate axis (compressed); on
    the fallback the replicate axis carries G, and splitting there would add bytes. None share it
    when an axis splits a (`gathered_orthonormalize`: every rank orthonormalizes whole P)."""
    a_axes, b_axes = oriented_axes(layout)
    if a_axes:
        return 1
    inner = len(layout.axis_parts(b_axes[-1])) if b_axes else 1
    return inner * (replicas if compressed(layout, group) else 1)


def factor_exchange(group: dict, layout: MatrixLayout, numel: int, replicas: int) -> FactorMean:
    """The bucket's replicate exchange (the record's `exchange`): P and R in the group's wire dtype when low
    rank saves bytes, else the gradient mean (factors.FactorMean)."""
    return FactorMean(compressed(layout, group), getattr(torch, group["wire_dtype"]), rank_of(layout, group))


def options(group: dict) -> dict:
    return {"lr": group["lr"], "mu": group["mu"], "weight_decay": group["weight_decay"],
            "epsilon": group["epsilon"], "qr_method": group["qr_method"], "matmul_dtype": group["matmul_dtype"]}


def power_iteration(B: torch.Tensor, Q: torch.Tensor, *, layout: MatrixLayout, exchange: FactorMean, axes,
                    orthonormalize_share):
    """One power iteration on B (k, a_i, b_j) from Q (k, b_j, r), over the axes that split B (`layout`) and
    the replicas (a generator of collectives; returns (P, R, R̄) in Q's dtype; B may come in a lower matmul
    dtype, the products' inputs are then rounded to it):

        P = orthonormalize(mean_replicas(Σ_b-axes B·Q))     (k, a_i, r)   exchange.basis
        R = Σ_a-axis Bᵀ·P                                   (k, b_j, r)   this replica's R
        R̄ = mean_replicas(R)                                (k, b_j, r)   in the exchange's wire dtype

    `orthonormalize_share(P)` orthonormalizes a stack of whole P (k', a, r)."""
    a_names, b_names = oriented_axes(layout)
    a_axes, b_axes = [getattr(axes, name) for name in a_names], [getattr(axes, name) for name in b_names]
    a_parts = layout.axis_parts(a_names[0]) if a_names else ()
    P = yield from exchange.basis((B @ Q.to(B.dtype)).to(Q.dtype), a_axes, a_parts, b_axes, axes.replicate,
                                  orthonormalize_share)
    R = yield from exchange.r_sum((B.mT @ P.to(B.dtype)).to(Q.dtype), a_axes)
    return P, R, (yield from exchange.r_mean(R, axes.replicate))


def next_q(R: torch.Tensor, Q: torch.Tensor, *, layout: MatrixLayout, axes, epsilon: float):
    """Q ← R / (‖R[:, j]‖₂ + ε) for R, Q (k, b_j, r), the squared column norms summed over the b-axes (the
    distributed column normalization; a column with ‖R[:, j]‖ = 0 keeps Q's). A generator; returns Q."""
    col_sq_norms = (R * R).sum(dim=-2)
    for name in oriented_axes(layout)[1]:
        col_sq_norms = yield getattr(axes, name).all_reduce(col_sq_norms, "sum", async_op=True)
    return column_normalize(R, col_sq_norms, Q, epsilon)


def step(params, grads, states, *, layout: MatrixLayout, exchange: FactorMean, axes, seed: int, lr: float,
         mu: float, weight_decay: float, epsilon: float, qr_method: str, matmul_dtype: str | None):
    """One Dion step on a bucket of same-layout matrices (local tensors, updated in place): the module
    docstring's equations, a generator of collectives (schedule.py). The layout says which of
    axes.shard and axes.tensor split the matrices. Working memory: one fp32 copy of the momenta
    (B, in place), k·(a + b)·r for P, Q, R, one matrix's update at a time; with a lower matmul dtype
    (bf16) also B and the error feedback's P·Rᵀ in it (k·a·b each, half the fp32 copy)."""
    dtype, r = compute_dtype(params[0].dtype), exchange.rank
    low = dion_matmul_dtype(matmul_dtype, dtype, params[0].device)
    # momentum: B ← M + G (G averaged over the replicas first when low rank saves nothing)
    M = stack_as([s["momentum"] for s in states], dtype)            # (k, m_i, n_j), X's orientation
    if exchange.low_rank:
        for momentum, grad in zip(M, grads):
            momentum.add_(grad)
    else:
        M += (yield from MEAN.stacked(grads, dtype, axes.replicate))
    B = M.mT if layout.transpose else M                              # (k, a_i, b_j)
    Q = stack_as([s["Q"][:, :r] for s in states], dtype)            # (a split param's Q is padded to its largest r)
    # direction: P ← orthonormalize(mean B·Q), R ← mean Bᵀ·P
    P, _, R = yield from power_iteration(B.to(low), Q, layout=layout, exchange=exchange, axes=axes,
                                         orthonormalize_share=lambda P: orthonormalize(P, qr_method, seed))
    # error feedback B ← B − (1−μ)·P·Rᵀ, in place on M's memory (Mᵀ ← Mᵀ − (1−μ)·R·Pᵀ when transposed)
    subtract_product_(M, *((R, P.mT) if layout.transpose else (P, R.mT)), 1 - mu, low)
    for state, momentum in zip(states, M):
        state["momentum"].copy_(momentum)
    del B, M
    Q = yield from next_q(R, Q, layout=layout, axes=axes, epsilon=epsilon)
    # apply: X ← (1 − lr·wd)·X − lr·√(m/n)·P·Qᵀ
    m, n = layout.shape
    for param, state, P_i, Q_i in zip(params, states, P, Q):
        state["Q"][:, :r].copy_(Q_i)
        update = P_i.to(low) @ Q_i.to(low).mT                         # a_i×b_j
        param.mul_(1 - lr * weight_decay).add_((update.mT if layout.transpose else update).to(param.dtype),
                                               alpha=-lr * math.sqrt(m / n))


DION = Algorithm(
    name="dion", matrix=True, state_keys=("momentum", "Q"),
    hyperparameters={"lr": H.LR, "weight_decay": H.WEIGHT_DECAY, "epsilon": H.EPSILON, "mu": H.MU,
                     "rank_fraction": H.RANK_FRACTION, "rank_multiple_of": H.RANK_MULTIPLE_OF,
                     "qr_method": H.QR_METHOD, "wire_dtype": H.WIRE_DTYPE, "state_dtype": H.STATE_DTYPE,
                     "split": H.SPLIT, "matmul_dtype": H.MATMUL_DTYPE},
    plan_keys=("rank_fraction", "rank_multiple_of", "wire_dtype", "split"),
    init_state=init_state, state_shapes=state_shapes, step=step, options=options, exchange=factor_exchange,
    describe_exchange=lambda group: f"rank_fraction {group['rank_fraction']:g}, {group['wire_dtype']} factors",
    b_side_state=("Q",), decoupled_momentum="momentum", momentum="mu", work_ranks=work_ranks)
