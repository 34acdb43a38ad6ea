"""The exchange during backward (docs/design.md §12): a step's bucket steps start while backward
still runs, each as soon as every gradient it reads is final, and write into scratch; step() waits
for them and commits, or discards the lot.

A step's work is a `Round`: the units of every group's plan (plan.py: the buckets of a matrix group,
the whole of an element-wise group) for the params that stepped at the previous step (at first: those
with requires_grad), in backward order (`plan.backward_order`). Both are functions of the params and the
settings only, so every rank holds the same units in the same order, and `schedule.Schedule` makes
every rank issue the same collectives in the same order, however the hooks' timing differs.

- A param's gradient is final when its post-accumulate-grad hook runs: autograd runs it after it
  wrote `.grad` (plain params, and DDP's, whose reducer copies the bucket back into `.grad` at the
  end of backward: with shardopt.ddp's comm hook, the same values); FSDP2 (torch 2.13,
  torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, `foreach_reduce`) runs the sharded
  param's hooks right after it assigned (or accumulated into) the reduce-scattered sharded `.grad`.
- The round then takes `Schedule`'s next actions that do not block: a unit starts once its
  gradients are final and every unit before it has started; a wait is taken once its collective
  has completed.
- Scratch (`Scratch`): a unit steps copies of its params and of their state (the step count one
  ahead, fresh state for a param stepping the first time); nothing the optimizer holds changes.
- step(): `finish` takes the rest of the actions, blocking; a unit whose gradients did not arrive
  reads them then (zeros where a param has none here, as every step reads a param that has a
  gradient only on other ranks). So every rank runs every unit of the round: each collective some
  rank started during backward is matched on every other, in the same place of the sequence.
"""

from __future__ import annotations


import torch

from ..layout.placement import local
from ..optim.schedule import Schedule


def gradient_snapshot(grad) -> tuple:
    """What identifies the gradient a step reads (`param.grad`, or one handed to `Round.arrive`): the
    object and its version counters (its own and, for a DTensor, its local tensor's): any in-place
    change or reassignment changes them."""
    if grad is None:
        return (None,)
    return grad, grad._version, local(grad)._version


class Scratch:
    """Copies of the params and state a round's units write, made when a unit first reads them.

    state: the optimizer's state (param → dict); new_state(param) → a param's initial state (step 0);
    position(param) → its index in the optimizer's params (fresh state is committed in that order, as the
    step after backward creates it, so the state dict's order does not depend on the backward order)."""

    def __init__(self, state: dict, new_state, position):
        self._state, self._new_state, self._position = state, new_state, position
        self._params: dict = {}
        self._states: dict = {}
        self._fresh: dict = {}

    def param(self, param) -> torch.Tensor:
        """A copy of the param's local tensor, which the units update."""
        if param not in self._params:
            self._params[param] = local(param).clone()
        return self._params[param]

    def state(self, param) -> dict:
        """The param's local state tensors as the step would leave them: copies, the step count one
        ahead (a first step: fresh state, held here until commit)."""
        if param not in self._states:
            if self._state.get(param):
                copies = {key: local(value).clone() for key, value in self._state[param].items()}
            else:
                fresh = self._fresh[param] = self._new_state(param)
                copies = {key: local(value) for key, value in fresh.items()}
            copies["step"] += 1
            self._states[param] = copies
        return self._states[param]

    def tensors(self) -> list:
        """Every tensor the units wrote (the param copies, the state copies and fresh state)."""
        return [*self._params.values(), *(value for copies in self._states.values() for value in copies.values())]

    def commit(self) -> None:
        """Copy every scratch tensor into the param or state tensor it stands for."""
        for param, copy in self._params.items():
            local(param).copy_(copy)
        for param, copies in self._states.items():
            if param not in self._fresh:
                for key, value in self._state[param].items():
                    local(value).copy_(copies[key])
        for param in sorted(self._fresh, key=self._position):   # (their copies are the fresh tensors)
            self._state[param] = self._fresh[param]


