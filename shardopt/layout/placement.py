"""Where each matrix lives: the one place that knows about DTensor placements.

The math modules see plain local tensors. This module maps a parameter to
its local tensor and a `MatrixLayout` (global shape, which rows and columns
this rank holds), derives the mesh axes from the parameters' placements, and
rejects the placements shardopt does not handle — so that transposition,
uneven and empty shards are decided here and nowhere else.

A matrix X (m×n) may be split over two axes besides the replicate axis:
the shard axis (FSDP2, rows) and the tensor axis (tensor parallelism). Supported
parameters: plain tensors (whole on every rank), and DTensors whose mesh dims
each play one role —

| role | mesh dim | placement |
|---|---|---|
| replicate | any name but "tensor"/"tp" (2-D or 3-D mesh) | Replicate() |
| shard | any name but "tensor"/"tp" | Shard(0) (FSDP2 `fully_shard`); `_StridedShard(0, split_factor=T)` when FSDP2 shards a module that tensor parallelism split by rows first |
| tensor | named "tensor" or "tp", or any dim placed Shard(1) | Shard(1) (RowwiseParallel), Shard(0) (ColwiseParallel), Replicate() (whole over the tensor ranks) |

so FSDP2 (`Shard(0)`), HSDP (`(Replicate(), Shard(0))`), tensor parallelism alone
(`Shard(1)` or `Shard(0)` on a "tensor" mesh), 2-D FSDP × TP (`(Shard(0), Shard(1))` or
`(_StridedShard(0, sf=T), Shard(0))` on a ("shard", "tensor") mesh) and 3-D with a
replicate dim in front. Every split is torch.chunk's: ceil(m/parts) rows per rank, the
last ranks short or empty; under `_StridedShard` the tensor axis splits the rows first and
the shard axis splits each tensor rank's block (FSDP2 shards the local TP tensor).

A plain tensor can also be one rank's row block of a matrix split over the shard axis without being a
DTensor (`RowBlock`, `mark_row_block`: DeepSpeed ZeRO stage 3, where the node's ranks are the shard axis,
shardopt/deepspeed/zero3.py): its layout is that of the same block of a `Shard(0)` DTensor, its state stays plain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..internals import strided_shard_type

TENSOR_DIM_NAMES = ("tensor", "tp")


@dataclass(frozen=True)
class MatrixLayout:
    """A 2-D parameter X (m×n) and the block of it this rank holds.

    Rows: when the tensor axis splits them (`tensor_rows`, rows per tensor rank; ColwiseParallel)
    tensor rank t holds block t; the shard axis splits that block (or all m rows) into
    `shard_rows` (rows per shard rank; (m,) or (block,) when the shard axis does not split rows),
    shard rank i holding part i. Columns: `tensor_cols`, columns per tensor rank, when the tensor
    axis splits them (RowwiseParallel `Shard(1)`), else all n.
    sharded: the shard axis splits the rows (a `Shard(0)` DTensor), even on a shard mesh of size 1,
    so the state layout is the same at every shard count (checkpoints reshard). Likewise a
    non-empty tensor_rows / tensor_cols on a tensor mesh of size 1.
    shard_index, tensor_index: this rank's position on the shard and tensor axes.
    """

    shape: tuple[int, int]
    shard_rows: tuple[int, ...]
    shard_index: int = 0
    sharded: bool = False
    tensor_rows: tuple[int, ...] = ()
    tensor_cols: tuple[int, ...] = ()
    tensor_index: int = 0

    @property
    def rows(self) -> int:
        return self.shard_rows[self.shard_index]

    @property
    def row_start(self) -> int:
        return sum(self.tensor_rows[:self.tensor_index]) + sum(self.shard_rows[:self.shard_index])

    @property
    def cols(self) -> int:
        return self.tensor_cols[self.tensor_index] if self.tensor_cols else self.shape[1]

    @property
    def col_start(self) -> int:
        return sum(self.tensor_cols[:self.tensor_index])

    @property
    def largest_block(self) -> tuple[int, int]:
        """(rows, cols) of the largest local block any rank holds — the same on every rank. shard_rows
        lists every shard rank's rows of this tensor rank's row block; under a tensor row split the
        blocks are torch.chunk's, whose first part, ceil(block/F), grows with the block."""
        if self.tensor_rows:
            block = max(self.tensor_rows)
            rows = -(-block // len(self.shard_rows)) if self.sharded else block
        else:
            rows = max(self.shard_rows)
        return rows, max(self.tensor_cols) if self.tensor_cols else self.shape[1]

    @property
    def row_axes(self) -> tuple[str, ...]:
        """The axes that split the rows, outer first: (), ("shard",), ("tensor",) or ("tensor", "shard")."""
        return ("tensor",) * bool(self.tensor_rows) + ("shard",) * self.sharded

    @property
    def col_axes(self) -> tuple[str, ...]:
        """The axes that split the columns: () or ("tensor",)."""
        return ("tensor",) * bool(self.tensor_cols)

    @property
    def distributed(self) -> bool:
        """X is split over some axis (its state tensors are DTensors placed like X)."""
        return bool(self.row_axes or self.col_axes)

    def axis_parts(self, axis: str) -> tuple[int, ...]:
        """Rows or columns per rank of `axis` ("shard" or "tensor") in the dim it splits; (whole,) if none."""
        if axis == "shard":
            return self.shard_rows
        return self.tensor_rows or self.tensor_cols or (self.shape[0],)

    @property
    def transpose(self) -> bool:
        """Dion works on B = Mᵀ when an axis splits the rows, or when m < n with nothing split,
        so that B is a×b with the row splits (if any) on b, and a ≥ b unsharded. With columns
        split alone (tensor parallelism `Shard(1)`) B = M: the tensor axis splits b."""
        m, n = self.shape
        return bool(self.row_axes) or (not self.col_axes and m < n)


@dataclass(frozen=True)
class RowBlock:
    """A plain tensor that is shard rank `index`'s rows (dim-0 entries) of a tensor of `shape` (an m×n matrix, or a
    1-D or N-D element-wise param) whose dim 0 the shard axis splits as torch.chunk does (`shard_rows`, rows per
    shard rank): laid out like that rank's block of a `Shard(0)` DTensor (matrix_layout), without a DTensor."""

    shape: tuple[int, ...]
    shard_rows: tuple[int, ...]
    index: int

    @property
    def rows(self) -> slice:
        """This block's rows of the whole matrix."""
        start = sum(self.shard_rows[:self.index])
        return slice(start, start + self.shard_rows[self.index])


def mark_row_block(tensor: torch.Tensor, shape: tuple[int, ...], parts: int, index: int) -> torch.Tensor:
    """Mark `tensor` (rows × shape[1:]) as shard rank `index`'s row block of a tensor of `shape` split over `parts`
    ranks along dim 0 (chunk_rows); returns it."""
    block = RowBlock(tuple(shape), chunk_rows(shape[0], parts), index)
    if tuple(tensor.shape) != (block.shard_rows[index], *shape[1:]):
        raise ValueError(f"a row block of rank {index} of {parts} of a {tuple(shape)} tensor has shape "
                         f"{(block.shard_rows[index], *shape[1:])}, got {tuple(tensor.shape)}")
    tensor.shardopt_row_block = block
    return tensor


def row_block(tensor) -> RowBlock | None:
    """The RowBlock a plain tensor was marked with (mark_row_block), else None."""
    return getattr(tensor, "shardopt_row_block", None)


def chunk_rows(m: int, parts: int) -> tuple[int, ...]:
    """Rows per part when m rows are split like torch.chunk: ceil(m/parts) each, the rest short or empty."""
    size = -(-m // parts)
    return tuple(max(0, min(size, m - i * size)) for i in range(parts))


def is_dtensor(tensor) -> bool:
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "placements")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (the local shard of a DTensor, else the tensor itself)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


@dataclass(frozen=True)
class _Roles:
    """Mesh dim (or None) of each axis a DTensor uses, and which axes split its rows / columns."""
    replicate: int | None = None
    shard: int | None = None
    tensor: int | None = None
    row_axes: tuple[str, ...] = ()
    col_axes: tuple[str, ...] = ()


def _roles(param, label: str) -> _Roles:
    """The role of each mesh dim of a DTensor (module docstring), or a ValueError for placements
    shardopt cannot handle."""
    _StridedShard = strided_shard_type()
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ()
    if mesh.ndim > 1 and not names:
        raise ValueError(f"param {label} is on a {mesh.ndim}-D mesh without dim names; create it with "
                         f"init_device_mesh(..., mesh_dim_names=('replicate', 'shard'[, 'tensor']))")
    roles = {"replicate": None, "shard": None, "tensor": None}
    rows, cols, strided = [], [], None
    for mesh_dim, placement in enumerate(param.placements):
        tensor_dim = names[mesh_dim] in TENSOR_DIM_NAMES if names else False
        if type(placement) is Shard and placement.dim == 1:
            tensor_dim = True
        if type(placement) is Replicate:
            if tensor_dim or mesh.ndim == 1:
                continue    # whole over this dim's ranks
            role = "replicate"
        elif type(placement) in (Shard, _StridedShard) and placement.dim in (0, 1):
            if type(placement) is _StridedShard:
                strided = (mesh_dim, placement)
            role = "tensor" if tensor_dim else "shard"
            (rows if placement.dim == 0 else cols).append(role)
        else:
            raise ValueError(f"param {label} has placement {placement!r} ({type(placement).__name__}); shardopt "
                             f"supports Replicate(), Shard(0), Shard(1) and FSDP2's _StridedShard(0) over a "
                             f"tensor-parallel module (no Partial)")
        if roles[role] is not None:
            what = {"replicate": "is replicated over two mesh dims", "shard": "has two sharded mesh dims on tensor "
                    f"dim {placement.dim}", "tensor": "has two tensor-parallel mesh dims"}[role]
            raise ValueError(f"param {label} {what} {param.placements} (mesh dims {names or 'unnamed'}); shardopt "
                             f"takes one replicate, one shard and one tensor mesh dim: flatten them into one "
                             f"(and name the tensor-parallel dim 'tensor')")
        roles[role] = mesh_dim
    if rows == ["shard", "tensor"] and strided is None:
        raise ValueError(f"param {label} is placed {param.placements}: the shard dim splits the rows before the "
                         f"tensor dim, which shardopt does not support; for FSDP2 over tensor parallelism apply "
                         f"parallelize_module first, then fully_shard (which places the shard dim _StridedShard)")
    if strided is not None:
        mesh_dim, placement = strided
        tensor_size = mesh.size(roles["tensor"]) if roles["tensor"] is not None else None
        if rows != ["shard", "tensor"] or placement.split_factor != tensor_size:
            raise ValueError(f"param {label} is placed {param.placements} on mesh dims {names}: shardopt supports "
                             f"_StridedShard(0, split_factor=T) only on the shard dim of FSDP2 over a module whose "
                             f"rows the tensor dim ('tensor', size T) splits (ColwiseParallel then fully_shard)")
        rows = ["tensor", "shard"]   # the tensor axis splits the rows first, FSDP2 each tensor rank's block
    return _Roles(roles["replicate"], roles["shard"], roles["tensor"], tuple(rows), tuple(cols))


def _axis_mesh(mesh, mesh_dim: int):
    return mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[mesh_dim]]


