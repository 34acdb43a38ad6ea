"""Healing: what a replica that joins or rejoins receives from a live peer (docs/design.md §13).

torchft calls `save` on a live replica inside its quorum and `load` on the joining one inside its own
(synchronous quorum: before the round's exchange). The payload, one group rank's pieces (each shard
rank heals from the same shard rank of the peer):

    optimizer   the optimizer's state_dict(): LocalSteps: θ_outer, outer momentum b, lowrank Q, the
                round and step counts (the vote's coin seeds follow from them) and the inner
                optimizer's state; Dion / Sign-Muon: momenta, Q, step counts
    params      the params (per-step optimizers only: LocalSteps sets θ ← θ_outer at the round's end)
    counters    what decides which collectives a step issues (the double-averaging schedule): the
                optimizer's `heal_counters` (wire/rounds.HealCounters), saved and loaded by their owner
    format      FORMAT, the payload's layout: a joiner refuses a peer's payload of another format (a group
                of another shardopt version) before it changes anything

Left out: the error feedback e. It is a replica's own residual (what the wire dropped from *its* x);
a copy of a peer's would be carried into the next sync twice, so a healed replica starts with e = 0.
DTensors travel as their local pieces and are rebuilt on the params' mesh; every tensor is cloned when
saved, so the peer's round goes on while the joiner downloads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ..layout.placement import is_dtensor, local
from ..localsteps.state import ERROR_KEY
from .internals import serves_key

KEY = "shardopt"
FORMAT = 1   # the payload's layout (module docstring); raise it when a key above changes


@dataclass
class _Piece:
    """A DTensor's local piece and how to rebuild it."""

    tensor: torch.Tensor
    placements: tuple
    shape: torch.Size
    stride: tuple


def to_wire(value):
    """Nested dicts / lists of tensors → the same with every tensor cloned, DTensors as _Piece."""
    if is_dtensor(value):
        return _Piece(local(value).detach().clone(), tuple(value.placements), value.shape, value.stride())
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: to_wire(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_wire(item) for item in value)
    return value


def from_wire(value, mesh):
    """Inverse of to_wire, DTensors rebuilt on `mesh` (the receiving rank's)."""
    if isinstance(value, _Piece):
        return DTensor.from_local(value.tensor, mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride)
    if isinstance(value, dict):
        return {key: from_wire(item, mesh) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(from_wire(item, mesh) for item in value)
    return value


def tensor_bytes(value) -> int:
    """Bytes of the tensors in a wire payload."""
    if isinstance(value, _Piece):
        value = value.tensor
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


def _without_error(state_dict: dict) -> dict:
    return {**state_dict, "state": {index: {key: value for key, value in entry.items() if key != ERROR_KEY}
                                    for index, entry in state_dict["state"].items()}}


class Healing:
    """The manager's state-dict functions for one optimizer (module docstring); counts the bytes."""

    def __init__(self, manager, owner, per_step: bool):
        if serves_key(manager, KEY):
            raise ValueError("this torchft.Manager already serves a shardopt optimizer; build one manager per "
                             "optimizer (LocalSteps: pass the manager to LocalSteps only, not to its inner optimizer)")
        if not hasattr(type(owner), "heal_counters"):   # (on the class: the owner attaches before it holds them)
            raise TypeError(f"{type(owner).__name__} cannot heal from a torchft peer: it has no heal_counters "
                            f"(a shardopt.wire.rounds.HealCounters)")
        self.owner, self.per_step = owner, per_step
        self.sent_bytes = self.received_bytes = self.heals = 0
        manager.register_state_dict_fn(KEY, self.load, self.save)

    def _params(self) -> list:
        return [p for group in self.owner.param_groups for p in group["params"]]

    @torch.no_grad()
    def save(self) -> dict:
        state_dict = self.owner.state_dict()
        payload = {"optimizer": to_wire(_without_error(state_dict)),
                   "counters": self.owner.heal_counters.save_counters(), "format": FORMAT}
        if self.per_step:
            payload["params"] = [to_wire(local(p)) for p in self._params()]
        self.sent_bytes += tensor_bytes(payload)
        return payload

    @torch.no_grad()
    def load(self, payload: dict) -> None:
        if payload.get("format") != FORMAT:
            raise ValueError(f"a peer sent a heal payload of format {payload.get('format', 'none (shardopt 0.3)')}, "
                             f"this replica reads format {FORMAT}: every replica group must run the same shardopt "
                             f"version; install one version everywhere and restart the groups")
        params = self._params()
        mesh = next((p.device_mesh for p in params if is_dtensor(p)), None)
        self.owner.load_state_dict(from_wire(payload["optimizer"], mesh))
        for param, piece in zip(params, payload.get("params", ())):
            local(param).copy_(piece)
        for entry in self.owner.state.values():   # e = 0: a replica's own residual (module docstring)
            if ERROR_KEY in entry:
                local(entry[ERROR_KEY]).zero_()
        self.owner.heal_counters.load_counters(payload["counters"])
        self.received_bytes += tensor_bytes(payload)
        self.heals += 1
        self.owner.replicate.healed = True
