"""Fault-tolerant, elastic training on torchft (docs/design.md §13; `pip install 'shardopt[torchft]'`).

A torchft `Manager` is the replicate axis: pass it as `replicate_mesh` to `LocalSteps` (one round per
sync) or to `Dion` / `SignMuon` (one round per step). torchft provides the membership (lighthouse,
quorum, should_commit, healing, a reconfigured process group); shardopt the exchange.

    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(timeout=…), min_replica_size=2,
                              use_async_quorum=False, load_state_dict=None, state_dict=None, …)
    opt = shardopt.LocalSteps(inner, replicate_mesh=manager, sync_every=10, exchange="sign_mean")
    shardopt.torchft.join(opt)          # before the first batch: heal and meet the others' next sync
    ...                                 # train as usual; opt.replicate.rounds logs every round

Modules: axis.py (ManagerAxis: the process group round by round, the round protocol), heal.py (what a
joining replica receives), steps.py (per-step rollback), join.py, checks.py, internals.py. torchft is
imported lazily: nothing here imports it until a Manager is given.
"""

from .checks import check_min_replicas
from .join import join


def summary(optimizer) -> dict:
    """Rounds committed / discarded, heals and their bytes, bytes per committed round by replica count."""
    axis = optimizer.replicate
    rounds = [r for r in getattr(axis, "rounds", []) if not r["join"]]
    by_m: dict = {}
    for entry in rounds:
        if entry["committed"] and entry["contributors"] == entry["replicas"]:
            by_m[entry["replicas"]] = entry["bytes_sent"]   # the last: the first also carries one-off checks
    healing = getattr(axis, "healing", None)
    return {"rounds_committed": sum(r["committed"] for r in rounds),
            "rounds_discarded": sum(not r["committed"] for r in rounds),
            "bytes_per_round_by_replicas": by_m,
            "heals": getattr(healing, "heals", 0), "heal_bytes_received": getattr(healing, "received_bytes", 0),
            "heal_bytes_sent": getattr(healing, "sent_bytes", 0)}


__all__ = ["check_min_replicas", "join", "summary"]
