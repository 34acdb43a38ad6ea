"""The one communication layer: every collective shardopt issues goes through an `Axis`.

An Axis is one mesh axis — "replicate" (data parallel, slow links), "shard"
(weight parallel, FSDP2) or "tensor" (tensor parallel) — backed by a ProcessGroup. On an axis of size 1
every collective is a no-op that moves nothing. Each call counts the bytes
this rank sends and receives with the volume of the standard algorithm
(S = bytes of this rank's input, M = axis size):

| collective      | bytes sent = bytes received |
|-----------------|-----------------------------|
| all_reduce      | 2·(M−1)·S / M   (ring)      |
| all_gather      | (M−1)·S                     |
| all_to_all      | (M−1)·S / M                 |
| reduce_scatter  | (M−1)·S / M                 |

(integer division of the product); `reduce` to one rank: each other rank sends S, the root
receives (M−1)·S; `broadcast` from one rank: the root sends (M−1)·S, each other rank receives S. No other module calls torch.distributed
collectives. Every collective can run asynchronously (`async_op=True` returns
a `Pending`), so the step scheduler can overlap one bucket's communication with
another bucket's compute.
"""

from __future__ import annotations

import datetime
import math
import os
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..internals import group_timeout
from .rounds import Rounds

from .devices import agreement_failure, check_distinct_devices, collective_device, host_device_key

AXIS_NAMES = ("replicate", "shard", "tensor", "node")   # node: the ranks of a node under the DeepSpeed plugin's ZeRO 1/2
# renamed in torch 2.13 (the old names warn there); torch ≥ 2.6 has the old ones only
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def collective_bytes(kind: str, nbytes: int, size: int) -> int:
    """Bytes one rank sends (= receives) for a collective over `size` ranks on an `nbytes` input."""
    if size <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (size - 1) * nbytes // size
    if kind == "all_gather":
        return (size - 1) * nbytes
    if kind in ("all_to_all", "reduce_scatter"):
        return (size - 1) * nbytes // size
    raise ValueError(f"unknown collective {kind!r}")


def resolve_group(mesh, name: str):
    """A 1-D DeviceMesh, a ProcessGroup or None → (ProcessGroup or None, size, rank)."""
    if mesh is None:
        return None, 1, 0
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name}_mesh was given but torch.distributed is not initialized; "
                         f"call torch.distributed.init_process_group first or pass {name}_mesh=None")
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(f"{name}_mesh must be a 1-D DeviceMesh, got a {mesh.ndim}-D mesh with dims "
                             f"{mesh.mesh_dim_names}; pass one axis, e.g. mesh[{name!r}]")
        group = mesh.get_group()
    elif isinstance(mesh, dist.ProcessGroup):
        group = mesh
    elif type(mesh) is int and mesh == dist.GroupMember.NON_GROUP_MEMBER:   # dist.new_group() on a non-member
        raise ValueError(f"{name}_mesh is a process group this rank (global rank {dist.get_rank()}) "
                         f"is not a member of (dist.new_group returned GroupMember.NON_GROUP_MEMBER here); "
                         f"pass the group that contains this rank")
    else:
        raise ValueError(f"{name}_mesh must be a 1-D DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{name}_mesh is a process group this rank (global rank {dist.get_rank()}) "
                         f"is not a member of; pass the group that contains this rank")
    return group, dist.get_world_size(group), rank


def group_ranks(mesh, name: str) -> list[int] | None:
    """The global ranks of a 1-D DeviceMesh or ProcessGroup (checked as `resolve_group` checks `{name}_mesh`), in
    group order; None for None."""
    group, _, _ = resolve_group(mesh, name)
    return None if group is None else dist.get_process_group_ranks(group)


