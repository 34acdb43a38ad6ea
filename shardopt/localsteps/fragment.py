"""A fragment of the params and its sync (docs/design.md §10), in the shape of torchft's streaming-DiLoCo
fragment: it owns its params, its exchange format (with the format's own state, "lowrank"'s Q) and its
exchange in flight. The outer state of each param (state.py) is read and written through `states`.

A sync is four moves on the fragment's params, x and Δ̄ flat (n,) fp32 over their local tensors:

    start()    x = (θ_start − θ) + e, and the exchange of x begins        (θ_start: θ_outer without overlap)
    advance()  one collective further; at the exchange's end its result is kept:
               (Δ̄, e ← x − own where lossy, discard = non-finite x on some rank, agreed)
    finish()   advance to the end
    apply()    unless discarded: e ← the kept e;  b ← μ·b + Δ̄;  θ_outer ← θ_outer − lr·(Δ̄ + μ·b | b)

Without overlap a sync is start, finish, apply, then θ ← θ_outer (`settle`, at the end of a run: the same, the
apply without the momentum). With overlap the exchange started at
a sync runs during the next round (one `advance` per inner step) and its result is kept in the outer
state (pending_*, so a checkpoint holds it); the next sync finishes it, applies it and starts its own:
θ ← θ_outer + (θ − θ_start) (θ ← θ_outer when the applied round was discarded), θ_start ← θ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from ..layout.placement import local
from ..wire.comm import Axis
from ..wire.seeds import mix_seed
from .checks import SyncChecks
from .formats import OuterFormat

PENDING_NONE, PENDING_APPLY, PENDING_DISCARD = 0, 1, 2   # OuterState.pending


def split_fragments(params: list, fragments: int) -> list[list]:
    """The params cut into F fragments in param order: a param goes to fragment ⌊F·r/total⌋ (at most F−1),
    r the element count of the params before it (global sizes: the same cut on every rank)."""
    total, running, parts = sum(p.numel() for p in params), 0, [[] for _ in range(fragments)]
    for param in params:
        parts[min(fragments - 1, running * fragments // max(total, 1))].append(param)
        running += param.numel()
    return parts


def sync_offset(fragment: int, fragments: int, sync_every: int) -> int:
    """Fragment f syncs at the steps t with t mod H = ⌊(f+1)·H/F⌋ mod H (the last at multiples of H)."""
    return (fragment + 1) * sync_every // fragments % sync_every


class OuterSGD(NamedTuple):
    """The outer optimizer, torch.optim.SGD's rule with dampening 0 and Δ̄ as the gradient, in place, fp32
    math, shapes alike (n,): b ← μ·b + Δ̄;  d = Δ̄ + μ·b (nesterov) or b;  θ_outer ← θ_outer − lr·d.
    Without a momentum buffer (μ = 0): d = Δ̄."""

    lr: float
    momentum: float
    nesterov: bool

    def step(self, theta_outer: torch.Tensor, buffer: torch.Tensor | None, mean_delta: torch.Tensor) -> None:
        direction = mean_delta
        if buffer is not None:
            momentum = buffer.float().mul_(self.momentum).add_(mean_delta)
            buffer.copy_(momentum)
            direction = mean_delta + self.momentum * momentum if self.nesterov else momentum
        theta_outer.copy_(theta_outer.float() - self.lr * direction)


class Ownership(NamedTuple):
    """Which params this rank syncs and keeps outer state for. owns(slot): param `slot` (param order) is
    this rank's; `axes`: the axes the owners split the params over (a discard is agreed over them too,
    also by a rank that owns none of a fragment); after_sync(): run after every sync. EVERY_PARAM: all of
    them; DeepSpeed ZeRO 1/2: the params this rank of the node owns (the same slots on every node), the
    node axis, the node's gathering of the synced params."""

    owns: Callable[[int], bool]
    axes: tuple[Axis, ...]
    after_sync: Callable[[], None]

    def slots(self, count: int) -> list[int]:
        """The slots of `count` params that this rank owns."""
        return [slot for slot in range(count) if self.owns(slot)]


EVERY_PARAM = Ownership(owns=lambda slot: True, axes=(), after_sync=lambda: None)


class SyncSettings(NamedTuple):
    """What every fragment's sync shares: the replicate axis, the outer SGD, the sync checks, the seed of
    the vote's coins, the fragment count F and whether exchanges overlap the next round."""

    replicate: Axis
    outer: OuterSGD
    checks: SyncChecks
    seed: int
    fragments: int
    overlap: bool


@dataclass
class Flight:
    """An exchange under way: its generator of collectives, the collective it waits on, its x and params."""

    exchange: object
    x: torch.Tensor
    params: list
    pending: object = None