def derive_meshes(params_with_labels, replicate_mesh, shard_mesh, tensor_mesh=None):
    """Check every parameter against the given meshes and fill in the ones the DTensors imply.

    Returns (replicate_mesh, shard_mesh, tensor_mesh). Raises ValueError for plain tensors mixed
    with DTensors, DTensors on a mesh the optimizer was not given, shard_mesh / tensor_mesh
    without DTensors, and unsupported placements.
    """
    dtensors = [(p, label) for p, label in params_with_labels if is_dtensor(p)]
    plain = [label for p, label in params_with_labels if not is_dtensor(p)]
    if not dtensors:
        for name, mesh in (("shard", shard_mesh), ("tensor", tensor_mesh)):
            if mesh is not None:
                raise ValueError(f"{name}_mesh was given but no parameter is a DTensor; shard the model with FSDP2 "
                                 f"fully_shard(model, mesh=shard_mesh) / parallelize_module(model, tensor_mesh, …) "
                                 f"first, or pass {name}_mesh=None")
        return replicate_mesh, shard_mesh, tensor_mesh
    if plain:
        raise ValueError(f"params mix plain tensors (e.g. {plain[0]}) with DTensors (e.g. {dtensors[0][1]}); "
                         f"shard the whole model with fully_shard, or keep all params plain")
    given = {"replicate": replicate_mesh, "shard": shard_mesh, "tensor": tensor_mesh}
    for param, label in dtensors:
        roles = _roles(param, label)
        for role in ("shard", "tensor", "replicate"):
            mesh_dim = getattr(roles, role)
            if mesh_dim is None:
                continue
            param_mesh = _axis_mesh(param.device_mesh, mesh_dim)
            if given[role] is None:
                given[role] = param_mesh
            elif (role != "replicate" or hasattr(given[role], "mesh")) and not _same_mesh(given[role], param_mesh):
                verb = "replicated" if role == "replicate" else "sharded" if role == "shard" else "tensor-parallel"
                raise ValueError(f"param {label} is {verb} on mesh {param_mesh} but the optimizer was given "
                                 f"{role}_mesh={given[role]}; pass the mesh the model was "
                                 f"{'sharded' if role != 'tensor' else 'parallelized'} on")
    return given["replicate"], given["shard"], given["tensor"]


