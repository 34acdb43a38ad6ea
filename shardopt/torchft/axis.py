"""The replicate axis over a torchft Manager (docs/design.md §13): the manager's process group, sized
round by round by the quorum.

A round is one replicate exchange (a local-steps sync, or one step of Dion / Sign-Muon):

    begin_round   manager.start_quorum() (synchronous: a joining replica heals inside it, through the
                  state-dict functions of heal.py); M, this replica's rank ← the quorum; one all-reduce
                  of 2 fp32 (does this replica contribute, is it joining) gives the round's contributors
    collectives   on the manager's process group (torchft ProcessGroupGloo / NCCL), counted as Axis counts
                  them at this round's M; a failure is reported to the manager (manager.report_error),
                  zeroes the collective's output and skips the rest of the round's collectives
    end_round     one all-reduce (max, 1 fp32) of "discard" over the round's replicas, then
                  manager.should_commit(): kept only where every replica kept it and the manager commits

A replica that heals or joins this round contributes x = 0 (`contribution`): a mean divides by the
round's contributors (`contributors`), a vote counts its zeros as abstentions. Every wait is bounded:
the quorum by the manager's quorum timeout, a collective by the process group's timeout, should_commit
by the manager's timeout.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions, ReduceOptions,
                                               ReduceScatterOptions)

from ..wire.comm import Axis, _all_gather, _reduce_scatter
from .checks import check_manager
from .heal import Healing
from .internals import manager_process_group
from .steps import RoundKeeper

logger = logging.getLogger("shardopt")
_FAILURES = (RuntimeError, TimeoutError, ConnectionError)   # gloo / NCCL: DistBackendError is a RuntimeError


class _Guarded:
    """A collective's work whose failure is reported to the axis (and so to the manager), not raised."""

    def __init__(self, axis: "ManagerAxis", work, output: torch.Tensor):
        self.axis, self.work, self.output = axis, work, output

    def wait(self):
        try:
            self.work.wait()
        except _FAILURES as error:   # a dead or hung peer (gloo: connection closed, timeout)
            self.axis.fail(error, self.output)

    def is_completed(self) -> bool:
        try:
            return self.work.is_completed()
        except _FAILURES:
            return True


