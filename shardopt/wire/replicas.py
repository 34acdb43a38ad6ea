"""The replicate axis an optimizer exchanges over, from what the user passed as `replicate_mesh`."""

from __future__ import annotations

import sys

from ..torchft.axis import ManagerAxis
from .comm import Axis


def replicate_axis(mesh, owner, per_step: bool) -> Axis:
    """The replicate axis of the optimizer `owner` (attached to it: rounds.Rounds.attach), per_step: whether
    every step is a round (Dion, Sign-Muon) or only a sync (LocalSteps). A torchft Manager gives its
    ManagerAxis (quorum rounds, healing: shardopt/torchft/); a DeviceMesh, a ProcessGroup or None a fixed
    comm.Axis. torchft itself is never imported here (an optional dependency): a Manager can only exist
    once the user has imported it."""
    manager_type = getattr(sys.modules.get("torchft.manager"), "Manager", None)
    axis = ManagerAxis("replicate", mesh) if manager_type is not None and isinstance(mesh, manager_type) else \
        Axis("replicate", mesh)
    axis.attach(owner, per_step)
    return axis