def _same_mesh(a, b) -> bool:
    return hasattr(a, "mesh") and hasattr(b, "mesh") and a.mesh.shape == b.mesh.shape \
        and bool((a.mesh == b.mesh).all())


def matrix_layout(param: torch.Tensor) -> MatrixLayout:
    """Layout of a 2-D parameter: whole on this rank, split over its shard and tensor mesh dims, or a RowBlock."""
    block = row_block(param)
    if block is not None:
        return MatrixLayout(shape=block.shape, shard_rows=block.shard_rows, shard_index=block.index, sharded=True)
    m, n = param.shape
    if not is_dtensor(param):
        return MatrixLayout(shape=(m, n), shard_rows=(m,))
    roles = _roles(param, "")
    mesh = param.device_mesh
    tensor_parts = mesh.size(roles.tensor) if roles.tensor is not None else 1
    tensor_index = mesh.get_local_rank(roles.tensor) if roles.tensor is not None else 0
    tensor_rows = chunk_rows(m, tensor_parts) if "tensor" in roles.row_axes else ()
    tensor_cols = chunk_rows(n, tensor_parts) if "tensor" in roles.col_axes else ()
    block = tensor_rows[tensor_index] if tensor_rows else m
    sharded = "shard" in roles.row_axes
    shard_index = 0
    shard_rows = (block,)
    if sharded:
        shard_rows = chunk_rows(block, mesh.size(roles.shard))
        shard_index = mesh.get_local_rank(roles.shard)
    layout = MatrixLayout(shape=(m, n), shard_rows=shard_rows, shard_index=shard_index, sharded=sharded,
                          tensor_rows=tensor_rows, tensor_cols=tensor_cols, tensor_index=tensor_index)
    assert tuple(param.to_local().shape) == (layout.rows, layout.cols), (param.to_local().shape, layout)
    return layout


