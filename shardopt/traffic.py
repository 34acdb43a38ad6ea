"""Replicate-axis bytes per step, from the same formulas the communication layer counts with.

One rank's bytes sent on the replicate axis for one optimizer step, per bucket of matrices or per
element-wise group (M replicas; F ranks on the innermost axis splitting Dion's b side — the shard
axis under FSDP2, the tensor axis under tensor parallelism `Shard(1)` alone; this rank's block of
B is a_i × b_j, a_i = a unless an axis splits a; `collective_bytes` is the ring formula of comm.py):

| algorithm | exchange | bytes |
|---|---|---|
| "dion", compressed, a whole | P (k, a/F, r), R (k, b_j, r) averaged in `wire_dtype` | AR(k·⌈a/F⌉·r·w) + AR(k·b_j·r·w) ¹ |
| "dion", compressed, a split | P (k, a_i, r), R (k, b_j, r) averaged in `wire_dtype` | AR(k·a_i·r·w) + AR(k·b_j·r·w) |
| "dion", fallback / "muon" | gradient mean in the compute dtype (≥ fp32) | AR(k·m_i·n_j·4) |
| "signmuon" | 1-bit (or int8) vote on k·m_i·n_j signs | vote_bytes(format, k·m_i·n_j, M) |
| "adamw" | gradient mean, one flat buffer per dtype | AR(n·itemsize) |
| "lion" | vote on the n signs, one flat vote per dtype | vote_bytes(format, n, M) |

plus, once per step, the non-finite check: AR(4); and at step 1 and every N =
`double_averaging_check_every` steps after, the double-averaging check: AR(24) (3 int64), and AR(2)
on each other agreement axis (a shard axis of F ranks: 2·2·(F−1)/F). AR(x) = 2·x·(M−1)/M. `group_bytes` applies
these to a param group's buckets as the optimizer forms them (buckets.capped_buckets, under
`bucket_bytes`), so a measured `comm_stats()` equals them exactly (every param with a gradient).
A bucket holds matrices (shardopt/matrices.py): a 3-D expert stack counts its local experts, a
`split` param its blocks, each with its own layout (m_i, n, r, a, b_i are the matrix's).
¹ The k_s = k − k mod (F·M) matrices whose orthonormalization is split over the ranks send P as
a reduce-scatter plus an all-gather of whole matrices, AR(k_s/F·a·r·w): the same bytes when F
divides a (no padding), fewer otherwise.
"""

from __future__ import annotations

import torch

