"""What LocalSteps checks (docs/design.md §7, §10): its arguments, the model and the meshes at construction
(`check_local_steps`, `check_model`, `inner_axes`), and at every sync what the replicas must agree on
beyond the exchange (`SyncChecks`)."""

from __future__ import annotations

import logging

import torch
from torch.nn.parallel import DistributedDataParallel

from ..layout.placement import derive_meshes, local
from ..optim.guard import check_not_double_averaged
from ..wire.comm import Axis, group_ranks
from .formats import EXCHANGES
from .surface import OptimizerAround
from .state import STATE_DTYPES

logger = logging.getLogger("shardopt")


def check_local_steps(inner, *, sync_every, outer_lr, outer_momentum, exchange, rank_fraction, fragments,
                      state_dtype, state_device, density=0.02) -> torch.dtype:
    """Raise ValueError naming the first bad argument of LocalSteps; returns the state dtype (a name → torch's)."""
    if not isinstance(inner, torch.optim.Optimizer):
        raise ValueError(f"inner must be a torch.optim.Optimizer (a shardopt optimizer or a torch one), got "
                         f"{type(inner).__name__}")
    if isinstance(inner, OptimizerAround):   # (LocalSteps)
        raise ValueError("inner is already a LocalSteps; wrap the inner optimizer once")
    if type(sync_every) is not int or sync_every < 1:
        raise ValueError(f"sync_every must be an int ≥ 1 (inner steps per round), got {sync_every!r}")
    if not outer_lr > 0:
        raise ValueError(f"outer_lr must be > 0, got {outer_lr!r}")
    if not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if not 0 < rank_fraction <= 1:
        raise ValueError(f"rank_fraction must be in (0, 1] (rank / min(m, n) of \"lowrank\"), got {rank_fraction!r}")
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1] (the fraction of each chunk that \"topk\" sends; 0.01–0.03 "
                         f"typical), got {density!r}")
    if type(fragments) is not int or not 1 <= fragments <= sync_every:
        raise ValueError(f"fragments must be an int in [1, sync_every={sync_every}] (each fragment syncs once "
                         f"per round, at its own step), got {fragments!r}")
    state_dtype = getattr(torch, state_dtype) if isinstance(state_dtype, str) else state_dtype
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype!r}")
    if state_device not in (None, "cpu"):
        raise ValueError(f"state_device must be None (the param's device) or 'cpu', got {state_device!r}")
    replica_axis = getattr(inner, "replicate", None)
    if isinstance(replica_axis, Axis) and replica_axis.size > 1:
        raise ValueError(f"inner ({type(inner).__name__}) exchanges on a replicate axis of {replica_axis.size} "
                         f"ranks (its replicate_mesh, given or derived from the params' placements); build it "
                         f"without replicate_mesh (FSDP2: fully_shard(model, mesh=mesh['shard'])) and pass the "
                         f"mesh to LocalSteps(replicate_mesh=...)")
    return state_dtype


def check_model(model, replicate: Axis) -> None:
    """A DDP whose process group holds another replica of this one's replicate axis averages the
    gradients across the replicas every step (bytes on the slow axis, replicas identical): ValueError."""
    if model is None or not isinstance(model, DistributedDataParallel) or replicate.size == 1:
        return
    ddp_ranks = set(group_ranks(model.process_group, "model"))
    replicas = set(group_ranks(replicate.group, "replicate"))
    if len(ddp_ranks & replicas) > 1:
        raise ValueError(f"model is a DistributedDataParallel over ranks {sorted(ddp_ranks)}, which include "
                         f"other replicas of replicate_mesh (ranks {sorted(replicas)}): DDP would average the "
                         f"gradients across the replicas every step; build DDP on the ranks of one replica "
                         f"(DistributedDataParallel(module, process_group=intra_replica_group)) or pass "
                         f"inner an optimizer over the plain module")


