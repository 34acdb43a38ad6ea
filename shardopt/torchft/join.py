"""A replica group's first round (docs/design.md §13): `join(optimizer)` before the first batch.

LocalSteps syncs every H steps, so a replica that starts (or restarts) must meet the others at their
next sync, not H steps later: `join` opens a round (the quorum waits for the others' sync). If every
replica of the quorum is joining, this is a fresh start: nothing is exchanged and the round commits. Else
the joiner heals in the quorum (heal.py) and takes part in the sync with x = 0 (it abstains), then
applies the same outer step as everyone: after the round its θ is bitwise the others'. A per-step
optimizer needs no join: its first step is a round (in which a joining replica heals; that step is
skipped everywhere, steps.py)."""

from __future__ import annotations

import torch

from .axis import ManagerAxis


@torch.no_grad()
def join(optimizer) -> None:
    """Open the first round of `optimizer` (a LocalSteps over a torchft manager; else a no-op)."""
    axis = getattr(optimizer, "replicate", None)
    if not isinstance(axis, ManagerAxis) or axis.keeper is not None:
        return
    from .checks import check_local_steps
    check_local_steps(optimizer)
    optimizer._init_state()
    axis.begin_round(joining=True)
    if axis.join_only:
        axis.end_round(True)
        return
    optimizer._sync(0, optimizer._fragment_params(0))   # the round's exchange, abstaining; ends the round