class Round:
    """One step's units during backward (see the module doc).

    units: the params each unit reads (plan.unit_params), in backward order; steps: one step generator per unit, drawn
    lazily in that order (their reads go to `scratch`, and a param's gradient is `delivered[param]` where
    `arrive` was handed one, else `.grad`); planned: the set of params the plans were made for; settings: the
    groups' settings when it was made (step() compares them); depth: units in flight; streams: where the
    units run (streams.RoundStreams: a side stream of their own on CUDA); delivered: the dict `steps` read handed-over gradients from, which `arrive` fills."""

    def __init__(self, units: list, steps, scratch: Scratch, planned: set, settings: list, depth: int,
                 streams, delivered: dict):
        self.planned, self.settings, self.scratch, self.streams, self.delivered = planned, settings, scratch, streams, delivered
        self._waiting = []
        self._units_of: dict = {}
        for index, params in enumerate(units):
            self._waiting.append(len(params))
            for param in params:
                self._units_of.setdefault(param, []).append(index)
        self._arrived: dict = {}
        self.accumulated_again = False
        self.snapshot_queued = False
        self._schedule = Schedule(steps, depth)

    def _ready(self, index: int) -> bool:
        return index >= len(self._waiting) or self._waiting[index] == 0

    def arrive(self, param, grad: torch.Tensor | None = None) -> None:
        """`param`'s gradient is final: start what can start, advance what has its collective back.
        grad: the gradient, where it is not (yet) `param.grad` (ZeRO 2 under DeepSpeed: the node mean,
        which `.grad` is set to after backward); step() then needs `param.grad` to be that very tensor."""
        if param in self._arrived:      # a second backward into the same gradient, outside accumulating()
            self.accumulated_again = True
            return
        if grad is not None:
            self.delivered[param] = grad
        self._arrived[param] = gradient_snapshot(grad if grad is not None else param.grad)
        self.streams.reads([local(grad if grad is not None else param.grad)])
        for index in self._units_of.get(param, ()):
            self._waiting[index] -= 1
        with self.streams.work(), torch.no_grad():
            self._schedule.run(self._ready)

    def snapshot_gradients(self) -> None:
        """At the end of backward: record the gradients as backward left them (DDP copies its buckets
        back into `.grad` after the hooks ran: the same values, a new version); a delivered gradient
        keeps the snapshot it arrived with."""
        self.snapshot_queued = False
        for param in self._arrived:
            if param not in self.delivered:
                self._arrived[param] = gradient_snapshot(param.grad)

    def finish(self) -> None:
        """Run every unit that is left to its end (blocking); then the caller's stream waits for the units and
        owns the scratch (streams.RoundStreams.join), before a commit, a discard or a rerun touches it."""
        with self.streams.work(), torch.no_grad():
            self._schedule.run()
        self.streams.join(self.scratch.tensors())

    def started(self) -> int:
        return self._schedule.started

    def stale(self, settings: list) -> str | None:
        """Why the work of this round is not what step() would compute now, or None: a gradient
        accumulated into after it was read, or changed since backward ended, or group settings
        changed since the round began (`settings`: the groups' settings now)."""
        if self.accumulated_again:
            return "a second backward accumulated into gradients whose exchange had started"
        changed = [param for param, snapshot in self._arrived.items()
                   if not _unchanged(snapshot, param.grad, self.delivered.get(param))]
        if changed:
            return "gradients changed between backward and step() (clipping, unscaling, or a reassignment)"
        if settings != self.settings:
            return "param-group settings (e.g. lr) changed between backward and step()"
        return None


def _same(before: tuple, now: tuple) -> bool:
    return before[0] is now[0] and before[1:] == now[1:]


def _unchanged(snapshot: tuple, grad, delivered) -> bool:
    """Whether `grad`, the gradient step() reads, is the one the round read (`snapshot` of it): the same
    tensor at the same version or, for a delivered gradient that is itself untouched since, a tensor of
    equal values (DeepSpeed's fp16/bf16 wrapper makes the master copy's gradient anew in its step)."""
    if _same(snapshot, gradient_snapshot(grad)):
        return True
    return (delivered is not None and grad is not None and _same(snapshot, gradient_snapshot(delivered))
            and delivered.dtype == grad.dtype and delivered.shape == grad.shape
            and torch.equal(local(delivered), local(grad)))