class Fragment:
    """Params synced together at the same steps, their exchange format and their exchange in flight
    (module docstring). `states`: param → OuterState (LocalSteps.state)."""

    def __init__(self, index: int, params: list, states, fmt: OuterFormat, settings: SyncSettings):
        self.index, self.params, self.states, self.format, self.settings = index, params, states, fmt, settings
        self.flight: Flight | None = None
        self.kept: tuple | None = None   # without overlap: (Δ̄, e, discard) of the exchange just finished
        self.settled_at = -1             # the step of its last settle (finish.py), -1 before one

    def sync(self, step: int) -> None:
        """This fragment's sync at `step` (module docstring)."""
        if self.settings.overlap:
            self.finish(step)                                   # the exchange started at the last sync
            discarded = int(self.states[self.params[0]].pending) == PENDING_DISCARD
            self.apply()
            self.start(step)
            self.advance(step)
            self._set_params(lambda state, param: self._outer_plus_progress(state, param, discarded))
        else:
            self.start(step)
            self.finish(step)
            self.apply()
            self._set_params(lambda state, param: local(state.params))

    def settle(self, step: int) -> None:
        """A sync at `step`, off the schedule, that leaves θ = θ_outer (the end of a run, finish.py): without
        overlap start, finish, apply; with overlap `sync` (the exchange in flight applied, the progress since it
        began sent), then that exchange finished and applied at once, nothing pending; then θ ← θ_outer. The
        round it ends is applied without the outer momentum (d = Δ̄, b kept): no later round carries it on, and
        with it a part round's Δ̄ is pushed by (1 + μ) and b by μ² (Nesterov), which overshoots — measured with
        μ 0.6 at the end of a 200-step run, H 30: val loss 5.91 and 7.31 against 5.29 and 5.23 unsynced)."""
        if self.settings.overlap:
            self.sync(step)
        else:
            self.start(step)
        self.finish(step)
        self.apply(momentum=False)
        self._set_params(lambda state, param: local(state.params))
        if self.settings.overlap:
            for param in self.params:
                self.states[param].pending.fill_(PENDING_NONE)
        self.settled_at = step

    def start(self, step: int) -> None:
        """x = (θ_start − θ) + e over the params; the double-averaging check; the exchange of x begins."""
        if not self.settings.overlap:
            self.settings.replicate.begin_round()   # torchft: the round's quorum (shardopt/torchft/axis.py)
        x = torch.cat([self._pseudo_gradient(param).reshape(-1).float() for param in self.params])
        x = self.settings.replicate.contribution(x)   # torchft: zeros while this replica heals
        self.settings.checks.check_double_averaging([x], step, in_round=True)
        seed = mix_seed(self.settings.seed, int(self.states[self.params[0]].rounds) * self.settings.fragments
                        + self.index)   # the vote's coins of this round of this fragment, equal on every replica
        self.flight = Flight(self.format.exchange(x, self.settings.replicate, seed), x, self.params)

    def advance(self, step: int) -> None:
        """Resume the exchange with its last collective's result, up to its next collective or its end."""
        flight = self.flight
        try:
            flight.pending = flight.exchange.send(None if flight.pending is None else flight.pending.wait())
        except StopIteration as stop:
            self.flight = None
            self._keep(flight, *stop.value, step)

    def finish(self, step: int) -> None:
        while self.flight is not None:
            self.advance(step)

    def apply(self, momentum: bool = True) -> None:
        """The kept result, unless there is none or its round is discarded: e ← its e, the outer SGD step
        (without `momentum`: d = Δ̄, the buffer b unchanged)."""
        if self.settings.overlap:
            if int(self.states[self.params[0]].pending) != PENDING_APPLY:
                return
            mean = self._flat(lambda state: state.pending_mean)
            error = self._flat(lambda state: state.pending_error) if self.format.lossy else None
        else:
            (mean, error, discard), self.kept = self.kept, None
            if discard:
                return
        outer = self.settings.outer
        if error is not None:
            self._scatter(error, self.params, lambda state, piece: local(state.error).copy_(piece))
        self._scatter(mean, self.params, lambda state, piece: outer.step(
            local(state.params), None if state.momentum is None or not momentum else local(state.momentum),
            piece.to(local(state.params).device)))

    def drop(self) -> None:
        """Forget the exchange in flight and any kept result (a state dict was loaded)."""
        self.flight, self.kept = None, None

    def _keep(self, flight: Flight, mean, own, nonfinite, step: int) -> None:
        """The exchange's end: agree on the discard, keep the format's state (Q) of a kept round, keep the result."""
        discard = self.settings.checks.discard(nonfinite, len(flight.params), step)
        if not self.settings.overlap:   # torchft: committed only where every replica's should_commit agrees
            discard = not self.settings.replicate.end_round(not discard)
        if not discard:
            self.format.commit()
        error = flight.x - own if self.format.lossy else None
        if not self.settings.overlap:
            self.kept = (mean, error, discard)
            return
        self._scatter(mean, flight.params, lambda state, piece: local(state.pending_mean).copy_(piece))
        if error is not None:
            self._scatter(error, flight.params, lambda state, piece: local(state.pending_error).copy_(piece))
        for param in flight.params:
            self.states[param].pending.fill_(PENDING_DISCARD if discard else PENDING_APPLY)

    def _pseudo_gradient(self, param) -> torch.Tensor:
        """(θ_start − θ) + e for one param (θ_start: θ_outer without overlap), fp32 on the param's device."""
        state = self.states[param]
        start = state.start if self.settings.overlap else state.params
        delta = local(start).to(local(param).device).float() - local(param).float()
        return delta + local(state.error).to(delta.device).float() if self.format.lossy else delta

    def _outer_plus_progress(self, state, param, discarded: bool) -> torch.Tensor:
        """θ_outer + (θ − θ_start), or θ_outer for a discarded round; θ_start ← the new θ after."""
        outer = local(state.params).to(local(param).device).float()
        progress = local(param).float() - local(state.start).to(outer.device).float()
        return outer if discarded else outer + progress

    def _set_params(self, value) -> None:
        """θ ← value(state, param) for each param (θ_start ← θ too with overlap); the round is over."""
        for param in self.params:
            state = self.states[param]
            local(param).copy_(value(state, param))
            if self.settings.overlap:
                local(state.start).copy_(local(param))
            state.rounds += 1

    def _flat(self, tensor_of) -> torch.Tensor:
        return torch.cat([local(tensor_of(self.states[param])).reshape(-1).float() for param in self.params])

    def _scatter(self, flat: torch.Tensor, params: list, write) -> None:
        """write(state, piece) for each param's piece of `flat`, shaped like its local tensor."""
        for param, piece in zip(params, flat.split([local(p).numel() for p in params])):
            write(self.states[param], piece.view(local(param).shape))
