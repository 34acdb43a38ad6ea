"""The optimizer classes: validation, param groups, state and the step loop (no math, no collectives).

`ShardOptimizer` holds the mesh axes and routes each param group to its algorithm's record
(registry.py). A step reads: the pre-step agreement (agreement.py) → each group's plan (plan.py:
buckets of same-layout matrices, or the element-wise group, each with its exchange) → the bucket
steps, pipelined (schedule.py) → done: each bucket step commits its own params and state. With
overlap_backward the bucket steps start during backward instead (shardopt/overlap/backward.py).

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
grad_scaler: fp16 AMP's torch.amp.GradScaler hands itself to step() (`_step_supports_amp_scaling`): the
    gradients are unscaled there and its found-inf is agreed by all ranks, so an overflow anywhere skips the
    step on every rank and the loss scales stay equal (shardopt/frameworks/gradscaler.py).
max_grad_norm: clip by g ← g·min(1, max_grad_norm/(ν + 1e-6)), ν agreed by all ranks (clipping.py),
    so every replica and shard applies the same factor. 0 (default): no clipping.
maximize: step along +gradient (torch.optim's maximize), for every algorithm; a group default.
foreach, fused, capturable, differentiable: torch.optim options shardopt refuses with a TypeError
    that says what it does instead (None, the default, is accepted).
bucket_bytes: cap on a bucket's stacked working copy (fp32; fp64 for fp64 params), so a step's
    transient memory is O(bucket_bytes), not O(model) (buckets.py); element-wise groups are cut into buckets
    of at most that many bytes of entries. None (default): by the params' device, 128 MiB on CUDA, 16 MiB
    elsewhere (buckets.default_bucket_bytes).
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
    it on is a collective over the whole world, every rank turns it on), and a step it skips or reruns
    has already spent its exchange. Not with max_grad_norm > 0 (clipping scales every gradient by a
    factor that needs the global norm, known only after backward: ValueError). Gradient accumulation:
    run the backward of every micro-batch but the last under `optimizer.accumulating()` (or, under DDP,
    under `model.no_sync()` after `optimizer.accumulate_under_no_sync(model)`). The DeepSpeed plugin
    takes it at ZeRO stage 0 without a node mesh and at stage 2, without clipping
    (shardopt/deepspeed/optimizers.py). Settable between steps, alike on every rank. While it is on,
    the optimizer holds its `backward_overlap` (shardopt/overlap/backward.py), None while it is off.

Which params a step updates is agreed by all ranks: those with a gradient on at least one rank.
A rank without a local gradient for such a param steps it with a zero gradient (it joins the same
collectives); a param without a gradient on every rank is skipped everywhere.
"""

from __future__ import annotations

import contextlib

import torch

from ..algorithms import registry
from ..overlap.backward import BackwardOverlap, switched
from ..layout.buckets import default_bucket_bytes
from .agreement import StepAgreement, check_ranks_agree, gradient_flag
from .checks import check_options, check_param_group, load_checked, param_labels
from .clipping import clip_grad_norm_
from ..frameworks.gradscaler import agreed_to_step
from ..wire.comm import Axes, Axis
from ..wire.replicas import replicate_axis
from .guard import replicas_equal
from .checkpoint_momenta import synchronize
from ..layout.placement import derive_meshes, local, tensor_split
from .plan import Plans
from .steps import run_in_place
from .traffic import DOUBLE_AVERAGING_CHECK_EVERY, comm_stats, describe_optimizer, replicate_bytes, reset_comm_stats