def tensor_split(param) -> bool:
    """The tensor axis splits `param` (any rank: a DTensor with a Shard / _StridedShard on its tensor dim)."""
    if not is_dtensor(param):
        return False
    roles = _roles(param, "")
    return "tensor" in roles.row_axes + roles.col_axes


def dim0_shards(param: torch.Tensor, label: str = "") -> tuple[tuple[int, ...], int] | None:
    """(dim-0 sizes held by each shard rank, this rank's shard index) of a DTensor whose dim 0 the
    shard axis alone splits (`Shard(0)`, any number of dims: a 2-D param's rows, a 3-D stack's
    experts), or None for a tensor held whole on this rank. A tensor-parallel split is not
    expressible here: ValueError naming the param (3-D stacks and `split` params take FSDP2 / expert
    parallelism only)."""
    block = row_block(param)
    if block is not None:
        return block.shard_rows, block.index
    if not is_dtensor(param):
        return None
    roles = _roles(param, label)
    if "tensor" in roles.row_axes + roles.col_axes:
        raise ValueError(f"param {label} with shape {tuple(param.shape)} is placed {param.placements}: tensor "
                         f"parallelism is supported on 2-D weights without a `split` only; shard 3-D expert "
                         f"stacks with Shard(0) (FSDP2 or expert parallelism), and keep split params off the "
                         f"tensor mesh (or drop their `split`)")
    if "shard" not in roles.row_axes:
        return None
    mesh = param.device_mesh
    return chunk_rows(param.shape[0], mesh.size(roles.shard)), mesh.get_local_rank(roles.shard)


def placed_like(param: torch.Tensor, local_tensor: torch.Tensor) -> torch.Tensor:
    """`local_tensor` (shaped like the param's local tensor) as a DTensor placed exactly like the param
    (same mesh, placements, global shape and stride); plain params get the plain tensor."""
    if not is_dtensor(param):
        return local_tensor
    return DTensor.from_local(local_tensor, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def like_param(param: torch.Tensor, local_tensor: torch.Tensor, global_rows: int, param_dim: int = 0) -> torch.Tensor:
    """Wrap a local state tensor whose rows follow the param's dim `param_dim` (its rows, or for
    Dion's Q of an untransposed matrix its columns) as a DTensor placed like the param in that dim
    and replicated over the mesh dims that split the param's other dim (so DCP can reshard it);
    plain params get the plain tensor."""
    if not is_dtensor(param):
        return local_tensor
    placements = [placement if getattr(placement, "dim", None) is None else    # Replicate()
                  Replicate() if placement.dim != param_dim else placement if param_dim == 0 else Shard(0)
                  for placement in param.placements]
    shape = (global_rows, *local_tensor.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local_tensor, param.device_mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)


def assign_owners(sizes: list[int], parts: int) -> list[int]:
    """Owner (0..parts−1) of each whole tensor of `sizes` elements, balancing the elements per owner:
    largest first onto the least-loaded owner (ties: lower index), so every rank computes the same
    assignment. The largest load is at most the mean plus the largest tensor."""
    owners = [0] * len(sizes)
    load = [0] * parts
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(parts), key=lambda k: (load[k], k))
        owners[index] = owner
        load[owner] += sizes[index]
    return owners