def split_world(replicate: int, shard: int) -> tuple:
    """Process groups of a (replicate, shard) mesh over the world, rank = replica·shard + shard index
    (consecutive ranks share a node): (this rank's replicate group, this rank's shard group).
    Every rank must call it (dist.new_group is collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if replicate * shard != world:
        raise ValueError(f"mesh replicate={replicate} × shard={shard} = {replicate * shard} ranks, but the world has "
                         f"{world}; choose R·S = {world}")
    mine = {}
    for index in range(shard):
        group = dist.new_group([index + shard * r for r in range(replicate)])
        if index == rank % shard:
            mine["replicate"] = group
    for index in range(replicate):
        group = dist.new_group(list(range(index * shard, (index + 1) * shard)))
        if index == rank // shard:
            mine["shard"] = group
    return mine["replicate"], mine["shard"]


class Axes(NamedTuple):
    """The three axes of an optimizer (each an Axis; size 1 where the mesh has none)."""

    replicate: "Axis"
    shard: "Axis"
    tensor: "Axis"


class Pending:
    """A collective in flight: `wait()` blocks until it is done and returns its result."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def wait(self):
        if self.work is not None:
            self.work.wait()
        return self.finish()

    def done(self) -> bool:
        """True when `wait()` would not block (the collective has completed; never blocks itself)."""
        return self.work is None or self.work.is_completed()


def complete(step):
    """Run one generator of collectives (it yields each `Pending`, is resumed with its result)
    synchronously and return its return value."""
    try:
        pending = next(step)
        while True:
            pending = step.send(pending.wait())
    except StopIteration as stop:
        return stop.value