from .comm import collective_bytes
from .dion import compressed, oriented_axes, oriented_block, oriented_shape, rank_of, work_split
from .hyperparams import MATRIX_ALGORITHMS
from .signmuon import work_split as signmuon_work_split
from .buckets import DEFAULT_BUCKET_BYTES, capped_buckets
from .placement import MatrixLayout, local
from .signs import padded_length
from .vote import resolve_vote, vote_bytes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def matrix_bucket_bytes(group: dict, layout: MatrixLayout, count: int, dtype: torch.dtype, replicas: int) -> int:
    """Replicate-axis bytes of one bucket of `count` same-layout matrices of `group`."""
    local_entries = count * layout.rows * layout.cols
    compute_itemsize = _itemsize(torch.promote_types(dtype, torch.float32))
    algorithm = group["algorithm"]
    if algorithm == "signmuon":
        return vote_bytes(resolve_vote(group["vote"], local_entries, replicas), local_entries, replicas)
    if algorithm == "dion" and compressed(layout, group):
        a, _ = oriented_shape(layout)
        r = rank_of(layout, group)
        (_, a_local), (_, b_local) = oriented_block(layout)
        wire = _itemsize(getattr(torch, group["wire_dtype"]))
        a_axes, b_axes = oriented_axes(layout)
        if a_axes:
            return (collective_bytes("all_reduce", count * a_local * r * wire, replicas)
                    + collective_bytes("all_reduce", count * b_local * r * wire, replicas))
        shard_size = len(layout.axis_parts(b_axes[-1])) if b_axes else 1
        a_piece = padded_length(a, shard_size) // shard_size
        split = count - count % (shard_size * replicas)   # matrices whose orthonormalization is split:
        return (collective_bytes("all_reduce", split // shard_size * a * r * wire, replicas)   # RS + AG
                + collective_bytes("all_reduce", (count - split) * a_piece * r * wire, replicas)
                + collective_bytes("all_reduce", count * b_local * r * wire, replicas))
    return collective_bytes("all_reduce", local_entries * compute_itemsize, replicas)   # dion fallback, muon


def elementwise_group_bytes(group: dict, numel_by_dtype: dict, replicas: int) -> int:
    """Replicate-axis bytes of an "adamw" or "lion" group holding numel_by_dtype[dtype] entries."""
    total = 0
    for dtype, numel in numel_by_dtype.items():
        if group["algorithm"] == "lion":
            total += vote_bytes(resolve_vote(group["vote"], numel, replicas), numel, replicas)
        else:
            total += collective_bytes("all_reduce", numel * _itemsize(dtype), replicas)
    return total


def nonfinite_check_bytes(replicas: int) -> int:
    """The step's agreed NaN/inf flag: one all-reduce of one float32."""
    return collective_bytes("all_reduce", 4, replicas)


DOUBLE_AVERAGING_CHECK_EVERY = 1000   # the optimizers' default double_averaging_check_every


def double_averaging_checked(step: int, every: int) -> bool:
    """Whether step `step` (1, 2, …) runs the double-averaging check: steps 1, 1+every, 1+2·every, …
    (never with every = 0)."""
    return every > 0 and (step - 1) % every == 0


def double_averaging_checks(steps: int, every: int = DOUBLE_AVERAGING_CHECK_EVERY) -> int:
    """How many of the steps 1 … `steps` run the double-averaging check."""
    return -(-steps // every) if every > 0 else 0


def double_averaging_check_bytes(replicas: int, axis_size: int | None = None) -> int:
    """One double-averaging check, on the replicate axis (`axis_size` None): one all-reduce of
    (h, −h, nonzero) as 3 int64; on another agreement axis of `axis_size` ranks: the verdict, one
    all-reduce of 2 bytes. Nothing with one replica (no check)."""
    if replicas <= 1:
        return 0
    if axis_size is None:
        return collective_bytes("all_reduce", 24, replicas)
    return collective_bytes("all_reduce", 2, axis_size)


def allreduce_bytes(numel: int, dtype: torch.dtype, replicas: int) -> int:
    """A plain ring all-reduce of `numel` gradients in `dtype` (what DDP sends per step)."""
    return collective_bytes("all_reduce", numel * _itemsize(dtype), replicas)


def group_bytes(group: dict, replicas: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Replicate-axis bytes one rank sends per step for a param group (with every key of DEFAULTS)."""
    params = group["params"]
    if group["algorithm"] in MATRIX_ALGORITHMS:
        split = work_split if group["algorithm"] == "dion" else signmuon_work_split
        return sum(matrix_bucket_bytes(group, layout, len(bucket), dtype, replicas)
                   for layout, dtype, bucket in capped_buckets(params, group, bucket_bytes,
                                                               lambda layout: split(layout, group, replicas)))
    numel: dict = {}
    for param in params:
        numel[param.dtype] = numel.get(param.dtype, 0) + local(param).numel()
    return elementwise_group_bytes(group, numel, replicas)


EXCHANGE = {"dion": lambda g: f"rank_fraction {g['rank_fraction']:g}, {g['wire_dtype']} factors",
            "signmuon": lambda g: f"1-bit vote ({g['vote']})", "lion": lambda g: f"1-bit vote ({g['vote']})",
            "adamw": lambda g: "full-precision gradient mean", "muon": lambda g: "full-precision gradient mean"}


def describe(groups: list[dict], replicas: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES, clipping: bool = False,
             double_averaging_check_every: int = DOUBLE_AVERAGING_CHECK_EVERY) -> str:
    """One line per group (algorithm, tensors, elements, replicate-axis bytes per step on this rank),
    then the whole model (the non-finite check and, with `clipping`, the agreed clip norm — one float
    all-reduced each — included) against a float32 all-reduce of every parameter, then (with more than
    one replica and the check on) the double-averaging check's bytes at the steps it runs."""
    lines, numel_total = [], 0
    total = nonfinite_check_bytes(replicas) * (2 if clipping else 1)
    for group in groups:
        sent = group_bytes(group, replicas, bucket_bytes)
        numel = sum(local(p).numel() for p in group["params"])
        total, numel_total = total + sent, numel_total + numel
        lines.append(f"shardopt: {group['algorithm']:>8}: {len(group['params'])} tensors, {numel:,} elements, "
                     f"{sent:,} B/step ({EXCHANGE[group['algorithm']](group)})")
    baseline = allreduce_bytes(numel_total, torch.float32, replicas)
    ratio = f"1/{baseline / total:.1f} of" if total else "vs"
    lines.append(f"shardopt: whole model, {replicas} replicas: {total:,} B/step on the replicate axis per rank, "
                 f"{ratio} a float32 all-reduce of every parameter ({baseline:,} B)")
    check = double_averaging_check_bytes(replicas)
    if check and double_averaging_check_every:
        lines.append(f"shardopt: double-averaging check: +{check:,} B on the replicate axis at step 1 and every "
                     f"{double_averaging_check_every:,} steps after (double_averaging_check_every)")
    return "\n".join(lines)