class ShardOptimizer(torch.optim.Optimizer):
    """Base of Dion and SignMuon. Param groups choose their `algorithm` (registry.py); groups without one get the
    class's `matrix_algorithm`. Matrix groups take 2-D weights and 3-D expert stacks (E, m, n), and the option
    `split=(dim, sizes)` for fused projections (shardopt/layout/matrices.py). Options: the module's docstring."""

    matrix_algorithm = "dion"
    pipeline_depth = 2   # bucket steps in flight: one bucket's collective overlaps the next one's compute
    backward_overlap_type = BackwardOverlap   # what overlap_backward=True makes (shardopt/overlap/backward.py)
    _step_supports_amp_scaling = True   # GradScaler.step calls step(grad_scaler=scaler) (frameworks/gradscaler.py)

    def __init__(self, params, defaults: dict, *, replicate_mesh=None, shard_mesh=None, tensor_mesh=None, seed: int = 0,
                 agreement_timeout_s: float = 60.0, nonfinite: str = "skip", max_grad_norm: float = 0.0,
                 maximize: bool = False, foreach=None, fused=None, capturable=None, differentiable=None,
                 bucket_bytes: int | None = None,
                 double_averaging_check_every: int = DOUBLE_AVERAGING_CHECK_EVERY, overlap_backward: bool = False):
        check_options(seed=seed, agreement_timeout_s=agreement_timeout_s, nonfinite=nonfinite,
                      max_grad_norm=max_grad_norm, maximize=maximize, bucket_bytes=bucket_bytes,
                      double_averaging_check_every=double_averaging_check_every, foreach=foreach, fused=fused,
                      capturable=capturable, differentiable=differentiable)
        self.agreement = StepAgreement(nonfinite, double_averaging_check_every)
        self.seed = int(seed)
        self.max_norm = float(max_grad_norm)   # (the DeepSpeed plugin keeps its own max_grad_norm)
        self.last_grad_norm = None             # ν of the last clipped step (a 0-d tensor), for logging
        self._param_index: dict[torch.Tensor, int] = {}
        self._param_label: dict[torch.Tensor, str] = {}
        self._plans = Plans()
        self.backward_overlap: BackwardOverlap | None = None   # the exchange during backward, set below
        super().__init__(params, {**registry.defaults(), **defaults, "maximize": maximize})
        replicate, shard, tensor = derive_meshes(list(self._param_label.items()), replicate_mesh, shard_mesh, tensor_mesh)
        self.replicate, self.shard, self.tensor = self.axes = Axes(   # (torchft: a round per step, healing)
            replicate_axis(replicate, self, per_step=True), Axis("shard", shard), Axis("tensor", tensor))
        self.bucket_bytes = bucket_bytes or default_bucket_bytes(self._device().type)
        settings = {"seed": self.seed, "bucket_bytes": self.bucket_bytes, "double_averaging_check_every":
                    double_averaging_check_every, "overlap_backward": int(bool(overlap_backward))}
        check_ranks_agree(self._param_label.items(), self.param_groups, settings, self.axes, agreement_timeout_s)
        self.bucket_step_axes = self.axes   # where the bucket steps' collectives go (private groups when overlapping)
        self.overlap_backward = overlap_backward
        self.reset_comm_stats()

    skipped_steps = property(lambda self: self.agreement.skipped_steps)
    steps_called = property(lambda self: self.agreement.steps_called)
    nonfinite = property(lambda self: self.agreement.nonfinite)
    double_averaging_check_every = property(lambda self: self.agreement.double_averaging_check_every)
    heal_counters = property(lambda self: self.agreement)   # what torchft healing copies (wire/rounds.HealCounters)

    def add_param_group(self, param_group: dict) -> None:
        param_group.setdefault("algorithm", self.matrix_algorithm)
        if self.param_groups and "param_names" in self.param_groups[0] and "param_names" not in param_group:
            index = len(self.param_groups)   # torch.optim needs names in all groups or none
            param_group["param_names"] = [f"param_groups[{index}][{i}]" for i in range(len(list(param_group["params"])))]
        defaults = registry.defaults()
        explicit_keys = [key for key in param_group if key in defaults]
        super().add_param_group(param_group)
        index, group = len(self.param_groups) - 1, self.param_groups[-1]
        try:
            check_param_group(group, index, explicit_keys, defaults, registry.ALGORITHMS)
        except ValueError:
            self.param_groups.pop()   # a rejected group leaves nothing behind (docs/design.md §7)
            raise
        for param, label in zip(group["params"], param_labels(group, index)):
            self._param_index[param] = len(self._param_index)
            self._param_label[param] = label
        if self.backward_overlap is not None:
            self.backward_overlap.hook(group["params"])

    # ---- step ---------------------------------------------------------------------------------
    @torch.compiler.disable(reason="a shardopt step issues collectives and agrees on one host-read flag per step")
    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not agreed_to_step(self, grad_scaler):   # a GradScaler's overflow on some rank: every rank skips
            return loss
        params = [p for group in self.param_groups for p in group["params"]]
        if self.backward_overlap is not None:
            self.backward_overlap.step(params)
            return loss
        decision = self._agreed(params)
        if decision.params is None:
            return loss
        if self.max_norm > 0:
            self.last_grad_norm = self.clip_grad_norm_(self.max_norm)
        run_in_place(self, decision.params)
        return loss

    def _agreed(self, params: list, stale: bool | None = None):
        """The pre-step agreement on `params` (agreement.StepAgreement.stepping) over this optimizer's axes."""
        return self.agreement.stepping(params, self._param_label, self.replicate, self.axes, self.agreement_axes(),
                                       self._device(), stale=stale)

    # ---- the exchange during backward (docs/design.md §12; shardopt/overlap/backward.py) ---------
    @property
    def overlap_backward(self) -> bool:
        """Whether bucket steps start during backward (see the module doc); set it between steps, alike on every rank."""
        return self.backward_overlap is not None

    @overlap_backward.setter
    def overlap_backward(self, value: bool) -> None:
        self.backward_overlap = switched(self, value)

    def accumulating(self):
        """`with optimizer.accumulating():` around every micro-batch's backward but the last (like DDP's no_sync):
        the exchange during backward starts once the gradients are whole. Nothing without overlap_backward."""
        return self.backward_overlap.accumulating() if self.backward_overlap is not None else contextlib.nullcontext()

    def accumulate_under_no_sync(self, ddp_model) -> None:
        """Micro-batches run under `ddp_model.no_sync()` (a DistributedDataParallel) count as `accumulating()` until
        overlap_backward is set again (shardopt.ddp.keep_local_gradients(model, optimizer) calls this)."""
        if not hasattr(ddp_model, "require_backward_grad_sync"):
            raise TypeError(f"accumulate_under_no_sync takes a torch DistributedDataParallel, got {type(ddp_model).__name__}")
        if self.backward_overlap is not None:
            self.backward_overlap.accumulate_under_no_sync(ddp_model)

    def discard_backward_work(self) -> None:
        """For a backward whose step() will not run, on every rank alike (DeepSpeed's fp16/bf16 overflow): the rest
        of its exchange runs, so every rank's collectives match, and is dropped (BackwardOverlap.discard)."""
        if self.backward_overlap is not None:
            self.backward_overlap.discard()

    # ---- what the step's callers and adapters use -------------------------------------------------
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the local gradients by one agreed factor; return the agreed norm ν (0-d, no sync; clipping.py); max_norm 0
        reads ν only. Not with overlap_backward and max_norm > 0: its exchange read the gradients (RuntimeError)."""
        if self.backward_overlap is not None:
            self.backward_overlap.check_clipping(max_norm)
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
        """torch.optim's, after its pre-hooks and shardopt's checks (checks.load_checked: nothing loads unless
        all fits); matrix-group state keeps its `state_dtype` (torch.optim casts to the param's dtype)."""
        load_checked(self, state_dict, super().load_state_dict, registry.ALGORITHMS)

    def __getstate__(self) -> dict:   # every setting, not only torch.optim's defaults, state, groups
        kept = {key: value for key, value in self.__dict__.items() if key not in ("_plans", "backward_overlap")}
        return {**kept, "overlap_backward": self.overlap_backward}   # (the plans and the overlap object: made anew)

    def __setstate__(self, state: dict) -> None:
        """A copy (deepcopy, pickle: the state of __getstate__), or this optimizer itself in torch.optim's
        load_state_dict (only its state and groups): then its hooks are removed before its params get them again."""
        live = self.__dict__.get("backward_overlap")
        if live is not None:
            live.detach()
        overlapping = state.get("overlap_backward", live is not None)
        super().__setstate__({key: value for key, value in state.items() if key != "overlap_backward"})
        self._plans = Plans()
        self.backward_overlap = self.backward_overlap_type(self) if overlapping else None

    # ---- reports and checkpoints ----------------------------------------------------------------
    def replicate_bytes_per_step(self, replicas: int | None = None) -> list[int]:
        """This rank's replicate-axis bytes per step per group (traffic.replicate_bytes)."""
        return replicate_bytes(self, replicas)

    def describe(self, replicas: int | None = None) -> str:
        """Each group's replicate-axis bytes per step, the whole model against DDP (traffic.describe_optimizer)."""
        return describe_optimizer(self, replicas)

    def comm_stats(self) -> dict:
        """Bytes sent/received and calls per axis since construction or reset (`bucket_step_axes` counted in)."""
        return comm_stats(self.axes, self.bucket_step_axes)

    def reset_comm_stats(self) -> None:
        reset_comm_stats(self.axes, self.bucket_step_axes)

    @torch.no_grad()
    def synchronize_for_checkpoint(self, exchange: str = "mean") -> None:
        """Decoupled momenta ← a value all replicas agree on, via `exchange` ("mean": exact fp32; checkpoint_momenta.py)."""
        synchronize(self, exchange)

    @torch.no_grad()
    def replicas_consistent(self) -> bool:
        """True when every parameter is bitwise equal on all replicas (guard.replicas_equal; a device sync)."""
        return replicas_equal([local(p) for group in self.param_groups for p in group["params"]], self.replicate)


class Dion(ShardOptimizer):
    """Dion (docs/design.md §1). Non-matrix params go in groups with algorithm "adamw" or "lion"
    (see `shardopt.param_groups`), which use lr, betas, epsilon and weight_decay ("lion" groups
    also `vote`, the wire format of their 1-bit vote). wire_dtype: torch.bfloat16 (default) or
    torch.float32, the precision of P and R on the replicate axis (rounded before the exchange).
    qr_method: "qr" (Householder, exact), "cholesky" or "rcqr" (randomized Cholesky-QR).
    state_dtype: dtype of the momentum and Q ("float32", "bfloat16", …; None: the param's).
    matmul_dtype: "float32" or "bfloat16", what the inputs of the four large products (B·Q, Bᵀ·P, P·Rᵀ, P·Qᵀ)
        are rounded to; None (default): bf16 on CUDA (tensor cores), the compute dtype on a CPU (docs/tuning.md
        has the float64-reference tolerances of each; float32 follows torch's TF32 setting).
    `options`: seed, agreement_timeout_s, nonfinite, max_grad_norm, maximize, bucket_bytes (see ShardOptimizer)."""

    matrix_algorithm = "dion"

    def __init__(self, params, lr: float = 0.01, mu: float = 0.95, rank_fraction: float = 1.0,
                 rank_multiple_of: int = 1, weight_decay: float = 0.01, epsilon: float = 1e-8,
                 qr_method: str = "qr", betas=(0.9, 0.95), wire_dtype=torch.bfloat16, vote: str = "auto",
                 state_dtype=None, matmul_dtype=None, *, replicate_mesh=None, shard_mesh=None, tensor_mesh=None,
                 **options):
        defaults = dict(lr=lr, mu=mu, rank_fraction=rank_fraction, rank_multiple_of=rank_multiple_of,
                        weight_decay=weight_decay, epsilon=epsilon, qr_method=qr_method, betas=betas,
                        wire_dtype=wire_dtype, vote=vote, state_dtype=state_dtype, matmul_dtype=matmul_dtype)
        super().__init__(params, defaults, replicate_mesh=replicate_mesh, shard_mesh=shard_mesh,
                         tensor_mesh=tensor_mesh, **options)


class SignMuon(ShardOptimizer):
    """Sign-Muon (docs/design.md §2). vote: "allreduce_int8", "allgather_1bit", "alltoall_1bit" or "auto"
    (also the format of "lion" groups' vote). wire_dtype: precision of the shard-axis all-to-all of
    orthogonalize="full": torch.float32 (default, the exact Muon direction) or torch.bfloat16 (half
    the shard-axis bytes; only the signs of the result are used). The defaults differ on purpose: a key's
    default comes from the optimizer class, and wire_dtype is each algorithm's own link (Dion: its factors on
    the replicate axis, bf16 as microsoft/dion; Sign-Muon: the full-matrix all-to-all, fp32 for the exact
    direction), so a "signmuon" group inside Dion(...) gets bf16 unless the group sets it.
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