def inner_axes(inner, params: list, replicate_mesh) -> list[Axis]:
    """The shard and tensor axes of the params (the inner shardopt optimizer's, else from the DTensor
    placements, whose replicate mesh dim must then be `replicate_mesh`): a round's discard is agreed over
    them too, so a replica never applies half a round."""
    if isinstance(getattr(inner, "shard", None), Axis):
        return [inner.shard, inner.tensor]
    derived, shard, tensor = derive_meshes([(p, f"#{i}") for i, p in enumerate(params)], None, None)
    if derived is not None and group_ranks(derived, "replicate") != group_ranks(replicate_mesh, "replicate"):
        raise ValueError(f"the params are replicated over ranks {group_ranks(derived, 'replicate')} of their mesh, "
                         f"but replicate_mesh holds ranks {group_ranks(replicate_mesh, 'replicate')}; pass the "
                         f"params' replicate mesh dim (mesh['replicate'])")
    return [Axis("shard", shard), Axis("tensor", tensor)]


class SyncChecks:
    """What every replica agrees on at a sync beyond the exchange itself (docs/design.md §10):

    - `discard`: the exchange's non-finite flag (already agreed over the replicas), agreed over
      `agreement_axes` too (max, one float each) and read on the host (the sync's one device sync); a
      discarded round is counted in `discarded_rounds` and logged.
    - `check_double_averaging`: once, at the first step with a nonzero gradient anywhere, 24 bytes on the
      replicate axis (optim/guard.py): DoubleAveragingError when every replica's local gradients are
      bitwise equal (something averaged them over the replicas already). It runs before the inner step,
      so nothing has changed when it raises; on an axis whose collectives need a round (torchft's
      ManagerAxis, `needs_round`) it runs inside the first sync instead, on the pseudo-gradient Δ."""

    def __init__(self, replicate: Axis, other_axes: list[Axis], agreement_axes: list[Axis], double_averaging: bool):
        self.replicate, self.other_axes, self.agreement_axes = replicate, other_axes, agreement_axes
        self.double_averaging_checked = not double_averaging
        self.discarded_rounds = 0

    def discard(self, nonfinite: torch.Tensor, params: int, step: int) -> bool:
        flag = nonfinite.float().reshape(1)
        for axis in self.agreement_axes:
            flag = axis.all_reduce(flag, "max")
        if not bool(flag.item()):
            return False
        self.discarded_rounds += 1
        logger.warning("shardopt LocalSteps: a non-finite pseudo-gradient on some replica at step %d; the round of "
                       "%d params is discarded on every replica (θ ← θ_outer)", step, params)
        return True

    def save_counters(self) -> dict:
        """Whether the once-only double-averaging check has run, which a healed replica copies
        (wire/rounds.HealCounters)."""
        return {"double_averaging_checked": self.double_averaging_checked}

    def load_counters(self, counters: dict) -> None:
        self.double_averaging_checked = bool(counters["double_averaging_checked"])

    def check_gradients(self, params: list[torch.Tensor], step: int) -> None:
        """`check_double_averaging` on the local gradients of `params` (those that have one), before a step."""
        if not self.double_averaging_checked:
            self.check_double_averaging([local(p.grad) for p in params if p.grad is not None], step, in_round=False)

    def check_double_averaging(self, tensors: list[torch.Tensor], step: int, in_round: bool) -> None:
        """The check on `tensors` (a step's local gradients, or inside a round a sync's Δ), until a step shows
        evidence either way (all zero or none on every rank: checked again at the next one)."""
        if self.double_averaging_checked or in_round != self.replicate.needs_round or self.replicate.size == 1:
            return
        device = tensors[0].device if tensors else torch.device("cpu")
        self.double_averaging_checked = check_not_double_averaged(
            tensors, self.replicate, [axis for axis in self.agreement_axes if axis.size > 1], device, step,
            "LocalSteps(double_averaging_check=False)")
