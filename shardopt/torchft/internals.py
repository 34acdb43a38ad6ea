"""The torchft privates shardopt.torchft reads (docs/design.md §4: one catalogue per framework), with the
versions they were checked on. `check()` fails with the name of whatever a new torchft moved
(tests/test_torchft.py runs it)."""

from __future__ import annotations

import inspect

CHECKED_VERSIONS = ">=0.2,<0.3"   # torchft 0.2.0

PRIVATES = {
    "Manager._pg": "the manager's reconfigurable process group (its collectives carry the exchange)",
    "Manager._use_async_quorum": "must be False: a joining replica heals inside start_quorum, before the exchange",
    "Manager._min_replica_size": "checked against the number of replica groups",
    "Manager._init_sync": "must be True: with False torchft does not heal a replica that joins at step 0",
    "Manager._user_state_dicts": "one shardopt optimizer per manager (register_state_dict_fn asserts on a repeat)",
}


def manager_process_group(manager):
    """The torchft ProcessGroup the manager reconfigures at every quorum (Manager._pg)."""
    return manager._pg


def uses_async_quorum(manager) -> bool:
    return bool(manager._use_async_quorum)


def init_sync(manager) -> bool:
    return bool(manager._init_sync)


def serves_key(manager, key: str) -> bool:
    return key in getattr(manager, "_user_state_dicts", {})


def min_replica_size(manager) -> int:
    return int(manager._min_replica_size)


def check() -> None:
    """Raise naming each private above that this torchft's Manager no longer has."""
    from torchft.manager import Manager
    source = inspect.getsource(Manager.__init__)
    missing = [name for name in PRIVATES if f"self.{name.split('.')[1]}" not in source]
    if missing:
        import torchft
        raise RuntimeError(f"shardopt.torchft reads {missing} of torchft.Manager, which torchft "
                           f"{getattr(torchft, '__version__', '?')} no longer sets; checked on torchft {CHECKED_VERSIONS}")
