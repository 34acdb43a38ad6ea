"""overlap_backward (docs/design.md §12): the one object a ShardOptimizer holds while its exchange runs
during backward (`optimizer.backward_overlap`; None while it is off).

`BackwardOverlap` owns what the feature adds to the optimizer: a post-accumulate-grad hook on each param
that can have a gradient, the current `Round` (round.py) and the params the next round plans for, the
accumulation switches (`accumulating()`, DDP models whose no_sync() counts as accumulation), and `step`:
finish the round, agree, then commit its scratch or run the step in place. The units are the optimizer's
bucket steps (optim/steps.py), run into scratch; the agreement is the optimizer's; so nothing here changes
the optimizer's params or state but a commit or the in-place step.

`switched` is the `overlap_backward` setter: it checks the switch, gives the bucket steps process
groups of their own the first time it is turned on, and makes the object anew, so turning it on again,
copying the optimizer or loading a state dict starts from a fresh one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref

import torch

from ..internals import execution_engine
from ..optim.checks import check_gradients
from ..optim.plan import unit_params
from ..optim.steps import bucket_steps, new_state, run_in_place
from ..wire.comm import Axes
from .round import Round, Scratch
from .streams import streams_for

logger = logging.getLogger("shardopt")


def switched(optimizer, value: bool) -> BackwardOverlap | None:
    """What `optimizer.backward_overlap` becomes on `optimizer.overlap_backward = value`: a new object of the
    optimizer's `backward_overlap_type` (its hooks on every param) for True, None for False; the old one's
    hooks removed. ValueError for a value that is not a bool or that the optimizer refuses (`refusal`),
    RuntimeError while this backward's exchange has started. The first time it is turned on, the bucket
    steps get process groups of their own (`comm.Axis.private`, a collective over the world), kept after."""
    if not isinstance(value, bool):
        raise ValueError(f"Invalid overlap_backward: {value!r}; it must be True or False (the default)")
    kind = optimizer.backward_overlap_type
    if value and (refusal := kind.refusal(optimizer)) is not None:
        raise ValueError(refusal)
    current = optimizer.backward_overlap
    if current is not None and current.started():
        raise RuntimeError("overlap_backward can change only between step() and the next backward: this "
                           "backward's exchange has started; call step() first")
    if value and optimizer.bucket_step_axes is optimizer.axes:
        optimizer.bucket_step_axes = Axes(*(axis.private() for axis in optimizer.axes))
    if current is not None:
        current.detach()
    return kind(optimizer) if value else None


class BackwardOverlap:
    """The exchange during backward of one optimizer (see the module doc). It holds the optimizer through a
    weak proxy and the params' hooks hold it through a weak reference, so neither keeps the optimizer alive."""

    def __init__(self, optimizer):
        self.optimizer = weakref.proxy(optimizer)
        self.round: Round | None = None     # this backward's, from the first final gradient to step()
        self.planned: set | None = None     # the params the next round plans for (the last step's, agreed)
        self._accumulating = 0
        self._no_sync_models: list = []
        self._warned_stale = False
        self.streams = None                 # where rounds run (streams.streams_for, made at the first round)
        self._hooks: list = []
        self.hook([p for group in optimizer.param_groups for p in group["params"]])

    @classmethod
    def refusal(cls, optimizer) -> str | None:
        """Why overlap_backward=True cannot be set on `optimizer`, or None."""
        if optimizer.max_norm > 0:
            return (f"overlap_backward=True needs max_grad_norm=0 (got {optimizer.max_norm:g}): clipping scales every "
                    f"gradient by min(1, max_grad_norm/ν), and ν, the global norm, is known only after backward, "
                    f"before which no bucket's direction can start; pass overlap_backward=False to clip, or "
                    f"max_grad_norm=0 to overlap")
        return None

    def check_clipping(self, max_norm: float) -> None:
        """RuntimeError for clipping by max_norm > 0 (ShardOptimizer.clip_grad_norm_): the exchange during backward
        has read the gradients already; max_norm 0 (reading the norm only) passes."""
        if max_norm > 0:
            raise RuntimeError("clip_grad_norm_ with overlap_backward=True: the exchange during backward has read the "
                               "gradients before they could be clipped; set optimizer.overlap_backward = False (every "
                               "rank) to clip, or pass max_grad_norm= when building the optimizer")

    # ---- gradients arriving -------------------------------------------------------------------------
    def hook(self, params) -> None:
        """A post-accumulate-grad hook on each of `params` that can have a gradient."""
        overlap = weakref.ref(self)

        def final(param):
            if (live := overlap()) is not None:
                live.gradient_final(param)
        self._hooks += [p.register_post_accumulate_grad_hook(final) for p in params if p.requires_grad]

    def detach(self) -> None:
        """Remove the hooks (overlap_backward turned off or set again, or the optimizer's state set anew)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def gradient_final(self, param, grad: torch.Tensor | None = None) -> None:
        """`param`'s gradient is final (its hook, or the DeepSpeed wiring handing over `grad`, the gradient
        step() will read where that is not yet `.grad`): unless accumulating, the round learns it (Round.arrive)."""
        if not self.taking_gradients():
            return
        round_ = self._current_round()
        round_.arrive(param, grad)
        if not round_.snapshot_queued:
            engine = execution_engine()

            def after_the_others():   # runs after the callbacks queued before it, DDP's copy-back among them
                engine.queue_callback(round_.snapshot_gradients)
            try:
                engine.queue_callback(after_the_others)
                round_.snapshot_queued = True
            except RuntimeError:      # a hook called outside backward: the snapshot at arrival stands
                pass

    # ---- accumulation -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulating(self):
        """Gradients made inside are not final (ShardOptimizer.accumulating)."""
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def accumulate_under_no_sync(self, ddp_model) -> None:
        """Gradients made under `ddp_model.no_sync()` are not final (ShardOptimizer.accumulate_under_no_sync)."""
        if not any(model is ddp_model for model in self._no_sync_models):
            self._no_sync_models.append(ddp_model)

    def taking_gradients(self) -> bool:
        """Whether a gradient made now is final (not inside `accumulating()` or a registered `no_sync`)."""
        return not (self._accumulating or any(not model.require_backward_grad_sync for model in self._no_sync_models))

    # ---- the round ----------------------------------------------------------------------------------
    def started(self) -> int:
        """How many units of this backward's round have started (0 before its first final gradient)."""
        return self.round.started() if self.round is not None else 0

    def first_planned(self) -> set:
        """The params the first round plans for (later rounds: the last step's): those that can have a gradient."""
        return {p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad}

    def _current_round(self) -> Round:
        if self.round is None:
            optimizer = self.optimizer
            planned = self.planned if self.planned is not None else self.first_planned()
            scratch, delivered = Scratch(optimizer.state, functools.partial(new_state, optimizer),
                                         optimizer._param_index.__getitem__), {}
            units, steps = bucket_steps(optimizer, planned, scratch.param, scratch.state, delivered)
            if self.streams is None:   # a side stream of its own on CUDA, made once (streams.py)
                self.streams = streams_for(optimizer._device())
            self.round = Round([unit_params(plan, unit) for _, _, plan, unit in units], steps, scratch, planned,
                               self._group_settings(), optimizer.pipeline_depth, self.streams, delivered)
        return self.round

    def _group_settings(self) -> list:
        """Every group's settings but its params, as step() compares them with the round's (Round.stale)."""
        return [repr(sorted((k, v) for k, v in group.items() if k not in ("params", "param_names")))
                for group in self.optimizer.param_groups]

    def discard(self) -> None:
        """Run the rest of the round, so that every collective some rank started is matched, and drop its
        scratch (ShardOptimizer.discard_backward_work)."""
        if self.round is not None:
            round_, self.round = self.round, None
            round_.finish()

    def step(self, params: list) -> None:
        """ShardOptimizer.step's work: finish the round (every rank runs all its units, so every collective
        started during backward is matched), agree, then commit the scratch, or discard it (a skipped step;
        or a round planned for other params, or stale: the step then runs in place, as without overlap)."""
        optimizer = self.optimizer
        check_gradients(optimizer._param_label.items())     # before anything: a bad gradient raises, as without overlap
        round_, self.round = self._current_round(), None
        round_.finish()
        reason = round_.stale(self._group_settings())
        decision = optimizer._agreed(params, stale=reason is not None)
        if decision.params is None:
            return
        self.planned = decision.params
        if decision.params == round_.planned and not decision.stale:
            round_.scratch.commit()
            return
        if decision.stale and not self._warned_stale:
            self._warned_stale = True
            logger.warning("shardopt: overlap_backward: this step's exchange during backward was discarded and the "
                           "step ran again after backward (said once): %s. Run the inner micro-batches' backward "
                           "under optimizer.accumulating(), leave the gradients as backward made them, set lr before "
                           "backward, or build the optimizer with overlap_backward=False",
                           reason or "on another rank")
        run_in_place(optimizer, decision.params)
