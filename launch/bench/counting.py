"""Byte counts for torch's own DDP communication: the all-reduces that DDP comm hooks
(allreduce, PowerSGD, post-local SGD) and the periodic model averager issue.

torch's hooks call `torch.distributed.all_reduce` through the name `dist` of their own modules
(`default_hooks`, `powerSGD_hook`, and `model_averaging.utils`; `post_localSGD_hook` goes through
`default_hooks`). `CountingAllReduce.install()` puts a thin proxy under that name in those three
modules only: every attribute is torch.distributed's, except `all_reduce`, which first counts the
bytes of the tensor it is handed, then calls the real one. So the count is what the hooks
actually hand to the wire (PowerSGD's P, Q and uncompressed tensors, including the ones it issues
from future callbacks), with the same formula as shardopt's comm layer (ring all-reduce: a rank
sends 2·(M−1)·S/M bytes for an S-byte input over M ranks; `shardopt.wire.comm.collective_bytes`).

Bytes are kept per kind of group: `between_nodes` (a group with ranks on more than one node:
the slow link, what shardopt calls the replicate axis) and `within_node`. A group that spans nodes
counts its whole ring volume, also the hops of the ring that stay inside a node (with 2 ranks per
node, a 4-rank ring crosses the link on 2 of its 4 hops; the veth counters show that part). A node is
global_rank // local_world_size (torchrun numbers the ranks of a node contiguously).

Plain DDP without a registered hook all-reduces in C++ where nothing can count it; the bench
registers torch's own `default_hooks.allreduce_hook` instead, which is the same all-reduce
(divide by M, then sum) through the counted path.
"""

from __future__ import annotations

import threading
import types

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.model_averaging import utils as averaging_utils

from shardopt.wire.comm import collective_bytes

HOOK_MODULES = (default_hooks, powerSGD_hook, averaging_utils)


class CountingAllReduce:
    """Counts the bytes (sent by this rank) of every all-reduce torch's DDP hooks and averager issue."""

    def __init__(self, local_world_size: int):
        if local_world_size < 1:
            raise ValueError(f"local_world_size must be ≥ 1, got {local_world_size}")
        self.local_world_size = local_world_size
        self._lock = threading.Lock()   # PowerSGD issues its second all-reduce from a future callback
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.between_nodes = 0
            self.within_node = 0
            self.calls = 0

    def spans_nodes(self, group) -> bool:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        return len({rank // self.local_world_size for rank in ranks}) > 1

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        size = dist.get_world_size(group)
        moved = collective_bytes("all_reduce", tensor.numel() * tensor.element_size(), size)
        between = moved if size > 1 and self.spans_nodes(group) else 0
        with self._lock:
            self.between_nodes += between
            self.within_node += moved - between
            self.calls += 1
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def install(self) -> "CountingAllReduce":
        """Route the hook modules' `dist.all_reduce` through this counter (idempotent per process:
        a second install replaces the first counter)."""
        proxy = types.ModuleType("torch.distributed (counted)")
        proxy.__getattr__ = lambda name: getattr(dist, name)   # module-level __getattr__ (PEP 562)
        proxy.all_reduce = self.all_reduce
        for module in HOOK_MODULES:
            module.dist = proxy
        return self
