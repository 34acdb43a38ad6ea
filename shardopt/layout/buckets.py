"""Buckets: which matrices of a param group are stepped together, and their stacked working copy;
which entries of an element-wise group are (`flat_buckets`).

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

DEFAULT_BUCKET_BYTES = 16 * 2**20   # 16 MiB of fp32 working copy: four 1024×1024 matrices (CPU, and the rest)
# A GPU runs a bucket's stacked matmuls and its one collective per exchange faster than the host launches them: a
# bucket per large matrix leaves it host-bound. 128 MiB holds 14 of GPT-2 small's 768×3072 fp32 matrices, 8 of
# Llama-3.2-1B's 2048×2048 (2 of its 2048×8192), 2 of Llama-3-8B's 4096×4096; two buckets in flight, a few copies
# each, are ~1 GiB of transients.
BUCKET_BYTES_BY_DEVICE = {"cuda": 128 * 2**20}


def default_bucket_bytes(device_type: str) -> int:
    """The default cap `bucket_bytes` for params on a device of `device_type` ("cuda", "cpu", …): 128 MiB on
    CUDA (ROCm too: its device type is "cuda"), 16 MiB elsewhere (see BUCKET_BYTES_BY_DEVICE)."""
    return BUCKET_BYTES_BY_DEVICE.get(device_type, DEFAULT_BUCKET_BYTES)


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


def flat_buckets(sizes: list[int], whole: list[bool], cap: int) -> list[list[tuple[int, int, int]]]:
    """An element-wise group's buckets: its tensors of `sizes` entries, taken in order as one run of
    entries, cut into consecutive buckets of at most `cap` entries (cap ≥ 1), each a list of (tensor index,
    start, stop), a run of that tensor's flat entries. A tensor with whole[i] True is never cut: it ends
    the bucket before it when it does not fit, and one larger than the cap is a bucket of its own. So an
    element-wise step's transient memory is O(cap) (plus the largest whole tensor), not O(group)."""
    buckets, current, filled = [], [], 0
    for index, size in enumerate(sizes):
        if whole[index] and current and filled + size > cap:
            buckets.append(current)
            current, filled = [], 0
        start = 0
        while True:
            stop = size if whole[index] else min(size, start + cap - filled)
            current.append((index, start, stop))
            filled += stop - start
            start = stop
            if filled >= cap:
                buckets.append(current)
                current, filled = [], 0
            if start >= size:
                break
    return buckets + [current] if current else buckets


def flat_piece(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Entries start … stop−1 of `tensor` in row-major order, a view (the tensor itself when whole; a run
    of a contiguous tensor's flat entries otherwise)."""
    return tensor if (start, stop) == (0, tensor.numel()) else tensor.view(-1)[start:stop]


def stack_as(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """torch.stack(tensors).to(dtype) without the intermediate stack in the source dtype:
    one (k, …) allocation in `dtype`, filled matrix by matrix."""
    out = torch.empty((len(tensors), *tensors[0].shape), dtype=dtype, device=tensors[0].device)
    for row, tensor in zip(out, tensors):
        row.copy_(tensor)
    return out
