"""The end of a run of local steps (docs/design.md §10, §13, docs/trainers.md).

Training that stops between two syncs (max_steps not a multiple of sync_every, fragments, overlap) leaves
each replica with its own inner progress since its last sync. `sync_pending` syncs now, off the schedule,
every fragment that holds such progress on some replica, through the same exchange, error feedback, outer
SGD step (without its momentum: Fragment.settle says why) and checks as a scheduled sync, so every replica
ends with θ = θ_outer, bitwise equal, and the final model is the one the outer loop gives. Bytes: at most one
round's (`sync_bytes`), plus one all-reduce of F fp32 flags that agrees which fragments are due (4·F bytes,
counted on the replicate axis like every exchange). A second call at the same step finds nothing due and
sends only the flags. `replicas_consistent` checks the result.

Over a torchft manager (one fragment, no overlap: torchft/checks.py) a collective needs a round's quorum, and
a flag all-reduce in a round of its own could fail on one replica only and leave the replicas disagreeing on
whether the sync round follows. There the fragment is due by the step count alone, which every replica holds
alike (healing copies it): the run stopped off the schedule (steps mod H ≠ the fragment's offset) and no sync
ran at this step yet. The sync is one round like a scheduled one: a replica healing in it contributes zeros,
and a discarded round still ends with θ ← θ_outer, the last committed outer params, on every replica.
"""

from __future__ import annotations

import torch

from ..layout.placement import local
from ..optim.guard import replicas_equal
from .fragment import PENDING_APPLY, Fragment, sync_offset


def holds_progress(fragment: Fragment) -> bool:
    """Whether this rank's part of `fragment` moved since its last sync: θ ≠ θ_outer for one of its params
    or, with overlap, an exchange in flight or a result not yet applied."""
    for param in fragment.params:
        state = fragment.states[param]
        if state.pending is not None and (fragment.flight is not None or int(state.pending) == PENDING_APPLY):
            return True
        if not torch.equal(local(param), local(state.params).to(local(param).device, local(param).dtype)):
            return True
    return False


@torch.no_grad()
def sync_pending(local_steps) -> list[int]:
    """Sync now every fragment of `local_steps` (a LocalSteps) that holds progress on some replica (module
    docstring: the flags agreed, max, over the replicate axis and the axes a round's discard is agreed over;
    over torchft, the step count); returns their indices. Every replica and every rank of its inner axes must
    call it at the same step."""
    local_steps._init_state()
    fragments = local_steps._fragments
    due = off_schedule(local_steps) if local_steps.replicate.needs_round else agreed_progress(local_steps)
    for index in due:
        local_steps._sync(fragments[index], settle=True)
    return due


def agreed_progress(local_steps) -> list[int]:
    """The fragments that hold progress on some replica (holds_progress, max over the axes)."""
    fragments = local_steps._fragments
    device = local(local_steps.params()[0]).device
    flags = torch.tensor([float(holds_progress(fragment)) for fragment in fragments], device=device)
    for axis in (local_steps.replicate, *local_steps.checks.agreement_axes):
        flags = axis.all_reduce(flags, "max")
    return [fragment.index for fragment, flag in zip(fragments, flags.tolist()) if flag]


def off_schedule(local_steps) -> list[int]:
    """The fragments whose last sync is not at this step, by the step count (the same on every replica): at
    least one step taken, this step not one of the fragment's scheduled syncs, no sync_now at it yet."""
    steps, every, count = local_steps.steps, local_steps.sync_every, local_steps.fragments
    return [fragment.index for fragment in local_steps._fragments
            if steps > 0 and steps % every != sync_offset(fragment.index, count, every)
            and fragment.settled_at != steps]


@torch.no_grad()
def replicas_consistent(local_steps) -> bool:
    """True when what the contract makes bitwise equal on every replica is: the params right after a sync
    without overlap; θ_outer with overlap (one hash per tensor, one all-gather)."""
    params = local_steps.params()
    if local_steps.overlap:
        return replicas_equal([local(local_steps.state[p].params) for p in params if local_steps.state.get(p)],
                              local_steps.replicate)
    return replicas_equal([local(p) for p in params], local_steps.replicate)
