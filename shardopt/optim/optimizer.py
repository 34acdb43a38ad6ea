"""The optimizer classes: validation, param groups, state and the step loop (no math, no collectives).

`ShardOptimizer` holds the mesh axes and routes each param group to its algorithm's record
(registry.py). A step reads: the pre-step agreement (agreement.py) → each group's plan (plan.py:
buckets of same-layout matrices, or the element-wise group, each with its exchange) → the bucket
steps, overlapped (schedule.py) → done: each bucket step commits its own params and state.

ShardOptimizer's keyword options (Dion and SignMuon take them all):

replicate_mesh: 1-D DeviceMesh or ProcessGroup of the data-parallel replicas whose gradients this
    optimizer exchanges itself (nobody else may average them), or None.
shard_mesh, tensor_mesh: 1-D DeviceMesh (or ProcessGroup) of the weight-parallel and the
    tensor-parallel axis, or None; derived from the params' placements when not given.
seed: seeds Dion's Q₀ and Sign-Muon's tie-breaking coins; must be equal on all ranks.
agreement_timeout_s: bound on the construction-time check that all ranks hold the same params and
    settings (a mismatch raises on every rank instead of hanging later).
nonfinite: "skip" (default): a NaN/inf gradient on any rank skips the step on every rank, no state
    changes, `skipped_steps` counts it and a warning is logged; "raise": FloatingPointError on every
    rank, state untouched. One all-reduce of one float per axis and one device sync per step.
max_grad_norm: clip by g ← g·min(1, max_grad_norm/(ν + 1e-6)), ν agreed by all ranks (clipping.py),
    so every replica and shard applies the same factor. 0 (default): no clipping.
maximize: step along +gradient (torch.optim's maximize), for every algorithm; a group default.
foreach, fused, capturable, differentiable: torch.optim options shardopt refuses with a TypeError
    that says what it does instead (None, the default, is accepted).
bucket_bytes: cap on a bucket's stacked working copy (fp32; fp64 for fp64 params), so a step's
    transient memory is O(bucket_bytes), not O(model) (buckets.py).
double_averaging_check_every: at step 1 and every this many steps after, raise
    `DoubleAveragingError` on every rank, state untouched, when all replicas' local gradients are
    bitwise identical: something averaged them already (DDP without no_sync(), FSDP2 HSDP's
    replicate all-reduce, the DeepSpeed engine's all-reduce; docs/design.md §9). 0 turns it off.
    Costs one all-reduce of 3 int64 on the replicate axis, one of 2 bytes on the other axes and
    one device sync, at those steps only (`traffic.double_averaging_check_bytes`).
overlap_backward: start each bucket's momentum → direction → exchange during backward, as soon as its
    gradients are final, and commit in step() (docs/design.md §12; results bitwise those of False).
    Default False (opt in): it costs a copy of the stepping params and their state until step() (the
    scratch) and process groups of the optimizer's own for its collectives (`comm.Axis.private`: turning
    it on is a collective over the whole world, every rank turns it on), and a step it skips or reruns has already spent its exchange. Not with
    max_grad_norm > 0 (clipping scales every gradient by a factor that needs the global norm, known
    only after backward: ValueError). Gradient accumulation: run the backward of every micro-batch but
    the last under `optimizer.accumulating()` (or, under DDP, under `model.no_sync()` after
    `optimizer.accumulate_under_no_sync(model)`). The DeepSpeed plugin takes it at ZeRO stage 0 in fp32
    without clipping (shardopt/deepspeed/optimizers.py). Settable between steps, alike on every rank.

Which params a step updates is agreed by all ranks: those with a gradient on at least one rank.
A rank without a local gradient for such a param steps it with a zero gradient (it joins the same
collectives); a param without a gradient on every rank is skipped everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch

from ..algorithms import registry
from ..overlap.round import Round, Scratch, backward_order
from ..layout.buckets import DEFAULT_BUCKET_BYTES
from .agreement import StepAgreement, check_ranks_agree, gradient_flag
from .checks import check_gradients, check_group_keys, check_options, keep_state_dtypes, loadable
from .clipping import clip_grad_norm_
from ..wire.comm import Axes, Axis
from ..wire.exchange import MEAN
from ..wire.seeds import mix_seed
from .guard import replicas_equal
from ..algorithms.hyperparams import follow_momentum_schedule, normalize_dtype_names, validate_group
from ..layout.matrices import param_matrices
from ..layout.placement import derive_meshes, local, tensor_split
from .plan import Plans, unit_params, unit_step, units
from .schedule import complete, overlap
from .traffic import DOUBLE_AVERAGING_CHECK_EVERY, describe, group_bytes

logger = logging.getLogger("shardopt")


class ShardOptimizer(torch.optim.Optimizer):
    """Base of Dion and SignMuon. Param groups choose their `algorithm` (registry.py); groups without
    one get the class's `matrix_algorithm`. Matrix groups take 2-D weights and 3-D expert stacks
    (E, m, n), and the option `split=(dim, sizes)` for fused projections (shardopt/layout/matrices.py).
    The keyword options are documented in this module's docstring."""

    matrix_algorithm = "dion"
    overlap_depth = 2   # bucket steps in flight: one bucket's collective overlaps the next one's compute

    def __init__(self, params, defaults: dict, *, replicate_mesh=None, shard_mesh=None, tensor_mesh=None, seed: int = 0,
                 agreement_timeout_s: float = 60.0, nonfinite: str = "skip", max_grad_norm: float = 0.0,
                 maximize: bool = False, foreach=None, fused=None, capturable=None, differentiable=None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 double_averaging_check_every: int = DOUBLE_AVERAGING_CHECK_EVERY, overlap_backward: bool = False):
        check_options(seed=seed, agreement_timeout_s=agreement_timeout_s, nonfinite=nonfinite,
                      max_grad_norm=max_grad_norm, maximize=maximize, bucket_bytes=bucket_bytes,
                      double_averaging_check_every=double_averaging_check_every, foreach=foreach, fused=fused,
                      capturable=capturable, differentiable=differentiable)
        self.bucket_bytes = bucket_bytes
        self.agreement = StepAgreement(nonfinite, double_averaging_check_every)
        self.seed = int(seed)
        self.max_norm = float(max_grad_norm)   # (the DeepSpeed plugin keeps its own max_grad_norm)
        self.last_grad_norm = None             # ν of the last clipped step (a 0-d tensor), for logging
        self._param_index: dict[torch.Tensor, int] = {}
        self._param_label: dict[torch.Tensor, str] = {}
        self._plans = Plans()
        self._overlap = False          # the exchange during backward (docs/design.md §12), set below
        super().__init__(params, {**registry.defaults(), **defaults, "maximize": maximize})
        meshes = derive_meshes(list(self._param_label.items()), replicate_mesh, shard_mesh, tensor_mesh)
        self.replicate, self.shard, self.tensor = self.axes = Axes(*(Axis(name, mesh) for name, mesh in
                                                                     zip(Axes._fields, meshes)))
        check_ranks_agree(self._param_label.items(), self.param_groups,
                          {"seed": self.seed, "bucket_bytes": bucket_bytes,
                           "double_averaging_check_every": double_averaging_check_every,
                           "overlap_backward": int(bool(overlap_backward))},
                          self.axes, agreement_timeout_s)
        self.exchange_axes = self.axes   # where the bucket steps' collectives go (private groups when overlapping)
        self._reset_overlap_runtime()
        self.overlap_backward = overlap_backward
        self.reset_comm_stats()
        self.replicate.attach(self, per_step=True)   # torchft: healing, a round per step (shardopt/torchft)

    skipped_steps = property(lambda self: self.agreement.skipped_steps)
    steps_called = property(lambda self: self.agreement.steps_called)
    nonfinite = property(lambda self: self.agreement.nonfinite)
    double_averaging_check_every = property(lambda self: self.agreement.double_averaging_check_every)

    # ---- param groups -------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        param_group.setdefault("algorithm", self.matrix_algorithm)
        if self.param_groups and "param_names" in self.param_groups[0] and "param_names" not in param_group:
            index = len(self.param_groups)   # torch.optim needs names in all groups or none
            param_group["param_names"] = [f"param_groups[{index}][{position}]"
                                          for position in range(len(list(param_group["params"])))]
        defaults = registry.defaults()
        explicit_keys = [key for key in param_group if key in defaults]
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        names = group.get("param_names") or [None] * len(group["params"])
        labels = [f"{name!r}" if name else f"#{position} of param group {index}" for position, name in enumerate(names)]
        try:
            check_group_keys(group, index, defaults)
            normalize_dtype_names(group)
            record = registry.algorithm(group["algorithm"], index)
            validate_group(group, index, record, registry.ALGORITHMS.values(), explicit_keys)
            for param, label in zip(group["params"], labels):
                if not param.dtype.is_floating_point:
                    raise ValueError(f"param {label} ({group['algorithm']!r}) has dtype "
                                     f"{param.dtype}; shardopt optimizes floating-point tensors only (float32, "
                                     f"float64, bfloat16, float16)")
                if record.matrix:
                    param_matrices(param, group, label)   # 2-D or 3-D, a `split` that fits (ValueError)
        except ValueError:
            self.param_groups.pop()   # a rejected group leaves nothing behind (docs/design.md §7)
            raise
        for param, label in zip(group["params"], labels):
            self._param_index[param] = len(self._param_index)
            self._param_label[param] = label
        if self._overlap:
            self._hook_gradients(group["params"])

    # ---- step ---------------------------------------------------------------------------------
    @torch.compiler.disable(reason="a shardopt step issues collectives and agrees on one host-read flag per step")
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        if self._overlap:
            self._step_after_backward(params)
            return loss
        decision = self.agreement.stepping(params, self._param_label, self.replicate, self.axes,
                                           self.agreement_axes(), self._device())
        if decision.params is None:
            return loss
        if self.max_norm > 0:
            self.last_grad_norm = self.clip_grad_norm_(self.max_norm)
        self._run_in_place(decision.params)
        return loss

    # ---- the bucket steps ---------------------------------------------------------------------
    def _units(self, stepping: set) -> list:
        """(group index, record, plan, unit) of every unit (plan.units) of the groups' plans for the
        params in `stepping`, in backward order (backward.backward_order); the same on every rank."""
        found = []
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p in stepping]
            if not params:
                continue
            record = registry.algorithm(group["algorithm"], index)
            follow_momentum_schedule(group, record.momentum)
            plan = self._plans.get(index, record, group, params, self.replicate.size, self.bucket_bytes, self._seed)
            found += [(index, record, plan, unit) for unit in units(plan)]
        return backward_order(found, self._param_index.__getitem__)

    def _unit_steps(self, units_: list, read_param, read_state, delivered: dict | None = None):
        """The step generator of each unit, made lazily; read_param / read_state: where a param's
        tensor and state are read and written (in place, or scratch); delivered: gradients handed to
        the round before they are `.grad` (backward.Round.arrive)."""
        readers = {}
        for index, record, plan, unit in units_:
            group = self.param_groups[index]
            gradient = readers.setdefault(index, _gradient_reader(group["maximize"], delivered))
            yield unit_step(record, group, plan, unit, read_param, gradient, read_state, self.exchange_axes,
                            lambda base, first: mix_seed(base, read_state(first)["step"]))

    def _new_state(self, param) -> dict:
        """A param's initial state (its record's, and a float32 step counter at 0, whatever the default dtype)."""
        index, group = next((i, g) for i, g in enumerate(self.param_groups) if any(p is param for p in g["params"]))
        state = registry.algorithm(group["algorithm"], index).init_state(param, group, self._seed(param))
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        return state

    def _run_in_place(self, stepping: set) -> None:
        """The step of the params in `stepping`, each unit writing its params and state in place."""
        for param in [p for group in self.param_groups for p in group["params"] if p in stepping]:
            state = self.state[param]     # every param gets state, also one with no local matrix
            if not state:
                state.update(self._new_state(param))
            state["step"] += 1
        overlap(self._unit_steps(self._units(stepping), local,
                                 lambda p: {key: local(value) for key, value in self.state[p].items()}),
                depth=self.overlap_depth)

    # ---- the exchange during backward (docs/design.md §12) -------------------------------------
    @property
    def overlap_backward(self) -> bool:
        """Whether bucket steps start during backward (see the module doc); set it between steps, alike on every rank."""
        return self._overlap

    @overlap_backward.setter
    def overlap_backward(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"Invalid overlap_backward: {value!r}; it must be True or False (the default)")
        if value and (refusal := self._overlap_refusal()) is not None:
            raise ValueError(refusal)
        if self._round is not None and self._round.started():
            raise RuntimeError("overlap_backward can change only between step() and the next backward: this "
                               "backward's exchange has started; call step() first")
        if value and self.exchange_axes is self.axes:
            self.exchange_axes = Axes(*(axis.private() for axis in self.axes))
        for handle in self._hooks:
            handle.remove()
        self._reset_overlap_runtime()
        self._overlap = value
        if value:
            self._hook_gradients([p for group in self.param_groups for p in group["params"]])

    def _overlap_refusal(self) -> str | None:
        """Why overlap_backward=True cannot be set on this optimizer, or None."""
        if self.max_norm > 0:
            return (f"overlap_backward=True needs max_grad_norm=0 (got {self.max_norm:g}): clipping scales every "
                    f"gradient by min(1, max_grad_norm/ν), and ν, the global norm, is known only after backward, "
                    f"before which no bucket's direction can start; pass overlap_backward=False to clip, or "
                    f"max_grad_norm=0 to overlap")
        return None

    def _reset_overlap_runtime(self) -> None:
        self._hooks: list = []
        self._round = None
        self._planned = None            # the params the next round plans for (the last step's, agreed)
        self._accumulating = 0
        self._no_sync_models: list = []
        self._warned_stale = False

    def _hook_gradients(self, params) -> None:
        """A post-accumulate-grad hook on each param that can have a gradient (a weak reference to the
        optimizer: the params do not keep it alive)."""
        optimizer = weakref.ref(self)

        def final(param):
            if (live := optimizer()) is not None:
                live._gradient_final(param)
        self._hooks += [p.register_post_accumulate_grad_hook(final) for p in params if p.requires_grad]

    @contextlib.contextmanager
    def accumulating(self):
        """Gradient accumulation with overlap_backward: run every micro-batch's backward but the last
        inside `with optimizer.accumulating():` (like DDP's no_sync) so that the exchange starts only
        once the gradients are whole. Without overlap_backward it does nothing."""
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def accumulate_under_no_sync(self, ddp_model) -> None:
        """Treat the backward of micro-batches run under `ddp_model.no_sync()` (a DistributedDataParallel)
        as accumulation (see `accumulating`): the frameworks (HF Trainer, Accelerate, Lightning) already
        run their inner micro-batches under it (shardopt.ddp.keep_local_gradients(model, optimizer) calls this)."""
        if not hasattr(ddp_model, "require_backward_grad_sync"):
            raise TypeError(f"accumulate_under_no_sync takes a torch DistributedDataParallel, got {type(ddp_model).__name__}")
        if not any(model is ddp_model for model in self._no_sync_models):
            self._no_sync_models.append(ddp_model)

    def _gradient_final(self, param, grad: torch.Tensor | None = None) -> None:
        """A param's post-accumulate-grad hook: unless accumulating, the round learns the gradient is final
        (grad: the gradient where it is not yet `.grad`, backward.Round.arrive)."""
        if not self._overlap or not self._taking_gradients():
            return
        round_ = self._current_round()
        round_.arrive(param, grad)
        if not round_.snapshot_queued:
            engine = torch.autograd.Variable._execution_engine

            def after_the_others():   # runs after the callbacks queued before it, DDP's copy-back among them
                engine.queue_callback(round_.snapshot_gradients)
            try:
                engine.queue_callback(after_the_others)
                round_.snapshot_queued = True
            except RuntimeError:      # a hook called outside backward: the snapshot at arrival stands
                pass

    def _taking_gradients(self) -> bool:
        """Whether a gradient made now is final (not inside `accumulating()` or a registered `no_sync`)."""
        return not (self._accumulating or any(not model.require_backward_grad_sync for model in self._no_sync_models))

    def discard_backward_work(self) -> None:
        """With overlap_backward, for a backward whose step() will not run (a step its caller skips, e.g.
        DeepSpeed's fp16/bf16 wrapper on an overflow, on every rank alike): run the rest of the round, so
        that every collective some rank started is matched, and drop its scratch (state and params untouched)."""
        if self._round is not None:
            round_, self._round = self._round, None
            round_.finish()

    def _current_round(self) -> Round:
        if self._round is None:
            planned = self._planned if self._planned is not None else self._first_planned()
            scratch, delivered = Scratch(self.state, self._new_state, self._param_index.__getitem__), {}
            units_ = self._units(planned)
            stream = torch.cuda.current_stream(self._device()) if self._device().type == "cuda" else None
            self._round = Round([unit_params(plan, unit) for _, _, plan, unit in units_],
                                self._unit_steps(units_, scratch.param, scratch.state, delivered), scratch, planned,
                                self._group_settings(), self.overlap_depth, stream, delivered)
        return self._round

    def _first_planned(self) -> set:
        """The params the first round plans for (later rounds: the last step's): those that can have a gradient."""
        return {p for group in self.param_groups for p in group["params"] if p.requires_grad}

    def _group_settings(self) -> list:
        return [repr(sorted((k, v) for k, v in group.items() if k not in ("params", "param_names")))
                for group in self.param_groups]

    def _step_after_backward(self, params: list) -> None:
        """step() with overlap_backward: finish the round (every rank runs all its units, so every
        collective started during backward is matched), agree, then commit the scratch, or discard it
        (a skipped step; or a round planned for other params, or stale: the step then runs in place,
        as overlap_backward=False would)."""
        check_gradients(self._param_label.items())     # before anything: a bad gradient raises, as without overlap
        round_, self._round = self._current_round(), None
        round_.finish()
        reason = round_.stale(self._group_settings())
        decision = self.agreement.stepping(params, self._param_label, self.replicate, self.axes,
                                           self.agreement_axes(), self._device(), stale=reason is not None)
        if decision.params is None:
            return
        self._planned = decision.params
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
        self._run_in_place(decision.params)

    def _seed(self, param) -> int:
        return mix_seed(self.seed, self._param_index[param])

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip every rank's local gradients in place by one agreed factor; returns the agreed norm ν
        (a 0-d tensor, no device sync). See `shardopt.optim.clipping.clip_grad_norm_`. Not with overlap_backward and
        max_norm > 0: the exchange during backward has read the gradients already (RuntimeError); max_norm 0
        reads the norm only."""
        if self._overlap and max_norm > 0:
            raise RuntimeError("clip_grad_norm_ with overlap_backward=True: the exchange during backward has read the "
                               "gradients before they could be clipped; set optimizer.overlap_backward = False (every "
                               "rank) to clip, or pass max_grad_norm= when building the optimizer")
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        return clip_grad_norm_([local(p.grad) for p in params], max_norm, replicate=self.replicate,
                               split=self.gradient_split_axes(), device=self._device(), tensor=self.tensor,
                               tensor_split=[tensor_split(p) for p in params])

    def gradient_split_axes(self) -> tuple[Axis, ...]:
        """The axes whose ranks hold disjoint pieces of one replica's gradient (clipping sums their squares)."""
        return (self.shard,)

    def replace_params(self, pairs) -> None:
        """Each (old, new): `new` takes `old`'s seed index, label and state (DeepSpeed's master copies)."""
        for old, new in pairs:
            self._param_index[new] = self._param_index.pop(old)
            self._param_label[new] = self._param_label.pop(old)
            if old in self.state:
                self.state[new] = self.state.pop(old)

    def nonfinite_anywhere(self, grads: list[torch.Tensor]) -> bool:
        """True on every rank alike when any rank of the agreement axes has a NaN/inf in `grads`."""
        return gradient_flag(grads, False, self.agreement_axes(), self._device()) == 2

    def agreement_axes(self) -> tuple[Axis, ...]:
        """The axes over which every rank must take the same branch of a step."""
        return self.axes

    def _device(self) -> torch.device:   # where this rank's small collectives live
        return local(self.param_groups[0]["params"][0]).device

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim's, after its pre-hooks and shardopt's checks (checks.loadable: nothing loads unless
        all fits); matrix-group state keeps its `state_dtype` (torch.optim casts to the param's dtype)."""
        state_dict = loadable(self, state_dict, registry.ALGORITHMS)
        hooks, self._optimizer_load_state_dict_pre_hooks = self._optimizer_load_state_dict_pre_hooks, {}
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = hooks
        keep_state_dtypes(self, state_dict, registry.ALGORITHMS)

    _RUNTIME = ("_plans", "_hooks", "_round", "_no_sync_models")   # rebuilt, not copied

    def __getstate__(self) -> dict:   # every setting, not only torch.optim's defaults, state, groups
        return {key: value for key, value in self.__dict__.items() if key not in self._RUNTIME}

    def __setstate__(self, state: dict) -> None:
        """A copy (deepcopy, pickle), or this optimizer itself in torch.optim's load_state_dict: then the
        hooks it holds are removed before its params get them again."""
        for handle in self.__dict__.get("_hooks", ()):
            handle.remove()
        super().__setstate__(state)
        self._plans = Plans()
        overlapping, self._overlap = self.__dict__.get("_overlap", False), False
        self._reset_overlap_runtime()
        if overlapping:   # the copy's params get their own hooks; the axes (and their groups) are shared
            self._overlap = True
            self._hook_gradients([p for group in self.param_groups for p in group["params"]])

    # ---- traffic ------------------------------------------------------------------------------
    def replicate_bytes_per_step(self, replicas: int | None = None) -> list[int]:
        """This rank's replicate-axis bytes per step per group at `replicas` (traffic.group_bytes); the
        non-finite check comes on top once per step, the double-averaging check at its steps."""
        replicas = self.replicate.size if replicas is None else replicas
        return [group_bytes(group, replicas, self.bucket_bytes, self.shard, self.tensor) for group in self.param_groups]

    def describe(self, replicas: int | None = None) -> str:
        """Each group's replicate-axis bytes per step, the whole model against DDP (traffic.describe)."""
        return describe(self.param_groups, self.replicate.size if replicas is None else replicas, self.bucket_bytes,
                        clipping=self.max_norm > 0, double_averaging_check_every=self.double_averaging_check_every,
                        shard=self.shard, tensor=self.tensor)

    def comm_stats(self) -> dict:
        """Bytes this rank sent/received and calls issued per axis since construction (or the last reset);
        with overlap_backward the bucket steps' own groups (`exchange_axes`) are counted in with their axis."""
        stats = {axis.name: dict.fromkeys(axis.stats(), 0) for axis in self.axes}
        for axis in self._distinct_axes():
            stats[axis.name] = {key: value + axis.stats()[key] for key, value in stats[axis.name].items()}
        return stats

    def reset_comm_stats(self) -> None:
        for axis in self._distinct_axes():
            axis.reset_stats()

    def _distinct_axes(self) -> list[Axis]:
        """The Axis objects of `axes` and `exchange_axes`, each once."""
        return list({id(axis): axis for axis in (*self.axes, *getattr(self, "exchange_axes", ()))}.values())

    @torch.no_grad()
    def synchronize_for_checkpoint(self) -> None:
        """Average each record's `decoupled_momentum` over the replicas (one all-reduce per dtype), so a
        checkpoint holds momenta every replica agrees on (AdamW's come from averaged gradients)."""
        momenta = [local(self.state[p][key]) for group in self.param_groups
                   if (key := registry.algorithm(group["algorithm"]).decoupled_momentum)
                   for p in group["params"] if self.state.get(p)]
        if momenta:
            for momentum, mean in zip(momenta, complete(MEAN.tensors(momenta, self.replicate))):
                momentum.copy_(mean)

    @torch.no_grad()
    def replicas_consistent(self) -> bool:
        """True when every parameter is bitwise equal on all replicas (guard.replicas_equal: one
        all-gather of one hash per parameter; reading the answer is a device sync)."""
        return replicas_equal([local(p) for group in self.param_groups for p in group["params"]], self.replicate)


def _gradient_reader(maximize: bool, delivered: dict | None = None):
    """param → the local gradient a step reads (`delivered[param]` where there is one, else `.grad`): g,
    or −g (a new tensor) when the group maximizes; zeros where this rank has none (another rank has one,
    so this rank still joins the bucket's collectives). Each param's is made once per step (a 3-D
    stack's matrices share it)."""
    read: dict = {}

    def gradient(param):
        if param not in read:
            grad = delivered.get(param, param.grad) if delivered else param.grad
            grad = local(grad) if grad is not None else torch.zeros_like(local(param))
            read[param] = -grad if maximize else grad
        return read[param]
    return gradient


class Dion(ShardOptimizer):
    """Dion (docs/design.md §1). Non-matrix params go in groups with algorithm "adamw" or "lion"
    (see `shardopt.param_groups`), which use lr, betas, epsilon and weight_decay ("lion" groups
    also `vote`, the wire format of their 1-bit vote). wire_dtype: torch.bfloat16 (default) or
    torch.float32, the precision of P and R on the replicate axis (rounded before the exchange).
    qr_method: "qr" (Householder, exact), "cholesky" or "rcqr" (randomized Cholesky-QR).
    state_dtype: dtype of the momentum and Q ("float32", "bfloat16", …; None: the param's).
    `options`: seed, agreement_timeout_s, nonfinite, max_grad_norm, maximize, bucket_bytes (see ShardOptimizer)."""

    matrix_algorithm = "dion"

    def __init__(self, params, lr: float = 0.01, mu: float = 0.95, rank_fraction: float = 1.0,
                 rank_multiple_of: int = 1, weight_decay: float = 0.01, epsilon: float = 1e-8,
                 qr_method: str = "qr", betas=(0.9, 0.95), wire_dtype=torch.bfloat16, vote: str = "auto",
                 state_dtype=None, *, replicate_mesh=None, shard_mesh=None, tensor_mesh=None, **options):
        defaults = dict(lr=lr, mu=mu, rank_fraction=rank_fraction, rank_multiple_of=rank_multiple_of,
                        weight_decay=weight_decay, epsilon=epsilon, qr_method=qr_method, betas=betas,
                        wire_dtype=wire_dtype, vote=vote, state_dtype=state_dtype)
        super().__init__(params, defaults, replicate_mesh=replicate_mesh, shard_mesh=shard_mesh,
                         tensor_mesh=tensor_mesh, **options)


class SignMuon(ShardOptimizer):
    """Sign-Muon (docs/design.md §2). vote: "allreduce_int8", "allgather_1bit", "alltoall_1bit" or "auto"
    (also the format of "lion" groups' vote). wire_dtype: precision of the shard-axis all-to-all of
    orthogonalize="full": torch.float32 (default, the exact Muon direction) or torch.bfloat16 (half
    the shard-axis bytes; only the signs of the result are used).
    state_dtype: dtype of the momentum ("float32", "bfloat16", …; None: the param's).
    compile: torch.compile the Newton–Schulz iterations (eager if compiling fails; off by default,
        on the CPU it slowed all but small matrices: results/compile.csv).
    `options`: seed, agreement_timeout_s, nonfinite, max_grad_norm, maximize, bucket_bytes (see ShardOptimizer)."""

    matrix_algorithm = "signmuon"

    def __init__(self, params, lr: float, momentum: float = 0.9, nesterov: bool = False, ns_steps: int = 5,
                 post_polar: bool = False, lr_scale: str = "none", weight_decay: float = 0.0,
                 betas=(0.9, 0.95), epsilon: float = 1e-8, ns_dtype: str | None = None, vote: str = "auto",
                 orthogonalize: str = "shard", wire_dtype=torch.float32, state_dtype=None, compile: bool = False,
                 *, replicate_mesh=None, shard_mesh=None, tensor_mesh=None, **options):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, post_polar=post_polar,
                        lr_scale=lr_scale, weight_decay=weight_decay, betas=betas, epsilon=epsilon,
                        ns_dtype=ns_dtype, vote=vote, orthogonalize=orthogonalize, wire_dtype=wire_dtype,
                        state_dtype=state_dtype, compile=compile)
        super().__init__(params, defaults, replicate_mesh=replicate_mesh, shard_mesh=shard_mesh,
                         tensor_mesh=tensor_mesh, **options)
