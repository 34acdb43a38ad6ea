"""Buckets: which matrices of a param group are stepped together, and their stacked working copy.

A bucket is a run of matrices of one param group with the same layout, dtype and
device, in parameter order (a 2-D param is one matrix; a 3-D expert stack and a
`split` param are several, shardopt/layout/matrices.py). Its working copy — k stacked local matrices in the
compute dtype (fp32, or fp64 for fp64 params) — is at most `bucket_bytes`, so the
transient memory of a step is O(bucket_bytes · pipeline depth), not O(model). Two
exceptions keep the math and the work split intact:

- a single matrix larger than the cap is a bucket of its own;
- when the ranks split a bucket's orthonormalization (`split` > 1 matrices share
  one collective, one per rank), a bucket holds a multiple of `split` matrices,
  at least `split` when the group has that many (the cap is then exceeded by at
  most split − 1 matrices' copies).
"""

from __future__ import annotations

import torch

from .matrices import param_matrices

DEFAULT_BUCKET_BYTES = 16 * 2**20   # 16 MiB of fp32 working copy: four 1024×1024 matrices


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a bucket is computed in: fp32, or fp64 for fp64 tensors."""
    return torch.promote_types(dtype, torch.float32)


def chunk_sizes(count: int, matrix_bytes: int, bucket_bytes: int, split: int = 1) -> list[int]:
    """Sizes of the consecutive buckets that `count` same-layout matrices of `matrix_bytes` each
    (working copy) fall into under the cap `bucket_bytes`, each a multiple of `split` but the last
    when count ≥ split (see the module docstring)."""
    per_bucket = max(1, bucket_bytes // max(1, matrix_bytes))
    if count >= split > 1:
        per_bucket = max(split, per_bucket // split * split)
    return [min(per_bucket, count - start) for start in range(0, count, per_bucket)]


def matrix_buckets(params, group: dict) -> dict:
    """(layout, dtype, device) → the (param, ParamMatrix) pairs of the matrices that share them (one
    bucket: one stacked step, one collective per exchange), in parameter order; a param's matrices
    come from matrices.param_matrices (a 3-D param's experts, the blocks of a `split`)."""
    buckets: dict = {}
    for param in params:
        for matrix in param_matrices(param, group):
            buckets.setdefault((matrix.layout, param.dtype, param.device), []).append((param, matrix))
    return buckets


def capped_buckets(params, group: dict, bucket_bytes: int, split_of):
    """(layout, dtype, bucket) for the matrices of `params`: those sharing (layout, dtype, device)
    (`matrix_buckets`), in parameter order, cut by `chunk_sizes` under `bucket_bytes`;
    split_of(layout) is how many ranks split a bucket's work. A matrix counts with the largest block
    any rank holds (`MatrixLayout.largest_block`), the same on every shard and tensor rank, so all of
    them cut alike. The optimizer steps these buckets and traffic.py counts their bytes."""
    for (layout, dtype, _), members in matrix_buckets(params, group).items():
        rows, cols = layout.largest_block
        matrix_bytes = rows * cols * compute_dtype(dtype).itemsize
        start = 0
        for size in chunk_sizes(len(members), matrix_bytes, bucket_bytes, split_of(layout)):
            yield layout, dtype, members[start:start + size]
            start += size


def stack_as(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """torch.stack(tensors).to(dtype) without the intermediate stack in the source dtype:
    one (k, …) allocation in `dtype`, filled matrix by matrix."""
    out = torch.empty((len(tensors), *tensors[0].shape), dtype=dtype, device=tensors[0].device)
    for row, tensor in zip(out, tensors):
        row.copy_(tensor)
    return out
