"""The round protocol an optimizer runs around each replicate exchange (docs/design.md §13).

A replicate exchange is a round: `begin_round()` before it, what this replica sends is `contribution(x)`,
a mean divides by `contributors`, and `end_round(keep)` says whether every replica keeps the result. On a
fixed axis (comm.Axis over a DeviceMesh or ProcessGroup) the round is nothing: the same M replicas every
time, all contributing, the caller's `keep` stands. torchft's ManagerAxis (shardopt/torchft/axis.py)
makes each round a quorum of the live replica groups, with healing and an agreed commit."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class HealCounters(Protocol):
    """What a replica that heals copies from a live peer beyond the optimizer's state_dict(): the counters that
    decide which collectives its coming steps issue (the double-averaging check's schedule), so that it issues the
    same ones as its peers (shardopt/torchft/heal.py). The optimizer that attaches to an axis holds one as
    `heal_counters`: ShardOptimizer its StepAgreement (optim/agreement.py), LocalSteps its SyncChecks
    (localsteps/checks.py), the modules that own the counters."""

    def save_counters(self) -> dict:
        """The counters by name, as plain Python values (they travel in the heal payload)."""
        ...

    def load_counters(self, counters: dict) -> None:
        """Take a peer's `save_counters()`."""
        ...


class Rounds:
    """The round protocol of a fixed axis: every method a no-op (module docstring)."""

    needs_round = False   # whether a collective needs begin_round first (torchft: outside a round no quorum)
    contributors = property(lambda self: self.size, doc="replicas whose input a mean averages (torchft: this round's)")

    def attach(self, owner, per_step: bool) -> None:
        """Called once by the optimizer that holds this axis (torchft: healing, which copies its `heal_counters`,
        a HealCounters, and a round per step)."""

    def begin_round(self) -> None:
        """Before a replicate exchange (torchft: the quorum)."""

    def contribution(self, x: torch.Tensor) -> torch.Tensor:
        """What this replica sends for x (torchft: zeros while it heals)."""
        return x

    def end_round(self, keep: bool) -> bool:
        """After a replicate exchange: whether to keep its result (torchft: agreed, then should_commit)."""
        return keep
