"""A parameter's matrices: the 2-D views of it that the matrix algorithms step, with their layouts.

A param of a "dion", "signmuon" or "muon" group is one of

- a 2-D weight X (m×n): one matrix, whole or row-sharded (FSDP2 `Shard(0)`);
- a 3-D stack (E, m, n), e.g. the experts of an MoE layer: E matrices m×n, each stepped like a
  2-D weight of its own. Placed `Shard(0)` (FSDP2 `fully_shard`, or expert parallelism), a rank
  holds whole experts (torch.chunk of E: the last ranks short or empty), so its matrices are whole
  and need no shard-axis collective;
- either of these with the group option `split=(dim, sizes)`: each matrix is cut along `dim` (a
  matrix dim of the param: its rows or its columns) into consecutive blocks of `sizes` (summing to
  that dim), and each block is a matrix of its own (a fused QKV projection (d + 2·d_kv)×n with
  split=(0, (d, d_kv, d_kv)); a fused gate/up projection). Under row sharding of a 2-D param a row
  block's local rows are the intersection of its rows with this rank's rows (uneven or empty:
  `MatrixLayout.shard_rows`); a column split of a row-sharded param is refused.

Each matrix j of a param is stepped exactly as a separate 2-D param of its shape and layout
would be (same orientation, rank, scale), batched with the same-layout matrices of its group.

b-side state (Dion's Q, b_j×r_j for matrix j, see dion.py) is one tensor per param,
(*E, Σ_j b_j, max_j r_j): the blocks' Q concatenated along b, their columns zero-padded to the
largest rank, one such slab per expert. For a row-sharded 2-D param every block works on B = Xᵀ,
so b_j is the block's rows and Σ_j b_j = m: the state's rows are the param's rows and are sharded
like them; a 3-D param's state is sharded like it along E. So the state is a DTensor placed like
the param whenever the param is sharded, and DCP can reshard it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .placement import MatrixLayout, dim0_shards, matrix_layout

GOLDEN = 0x9E3779B97F4A7C15   # 2⁶⁴/φ: spreads the seeds of a param's matrices


@dataclass(frozen=True)
class ParamMatrix:
    """Matrix `index` of a param (global position: expert·blocks + block) as this rank holds it.

    layout: the matrix's global shape and row sharding. expert: its position along dim 0 of the
    local 3-D tensor (None for a 2-D param). rows, cols: its local rows and columns within that
    (m_local×n) slab. state_rows: its rows of the param's b-side state (module docstring)."""

    layout: MatrixLayout
    index: int
    expert: int | None
    rows: slice
    cols: slice
    state_rows: slice

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The matrix's 2-D view of a local tensor shaped like the param (the param, its gradient,
        its momentum): writes go through."""
        slab = tensor if self.expert is None else tensor[self.expert]
        return slab[self.rows, self.cols]

    def of_state(self, tensor: torch.Tensor) -> torch.Tensor:
        """The matrix's rows (b_j local, all max_j r_j columns) of the param's local b-side state."""
        slab = tensor if self.expert is None else tensor[self.expert]
        return slab[self.state_rows]


def matrix_seed(param_seed: int, index: int) -> int:
    """The seed of matrix `index` of a param: (param_seed + index·0x9E3779B97F4A7C15) mod 2⁶³, so
    matrix 0 (a 2-D param's only one) has the param's seed and the others distinct ones."""
    return (param_seed + index * GOLDEN) % 2**63


def split_sizes(param: torch.Tensor, group: dict, label: str = "") -> tuple[int, tuple[int, ...]]:
    """(dim, sizes) of the group's `split` for `param`: dim −2 (the matrices' rows) or −1 (their
    columns), and the block sizes along it; (−2, (m,)) without a split. Raises ValueError, naming
    the param, when the param is not a (stack of) matrix or the split does not fit it."""
    where = f"param {label} with shape {tuple(param.shape)} in a {group['algorithm']!r} group"
    if param.ndim not in (2, 3):
        raise ValueError(f"{where} is not 2-D (a matrix) or 3-D (a stack of matrices, e.g. MoE experts); put it "
                         f"in an 'adamw' or 'lion' group (shardopt.param_groups(model) does this)")
    spec = group.get("split")
    if spec is None:
        return -2, (param.shape[-2],)
    dim, sizes = spec[0], tuple(spec[1])
    matrix_dims = (param.ndim - 2, param.ndim - 1)
    if dim not in matrix_dims and dim not in (-2, -1):
        raise ValueError(f"Invalid split {spec!r} for {where}: dim must be one of its matrix dims "
                         f"{matrix_dims} (or -2, -1)" + ("; dim 0 of a 3-D stack indexes whole matrices already"
                                                         if param.ndim == 3 else ""))
    given, dim = dim, (dim - param.ndim if dim >= 0 else dim)
    if sum(sizes) != param.shape[dim]:
        raise ValueError(f"Invalid split {spec!r} for {where}: the sizes sum to {sum(sizes)} but dim {given} has "
                         f"{param.shape[dim]} entries; give sizes that sum to {param.shape[dim]} (or put this "
                         f"param in a group without split)")
    if dim == -1 and param.ndim == 2 and dim0_shards(param, label) is not None:
        raise ValueError(f"Invalid split {spec!r} for {where}: a column split of a row-sharded (Shard(0)) param "
                         f"is not supported; split along dim 0, or shard the model so this param stays whole")
    return dim, sizes


def _overlap(start: int, stop: int, lo: int, hi: int) -> tuple[int, int]:
    """[start, stop) ∩ [lo, hi) as offsets from lo: (begin, end), begin = end when empty."""
    begin = min(max(start, lo), hi) - lo
    return begin, max(begin, min(stop, hi) - lo)


def single_matrix(param: torch.Tensor, group: dict) -> bool:
    """`param` is one matrix with the layout placement.py gives it: 2-D, without a `split` into
    several blocks (its b-side state then follows that layout, tensor-parallel splits included)."""
    spec = group.get("split")
    return param.ndim == 2 and (spec is None or len(tuple(spec[1])) == 1)


def matrix_blocks(param: torch.Tensor, group: dict, label: str = "") -> list[ParamMatrix]:
    """The matrices of one (m×n) slab of `param` (the param itself when 2-D, any expert when 3-D),
    in block order, with expert=None and index = block."""
    dim, sizes = split_sizes(param, group, label)
    if single_matrix(param, group):
        return [ParamMatrix(layout=matrix_layout(param), index=0, expert=None, rows=slice(None), cols=slice(None),
                            state_rows=slice(None))]
    m, n = param.shape[-2:]
    shards = dim0_shards(param, label) if param.ndim == 2 else None   # a 3-D param's dim 0 is its experts
    blocks, start, state_start = [], 0, 0
    for block, size in enumerate(sizes):
        shape = (size, n) if dim == -2 else (m, size)
        if shards is None:
            layout = MatrixLayout(shape=shape, shard_rows=(shape[0],))
            rows = slice(start, start + size) if dim == -2 else slice(0, m)
            cols = slice(0, n) if dim == -2 else slice(start, start + size)
            b = shape[0] if layout.transpose else shape[1]
            state_rows = slice(state_start, state_start + b)
            state_start += b
        else:   # row blocks of a row-sharded param: each rank holds the block's rows among its own
            per_rank, index = shards
            bounds = [sum(per_rank[:i]) for i in range(len(per_rank) + 1)]
            overlaps = [_overlap(start, start + size, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
            layout = MatrixLayout(shape=shape, shard_rows=tuple(end - begin for begin, end in overlaps),
                                  shard_index=index, sharded=True)
            rows = state_rows = slice(*overlaps[index])
            cols = slice(0, n)
        blocks.append(ParamMatrix(layout=layout, index=block, expert=None, rows=rows, cols=cols,
                                  state_rows=state_rows))
        start += size
    return blocks


def param_matrices(param: torch.Tensor, group: dict, label: str = "") -> list[ParamMatrix]:
    """Every matrix of `param` this rank holds, in order (a 3-D param's local experts, each cut into
    its blocks). A rank holding none of a `Shard(0)` 3-D param's experts gets an empty list."""
    blocks = matrix_blocks(param, group, label)
    if param.ndim == 2:
        return blocks
    shards = dim0_shards(param, label)
    first, count = (0, param.shape[0]) if shards is None else (sum(shards[0][:shards[1]]), shards[0][shards[1]])
    return [ParamMatrix(layout=block.layout, index=(first + expert) * len(blocks) + block.index, expert=expert,
                        rows=block.rows, cols=block.cols, state_rows=block.state_rows)
            for expert in range(count) for block in blocks]
