"""What a checkpoint needs the replicas to agree on: the momenta each replica keeps for itself.

A record's `decoupled_momentum` (Dion's M, Sign-Muon's and Lion's momentum) is the replica's own; a
checkpoint saved on one replica would restore that replica's only. Before saving, every replica takes the
mean over the replicate axis, so the checkpoint holds momenta every replica agrees on (AdamW's moments come
from averaged gradients and are alike already).
"""

from __future__ import annotations

from ..algorithms import registry
from ..layout.placement import local
from ..wire.comm import Axis, complete
from ..wire.exchange import MEAN


def average_decoupled_momenta(groups: list[dict], state: dict, replicate: Axis) -> None:
    """In place: each record's `decoupled_momentum` of every param with state in `groups` ← its mean over
    `replicate` (one all-reduce per dtype, exchange.MEAN)."""
    momenta = [local(state[p][key]) for group in groups
               if (key := registry.algorithm(group["algorithm"]).decoupled_momentum)
               for p in group["params"] if state.get(p)]
    if momenta:
        for momentum, mean in zip(momenta, complete(MEAN.tensors(momenta, replicate))):
            momentum.copy_(mean)
