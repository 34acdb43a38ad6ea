"""A replica group's first round (docs/design.md §13): `join(optimizer)` before the first batch.

LocalSteps syncs every H steps, so a replica that starts (or restarts) must meet the others at their
next sync, not H steps later: `join` opens a round (the quorum waits for the others' sync). If every
replica of the quorum is joining, this is a fresh start: nothing is exchanged and the round commits. Else
the joiner heals in the quorum (heal.py) and takes part in the sync with x = 0 (it abstains), then
applies the same outer step as everyone: after the round its θ is bitwise the others'. Where the healed step
count is off the schedule the others are ending their run (LocalSteps.sync_now, localsteps/finish.py): the
joiner settles as they do (the outer step without its momentum) and its own sync_now finds nothing due. A per-step
optimizer's join is its first round too: a fresh start commits an empty round, a joiner heals and
takes part in the others' step with zero gradients, a step that is then skipped everywhere (steps.py)."""

from __future__ import annotations

import time

import torch

from ..localsteps.finish import off_schedule
from .axis import ManagerAxis
from .checks import check_local_steps


@torch.no_grad()
def join(optimizer, replica_groups: int | None = None, timeout_s: float = 600.0) -> None:
    """Open the first round of `optimizer` (a LocalSteps over a torchft manager; else a no-op).
    `replica_groups`: how many groups a fresh start waits for. A fresh start of fewer (a quorum of joiners
    only) is discarded and the quorum asked again, once a second, for at most `timeout_s`: two halves that
    each started alone would both be at step 1, and torchft heals only a replica that is behind."""
    axis = getattr(optimizer, "replicate", None)
    if not isinstance(axis, ManagerAxis):
        return
    if axis.keeper is None:
        check_local_steps(optimizer)
        optimizer._init_state()
    deadline = time.monotonic() + timeout_s
    while True:
        axis.begin_round(joining=True)
        if not axis.join_only:
            _take_part(optimizer, axis)
            return
        if axis.end_round(replica_groups is None or axis.size >= replica_groups):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"shardopt.torchft.join: after {timeout_s:g} s only {axis.size} of replica_groups="
                               f"{replica_groups} groups are in the quorum; start the others, or pass the number that "
                               f"runs. (A group restarted after the others have finished has no live group to heal "
                               f"from: their run is over, and their final model or checkpoint is its result.)")
        time.sleep(1.0)


def _take_part(optimizer, axis) -> None:
    """The others' round, with nothing of this replica's in it: LocalSteps' sync with x = 0; a per-step
    optimizer's step on zero gradients, which steps.py discards everywhere (a joiner is in it)."""
    if axis.keeper is None:   # the round's exchange, abstaining; ends the round
        fragment = optimizer._fragments[0]
        if off_schedule(optimizer):   # the others' sync_now (module docstring)
            fragment.settle(optimizer.steps)
        else:
            fragment.sync(optimizer.steps)
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()   # the round is open: the pre-hook only takes the snapshot, the post-hook ends it
    optimizer.zero_grad()
