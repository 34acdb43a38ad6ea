"""Where each matrix lives: the one place that knows about DTensor placements.

The math modules see plain local tensors. This module maps a parameter to
its local tensor and a `MatrixLayout` (global shape, which rows each shard
rank holds), derives the mesh axes from FSDP2 parameters, and rejects the
placements shardopt does not handle — so that transposition, uneven and
empty shards are decided here and nowhere else.

Supported parameters: plain tensors (whole on every rank), and DTensors
placed `Shard(0)` on a 1-D mesh (FSDP2 `fully_shard(model, mesh=shard_mesh)`)
or `(Replicate(), Shard(0))` on a 2-D (replicate, shard) mesh (FSDP2 HSDP,
with `set_requires_all_reduce(False)` so that shardopt owns the replicate axis).
Rows are split as DTensor splits them: torch.chunk, ceil(m/F) rows per rank,
the last ranks short or empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MatrixLayout:
    """A 2-D parameter X (m×n); shard rank i holds rows [Σ_{j<i} shard_rows[j], … + shard_rows[i]).

    sharded: X is row-sharded (a `Shard(0)` DTensor), even on a shard mesh of size 1, so the
    state layout is the same at every shard count (checkpoints reshard). shard_rows is (m,)
    for a matrix held whole; shard_index is this rank's position on the shard axis.
    """

    shape: tuple[int, int]
    shard_rows: tuple[int, ...]
    shard_index: int = 0
    sharded: bool = False

    @property
    def rows(self) -> int:
        return self.shard_rows[self.shard_index]

    @property
    def row_start(self) -> int:
        return sum(self.shard_rows[:self.shard_index])

    @property
    def transpose(self) -> bool:
        """Dion works on B = Mᵀ when the shard axis splits rows, or when m < n unsharded,
        so that B is a×b with the shard axis (if any) splitting b, and a ≥ b unsharded."""
        m, n = self.shape
        return self.sharded or m < n


def chunk_rows(m: int, parts: int) -> tuple[int, ...]:
    """Rows per part when m rows are split like torch.chunk: ceil(m/parts) each, the rest short or empty."""
    size = -(-m // parts)
    return tuple(max(0, min(size, m - i * size)) for i in range(parts))


def is_dtensor(tensor) -> bool:
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "placements")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (the local shard of a DTensor, else the tensor itself)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _placement_kinds(param, label: str) -> tuple[int | None, int | None]:
    """(replicate mesh dim, shard mesh dim) of a DTensor, or a ValueError for what shardopt cannot handle."""
    from torch.distributed.tensor import Replicate, Shard
    replicate_dim = shard_dim = None
    for mesh_dim, placement in enumerate(param.placements):
        if type(placement) is Replicate:
            if replicate_dim is not None:
                raise ValueError(f"param {label} is replicated over two mesh dims {param.placements}; "
                                 f"shardopt takes at most one replicate and one shard mesh dim")
            replicate_dim = mesh_dim
        elif type(placement) is Shard:
            if placement.dim != 0:
                raise ValueError(f"param {label} is placed {placement} (tensor dim {placement.dim}); shardopt "
                                 f"supports row sharding Shard(0) only (FSDP2's default), not column sharding")
            if shard_dim is not None:
                raise ValueError(f"param {label} has two sharded mesh dims on tensor dim 0 {param.placements}; "
                                 f"flatten them into one shard mesh dim")
            shard_dim = mesh_dim
        else:
            raise ValueError(f"param {label} has placement {placement!r} ({type(placement).__name__}); shardopt "
                             f"supports Shard(0) and Replicate() only (no _StridedShard / Partial: do not "
                             f"combine FSDP2 with tensor parallelism on these params)")
    if param.device_mesh.ndim == 2 and (replicate_dim is None or shard_dim is None):
        raise ValueError(f"param {label} is on a 2-D mesh with placements {param.placements}; expected "
                         f"(Replicate(), Shard(0)) on a (replicate, shard) mesh")
    return replicate_dim, shard_dim


def derive_meshes(params_with_labels, replicate_mesh, shard_mesh):
    """Check every parameter against the given meshes and fill in the ones the DTensors imply.

    Returns (replicate_mesh, shard_mesh). Raises ValueError for plain tensors mixed with
    DTensors, DTensors on a mesh the optimizer was not given, shard_mesh without DTensors,
    and unsupported placements.
    """
    dtensors = [(p, label) for p, label in params_with_labels if is_dtensor(p)]
    plain = [label for p, label in params_with_labels if not is_dtensor(p)]
    if not dtensors:
        if shard_mesh is not None:
            raise ValueError("shard_mesh was given but no parameter is a DTensor; shard the model with FSDP2 "
                             "fully_shard(model, mesh=shard_mesh) first, or pass shard_mesh=None")
        return replicate_mesh, shard_mesh
    if plain:
        raise ValueError(f"params mix plain tensors (e.g. {plain[0]}) with DTensors (e.g. {dtensors[0][1]}); "
                         f"shard the whole model with fully_shard, or keep all params plain")
    for param, label in dtensors:
        replicate_dim, shard_dim = _placement_kinds(param, label)
        mesh = param.device_mesh
        if mesh.ndim == 1 and shard_dim is None:
            continue  # replicated on a 1-D mesh: the whole tensor on every rank
        param_shard_mesh = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[shard_dim]] if mesh.mesh_dim_names \
            else None
        if param_shard_mesh is None:
            raise ValueError(f"param {label} is on a 2-D mesh without dim names; create it with "
                             f"init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))")
        if shard_mesh is None:
            shard_mesh = param_shard_mesh
        elif not _same_mesh(shard_mesh, param_shard_mesh):
            raise ValueError(f"param {label} is sharded on mesh {param_shard_mesh} but the optimizer was given "
                             f"shard_mesh={shard_mesh}; pass the mesh the model was sharded on")
        if mesh.ndim == 2:
            param_replicate_mesh = mesh[mesh.mesh_dim_names[replicate_dim]]
            if replicate_mesh is None:
                replicate_mesh = param_replicate_mesh
            elif hasattr(replicate_mesh, "mesh") and not _same_mesh(replicate_mesh, param_replicate_mesh):
                raise ValueError(f"param {label} is replicated on mesh {param_replicate_mesh} but the optimizer "
                                 f"was given replicate_mesh={replicate_mesh}")
    return replicate_mesh, shard_mesh


def _same_mesh(a, b) -> bool:
    return hasattr(a, "mesh") and hasattr(b, "mesh") and a.mesh.shape == b.mesh.shape \
        and bool((a.mesh == b.mesh).all())


def matrix_layout(param: torch.Tensor) -> MatrixLayout:
    """Layout of a 2-D parameter: whole on this rank, or row-sharded over its shard mesh dim."""
    m, n = param.shape
    if not is_dtensor(param):
        return MatrixLayout(shape=(m, n), shard_rows=(m,))
    _, shard_dim = _placement_kinds(param, "")
    if shard_dim is None:
        return MatrixLayout(shape=(m, n), shard_rows=(m,))
    mesh = param.device_mesh
    parts = mesh.size(shard_dim)
    layout = MatrixLayout(shape=(m, n), shard_rows=chunk_rows(m, parts), shard_index=mesh.get_local_rank(shard_dim),
                          sharded=True)
    assert param.to_local().shape[0] == layout.rows, (param.to_local().shape, layout)
    return layout


def dim0_shards(param: torch.Tensor) -> tuple[tuple[int, ...], int] | None:
    """(dim-0 sizes held by each shard rank, this rank's shard index) of a `Shard(0)` DTensor with any
    number of dims (a 2-D param's rows, a 3-D stack's experts), or None for a tensor held whole on this rank."""
    if not is_dtensor(param):
        return None
    _, shard_dim = _placement_kinds(param, "")
    if shard_dim is None:
        return None
    mesh = param.device_mesh
    return chunk_rows(param.shape[0], mesh.size(shard_dim)), mesh.get_local_rank(shard_dim)


def like_param(param: torch.Tensor, local_tensor: torch.Tensor, global_rows: int) -> torch.Tensor:
    """Wrap a local state tensor whose rows follow the param's rows as a DTensor placed like the
    param (so DCP can reshard it); plain params get the plain tensor."""
    if not is_dtensor(param):
        return local_tensor
    from torch.distributed.tensor import DTensor
    shape = (global_rows, *local_tensor.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local_tensor, param.device_mesh, param.placements, run_check=False,
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