class ManagerAxis(Axis):
    """The "replicate" axis of a torchft Manager (module docstring). Size 1 until the first round."""

    def __init__(self, name: str, manager):
        check_manager(manager)
        self.name, self.manager, self.group = name, manager, None
        self.size, self.rank, self._contributors, self.joiners = 1, 0, 1, 0
        self.open, self.failed, self.joining, self.healed = False, False, False, False
        self.rounds: list[dict] = []   # per round: M, contributors, bytes sent, committed, seconds
        self.keeper = None             # the per-step round keeper (steps.py), or None
        self.healing = None            # the state-dict functions (heal.py)
        self.fail_hook = None          # tests: called with the collective's index in the round
        self.reset_stats()

    contributors = property(lambda self: self._contributors)
    needs_round = True

    def private(self) -> "ManagerAxis":
        raise ValueError("a torchft replicate axis cannot run the exchange during backward; build the optimizer "
                         "with overlap_backward=False")

    def attach(self, owner, per_step: bool) -> None:
        self.healing = Healing(self.manager, owner, per_step)
        if per_step:
            self.keeper = RoundKeeper(self, owner)

    # ---- the round -------------------------------------------------------------------------------
    def begin_round(self, joining: bool = False) -> None:
        """The quorum; this round's M, rank and contributors (module docstring). No-op in an open round."""
        if self.open:
            return
        self.open, self.failed, self.joining, self.healed = True, False, joining, False
        self._started, self._sent_before, self._calls = time.monotonic(), self.bytes_sent, 0
        self.manager.start_quorum(allow_heal=True)     # synchronous: a healing replica has loaded when it returns
        process_group = manager_process_group(self.manager)
        self.size, self.rank = process_group.size(), process_group.parent.rank()
        self.failed = self.manager.errored() is not None
        if self.failed:
            logger.warning('shardopt.torchft: the quorum failed: %s', self.manager.errored())
        contributes = not (joining or self.healed or self.failed)
        self._contributors, self.joiners = self.size, int(joining)
        counts = self.all_reduce(torch.tensor([float(contributes), float(joining)]), "sum")
        self._contributors, self.joiners, self.failed = _agreed_in_group(int(counts[0]), int(counts[1]), self.failed)

    @property
    def join_only(self) -> bool:
        """Every replica of this round is joining (a fresh start): there is no exchange to take part in."""
        return self.joiners == self.size

    @property
    def heal_round(self) -> bool:
        """Some replica of this round heals or joins (it contributes nothing)."""
        return self._contributors < self.size

    def contribution(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._contributes() else torch.zeros_like(x)

    def _contributes(self) -> bool:
        return not (self.joining or self.healed)

    def end_round(self, keep: bool) -> bool:
        """Agree on keeping the round over its replicas, then ask the manager (module docstring)."""
        discard = not keep or self.failed or self.manager.errored() is not None or \
            (self._contributors == 0 and not self.join_only)
        verdict = self.all_reduce(torch.tensor([float(discard)]), "max")
        if self.failed or verdict[0] > 0:
            self.manager.report_error(RuntimeError("shardopt: a replica discarded this round"))
        committed = bool(self.manager.should_commit())
        self.rounds.append({"replicas": self.size, "contributors": self._contributors,
                            "bytes_sent": self.bytes_sent - self._sent_before, "committed": committed,
                            "seconds": time.monotonic() - self._started, "healed": self.healed,
                            "join": self.join_only, "ended_at": time.time()})
        self.open = False
        return committed

    def fail(self, error: Exception, output: torch.Tensor | None = None) -> None:
        """A collective failed: report it, zero its output, skip the round's remaining collectives."""
        logger.warning("shardopt.torchft: a replicate collective failed (%s); the round is discarded", error)
        self.failed = True
        self.manager.report_error(error)
        if output is not None:
            output.zero_()

    # ---- collectives on the manager's process group ----------------------------------------------
    def _start(self, collective, *args, **kwargs):
        output = args[0]
        self._calls += 1
        if self.fail_hook is not None:
            self.fail_hook(self, self._calls)
        if self.failed:
            output.zero_()
            return None
        try:
            return _Guarded(self, _issue(manager_process_group(self.manager), collective, args, kwargs), output)
        except _FAILURES as error:
            self.fail(error, output)
            return None

    def _gloo_cpu(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def _global_rank(self, rank: int) -> int:
        return rank

    def agree(self, values: list[int], timeout_s: float, device=None) -> list[list[int]]:
        """Construction-time checks see this replica only: the membership changes, and healing copies
        the state a joining replica needs (heal.py)."""
        return [values]


def _agreed_in_group(contributors: int, joiners: int, failed: bool) -> tuple[int, int, bool]:
    """The round's decisions made alike on every rank of the replica group (its torchrun world, the
    default process group): each shard rank has a process group of its own across the replicas, and a
    failure seen on one of them must turn the whole group's round (min of the counts, max of failed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return contributors, joiners, failed
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    values = torch.tensor([-contributors, -joiners, int(failed)], dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return -int(values[0]), -int(values[1]), bool(values[2])


def _issue(process_group, collective, args, kwargs):
    """One torch.distributed collective of comm.Axis as the torchft process group's method (the group is
    not registered with torch.distributed): all_reduce, all_gather, all_to_all, reduce, reduce_scatter."""
    if collective is dist.all_reduce:
        options = AllreduceOptions()
        options.reduceOp = kwargs["op"]
        return process_group.allreduce([args[0]], options)
    if collective is _all_gather:
        out, tensor = args
        return process_group.allgather([list(out.view(-1, tensor.numel()).unbind(0))], [tensor], AllgatherOptions())
    if collective is dist.all_to_all_single:
        out, tensor, output_splits, input_splits = args
        return process_group.alltoall_base(out, tensor, output_splits or [], input_splits or [], AllToAllOptions())
    if collective is dist.reduce:
        options = ReduceOptions()
        options.rootRank, options.reduceOp = kwargs["dst"], dist.ReduceOp.SUM
        return process_group.parent.reduce([args[0]], options)
    if collective is _reduce_scatter:
        return process_group.reduce_scatter_tensor_coalesced([args[0]], [args[1]], ReduceScatterOptions())
    raise NotImplementedError(f"shardopt.torchft: collective {getattr(collective, '__name__', collective)} on a "
                              f"torchft process group")