class Axis(Rounds):
    """One mesh axis with byte accounting. Collectives return new tensors or work in place as documented."""

    def __init__(self, name: str, mesh=None):
        if name not in AXIS_NAMES:
            raise ValueError(f"axis name must be one of {AXIS_NAMES}, got {name!r}")
        self.name = name
        self.group, self.size, self.rank = resolve_group(mesh, name)
        self.device = None   # this rank's params' device, once `agree` has run: where `private` exchanges
        self.reset_stats()

    def __deepcopy__(self, memo) -> "Axis":
        """A copy of an optimizer shares its axes (a process group is a handle, not data)."""
        return self

    def __reduce__(self):
        """Pickle: an axis of one rank is rebuilt as one; a process group cannot be pickled."""
        if self.size > 1:
            raise TypeError(f"the {self.name} axis is a process group of {self.size} ranks, which cannot be pickled; "
                            f"save optimizer.state_dict() (or use torch.distributed.checkpoint) and build the "
                            f"optimizer again on the other side")
        return (Axis, (self.name,))

    def private(self) -> "Axis":
        """An axis over the same ranks on a process group of its own, on which only its holder issues
        collectives. Collectives issued from backward hooks start at times that differ from rank to rank;
        on a group that someone else also uses during backward (FSDP2's reduce-scatters on the shard
        group, DDP's reducer, tensor parallelism's all-reduces, another optimizer) the two streams of
        collectives would interleave differently on different ranks and pair up wrongly.

        A collective over the whole world (every rank calls it, in the same order as its other group
        creations, as for torch's new_group): the ranks learn every rank's group (`_world_groups`) and
        make them all with new_subgroups_by_enumeration, whose group names every rank agrees on. (A group
        made by its own ranks only, use_local_synchronization=True, is named from how many groups each
        rank holds: ranks holding different numbers, e.g. after a group of some ranks only, would wait
        for each other under different names.)"""
        if self.size == 1:
            return Axis(self.name)
        distinct = sorted(set(self._world_groups()))
        ranks = {rank for group in distinct for rank in group}
        if len(ranks) != sum(map(len, distinct)):
            raise ValueError(f"the {self.name} axis: the ranks' groups {distinct} overlap; a private copy needs "
                             f"the {self.name} groups of the world to be disjoint (one mesh dimension)")
        mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in distinct], timeout=group_timeout(self.group))
        return Axis(self.name, mine)

    def _world_groups(self) -> list[tuple[int, ...]]:
        """Every world rank's group of this axis (global ranks): two all-gathers over the world, of the
        group sizes and of the rank lists padded to the longest with −1, on `self.device` (the params'
        device, learned at `agree`; torch's all_gather_object would use torch.cuda.current_device())."""
        world = dist.get_world_size()
        device = collective_device(str(dist.get_backend()), self.device, self.name)
        mine = torch.tensor(dist.get_process_group_ranks(self.group), dtype=torch.int64, device=device)
        sizes = mine.new_empty((world,))
        _all_gather(sizes, torch.full((1,), mine.numel(), dtype=torch.int64, device=device))
        padded = torch.cat([mine, mine.new_full((int(sizes.max()) - mine.numel(),), -1)])
        everyone = padded.new_empty((world * padded.numel(),))
        _all_gather(everyone, padded)
        return [tuple(rank for rank in row if rank >= 0) for row in everyone.view(world, -1).tolist()]

    def reset_stats(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0
        self.calls = 0

    def stats(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received, "calls": self.calls}

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        moved = collective_bytes(kind, tensor.numel() * tensor.element_size(), self.size)
        self.bytes_sent += moved
        self.bytes_received += moved
        self.calls += 1

    def _issue(self, work, finish, async_op: bool):
        pending = Pending(work, finish)
        return pending if async_op else pending.wait()

    def _start(self, collective, *args, **kwargs):
        """Start one torch.distributed collective on this axis's group (async; returns its work)."""
        return collective(*args, group=self.group, async_op=True, **kwargs)

    def _gloo_cpu(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(self.group))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        """In place: tensor ← Σ (op="sum"), mean (op="mean", float only) or max over the axis."""
        finish = (lambda: tensor.div_(self.contributors)) if op == "mean" else (lambda: tensor)
        if self.size == 1:
            return self._issue(None, lambda: tensor, async_op)
        self._count("all_reduce", tensor)
        reduce_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        work = self._start(dist.all_reduce, tensor, op=reduce_op)
        return self._issue(work, finish, async_op)

    def all_gather(self, tensor: torch.Tensor, async_op: bool = False):
        """(…) on each rank → (M, …), row i from axis rank i."""
        if self.size == 1:
            return self._issue(None, lambda: tensor.unsqueeze(0), async_op)
        self._count("all_gather", tensor)
        out = tensor.new_empty((self.size * tensor.numel(),))
        work = self._start(_all_gather, out, tensor.contiguous().reshape(-1))
        return self._issue(work, lambda: out.view(self.size, *tensor.shape), async_op)

    def all_to_all(self, tensor: torch.Tensor, input_splits: list[int] | None = None,
                   output_splits: list[int] | None = None, async_op: bool = False):
        """Dim 0 split into M chunks (equal, or sizes `input_splits`); chunk i goes to rank i; the
        chunks received (sizes `output_splits`) are concatenated in rank order. Counts the bytes that
        leave and arrive at this rank (its own chunk stays): (M−1)/M of the input when even."""
        if self.size == 1:
            return self._issue(None, lambda: tensor, async_op)
        row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
        if input_splits is None:
            sent = collective_bytes("all_to_all", tensor.numel() * tensor.element_size(), self.size)
            received = sent
            out = torch.empty_like(tensor)
        else:
            sent = (sum(input_splits) - input_splits[self.rank]) * row_bytes
            received = (sum(output_splits) - output_splits[self.rank]) * row_bytes
            out = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
        self.bytes_sent += sent
        self.bytes_received += received
        self.calls += 1
        work = self._start(dist.all_to_all_single, out, tensor.contiguous(), output_splits, input_splits)
        return self._issue(work, lambda: out, async_op)

    def reduce_scatter(self, tensor: torch.Tensor, async_op: bool = False):
        """(M·k, …) → this rank's (k, …) piece of the sum over the axis.

        gloo's reduce-scatter is a whole all-reduce on the wire (each rank sends S, not (M−1)·S/M: measured
        on the link counters), so on gloo it runs as an all-to-all of the M pieces, (M·k, …) → (M, k, …)
        from every rank, summed here: the standard volume, which is what `_count` counts."""
        if self.size == 1:
            return self._issue(None, lambda: tensor, async_op)
        self._count("reduce_scatter", tensor)
        piece_shape = (tensor.size(0) // self.size, *tensor.shape[1:])
        if self._gloo_cpu(tensor):
            pieces = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            work = self._start(dist.all_to_all_single, pieces, tensor.contiguous())
            return self._issue(work, lambda: pieces.view(self.size, *piece_shape).sum(0), async_op)
        out = tensor.new_empty(piece_shape)
        work = self._start(_reduce_scatter, out.view(-1), tensor.contiguous().view(-1))
        return self._issue(work, lambda: out, async_op)

    def reduce(self, tensor: torch.Tensor, dst: int, async_op: bool = False):
        """In place on axis rank `dst`: tensor ← Σ over the axis (the others' tensors are left as they are
        or overwritten: do not read them). Counted as a direct reduce: every other rank sends its
        tensor, `dst` receives (M−1) of them."""
        return self._rooted(dist.reduce, tensor, dst, async_op, root_sends=False)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False):
        """In place: tensor ← axis rank `src`'s tensor on every rank of the axis (an exact copy). Counted as a
        direct broadcast: `src` sends its tensor to each of the M−1 others, each of them receives it once."""
        return self._rooted(dist.broadcast, tensor, src, async_op, root_sends=True)

    def _rooted(self, collective, tensor: torch.Tensor, root: int, async_op: bool, root_sends: bool):
        """A collective between axis rank `root` and each other rank, one tensor each way (reduce: to the root;
        broadcast: from it); the root counts (M−1) tensors, the others one."""
        if self.size == 1:
            return self._issue(None, lambda: tensor, async_op)
        nbytes = tensor.numel() * tensor.element_size()
        moved = (self.size - 1) * nbytes if self.rank == root else nbytes
        if (self.rank == root) == root_sends:
            self.bytes_sent += moved
        else:
            self.bytes_received += moved
        self.calls += 1
        work = self._start(collective, tensor, self._global_rank(root))
        return self._issue(work, lambda: tensor, async_op)

    def _global_rank(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def agree(self, values: list[int], timeout_s: float, device: torch.device | None = None) -> list[list[int]]:
        """Every rank's list of ints (same length everywhere), waiting at most `timeout_s`, so a
        construction-time check raises instead of hanging on a rank that never arrives. `device`: this
        rank's params' device, where the exchange happens on a NCCL group (devices.collective_device)
        and, remembered as `self.device`, where `private` exchanges later. With the values each rank
        sends its (host, GPU index): two ranks of one host on one GPU of a NCCL group raise ValueError
        naming torch.cuda.set_device (devices.check_distinct_devices). Counted as an all-gather."""
        self.device = device
        if self.size == 1:
            return [values]
        backend = str(dist.get_backend(self.group))
        local_values = torch.tensor(values + host_device_key(device), dtype=torch.int64,
                                    device=collective_device(backend, device, self.name))
        self._count("all_gather", local_values)
        out = local_values.new_empty((self.size * local_values.numel(),))
        try:
            work = _all_gather(out, local_values, group=self.group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as error:
            raise RuntimeError(agreement_failure(self.name, timeout_s, error, backend, device,
                                                 os.environ.get("LOCAL_RANK"))) from error
        rows = out.view(self.size, -1).tolist()
        if "nccl" in backend:
            check_distinct_devices([row[len(values):] for row in rows], self.name)
        return [row[:len(values)] for row in rows]


class CountingAxis(Axis):
    """An axis of `size` ranks (this one `rank`) that counts every collective exactly as `Axis`
    does but moves nothing: results have the right shapes, their values are undefined. Running a
    step against counting axes, on meta tensors, gives the bytes that step sends (traffic.py):
    one byte model, the step's own code."""

    def __init__(self, name: str, size: int = 1, rank: int = 0):
        super().__init__(name)   # an axis of one rank, no group
        self.size, self.rank = size, rank

    def _start(self, collective, *args, **kwargs):
        return None

    def _gloo_cpu(self, tensor: torch.Tensor) -> bool:
        return False

    def _global_rank(self, rank: int) -> int:
        return rank
