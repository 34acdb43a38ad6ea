"""Bad input to shardopt.torchft: a clear error naming the fix (docs/design.md §7, §13)."""

from __future__ import annotations

import sys

from .internals import init_sync, uses_async_quorum


def check_manager(manager) -> None:
    """A torchft.Manager with a synchronous quorum (use_async_quorum=False)."""
    manager_type = getattr(sys.modules.get("torchft.manager"), "Manager", None)
    if manager_type is None or not isinstance(manager, manager_type):
        raise ValueError(f"manager must be a torchft.Manager (pip install 'shardopt[torchft]'; torchft.Manager(pg="
                         f"torchft.ProcessGroupGloo(), min_replica_size=…, use_async_quorum=False, …)), got "
                         f"{type(manager).__name__}")
    if uses_async_quorum(manager):
        raise ValueError("the torchft.Manager was built with use_async_quorum=True; shardopt needs "
                         "use_async_quorum=False, so that a joining replica has healed before the round's "
                         "exchange (it then abstains from it)")
    if not init_sync(manager):
        raise ValueError("the torchft.Manager was built with init_sync=False; shardopt needs init_sync=True: with "
                         "False torchft does not heal a replica group that starts late (at step 0), which would "
                         "then run with its own step counts and optimizer state")


def check_min_replicas(min_replicas: int, groups: int | None) -> None:
    """min_replicas in [1, groups]: above the number of replica groups no quorum ever forms."""
    if type(min_replicas) is not int or min_replicas < 1:
        raise ValueError(f"min_replicas must be an int ≥ 1, got {min_replicas!r}")
    if groups is not None and min_replicas > groups:
        raise ValueError(f"min_replicas={min_replicas} is above the number of replica groups ({groups}): no quorum "
                         f"would ever form; pass --min-replicas ≤ {groups} (e.g. {max(1, groups - 1)} to survive "
                         f"one dead group)")


def check_no_replicate_axis(inner) -> None:
    """LocalSteps over a manager: its inner optimizer must not exchange over the replicas itself."""
    if getattr(getattr(inner, "replicate", None), "manager", None) is not None:   # a ManagerAxis
        raise ValueError(f"inner ({type(inner).__name__}) already has the torchft manager as its replicate axis; "
                         f"build it without replicate_mesh and pass the manager to LocalSteps(replicate_mesh="
                         f"manager) only")


def check_local_steps(local_steps) -> None:
    """What a LocalSteps over a manager supports: one fragment, no overlap."""
    check_no_replicate_axis(local_steps.inner)
    if local_steps.overlap or local_steps.fragments != 1:
        raise ValueError(f"LocalSteps over a torchft manager syncs the whole model in one round: got overlap="
                         f"{local_steps.overlap}, fragments={local_steps.fragments}; pass overlap=False, fragments=1")
