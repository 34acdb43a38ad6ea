"""Where each matrix lives: the one place that knows about DTensor placements.

The math modules see plain local tensors. This module maps a parameter to
its local tensor and a `MatrixLayout` (global shape, which rows this rank
holds on the shard axis), so that padding, transposition and empty shards
are decided here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MatrixLayout:
    """A 2-D parameter X (m×n) of which this rank holds rows [row_start, row_start + rows).

    sharded: rows are split over the shard axis (FSDP2 `Shard(0)`); otherwise
    the rank holds the whole matrix.
    """

    shape: tuple[int, int]
    row_start: int
    rows: int
    sharded: bool

    @property
    def transpose(self) -> bool:
        """Dion works on B = Mᵀ when the shard axis splits rows, or when m < n unsharded,
        so that B is a×b with the shard axis (if any) splitting b, and a ≥ b unsharded."""
        m, n = self.shape
        return self.sharded or m < n


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (the local shard of a DTensor, else the tensor itself)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def matrix_layout(param: torch.Tensor) -> MatrixLayout:
    """Layout of a 2-D parameter held whole on this rank."""
    m, n = param.shape
    return MatrixLayout(shape=(m, n), row_start=0, rows=m, sharded=False)
