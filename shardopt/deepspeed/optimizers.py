"""The optimizers DeepSpeed drives: Dion and Sign-Muon with what the engine needs (agreed clipping and
overflow, the fp16/bf16 master copies, the checkpoint hook, the ZeRO 1/2 partition of zero.py)."""

from __future__ import annotations

import contextlib

import torch

from ..wire.comm import Axes, Axis
from ..optim.guard import replicas_equal
from ..localsteps.fragment import Ownership
from ..localsteps.optimizer import LocalSteps
from ..optim.optimizer import Dion, ShardOptimizer, SignMuon
from ..optim.checkpoint_momenta import checkpoint_exchange
from ..overlap.backward import BackwardOverlap
from ..layout.matrices import single_matrix
from ..layout.placement import local
from . import internals
from .zero import ZeroPartition


class EngineBackwardOverlap(BackwardOverlap):
    """overlap_backward of an optimizer under a DeepSpeed engine (`_EngineSide`)."""

    @classmethod
    def refusal(cls, optimizer) -> str | None:
        """The exchange during backward reads each gradient when backward has made it: only where the engine
        makes no other of it before engine.step() (ZeRO stage 0 without a node mesh or stage 2, no clipping)."""
        if optimizer.max_grad_norm > 0:
            return (f"overlap_backward under DeepSpeed needs \"gradient_clipping\": 0 (got {optimizer.max_grad_norm:g}): "
                    f"the agreed clip factor needs every gradient, known only after backward; remove "
                    f"overlap_backward from the optimizer params to clip")
        if optimizer.zero is not None and optimizer.zero.stage != 2:
            return (f"overlap_backward under DeepSpeed needs ZeRO stage 2, or stage 0 without a \"shardopt\" mesh "
                    f"(got stage {optimizer.zero.stage} on a node of {optimizer.node.size} ranks): at this stage the "
                    f"node's gradients are averaged or reduced to their owners in engine.step(), after backward; set "
                    f"\"zero_optimization\": {{\"stage\": 2}}, or remove overlap_backward from the optimizer params")
        return super().refusal(optimizer)

    def hook(self, params) -> None:
        """At ZeRO 2 the gradient this rank steps is the node mean its reduce brings, after the local one's
        hook, and under fp16/bf16 it is the master copy's, which backward never writes: there the wiring
        hands the gradients over (wiring.EngineWiring._hand_over); elsewhere the hooks of BackwardOverlap."""
        optimizer = self.optimizer
        if (optimizer.zero is None or optimizer.zero.stage != 2) and (optimizer.wiring is None
                                                                     or optimizer.wiring.wrapper is None):
            super().hook(params)

    def first_planned(self) -> set:
        """At ZeRO 1/2 only the slots this rank owns get a gradient, and so step."""
        planned, zero = super().first_planned(), self.optimizer.zero
        if zero is None or zero.stage == 0:
            return planned
        return {p for slot, p in enumerate(self.optimizer._slots()) if p in planned and zero.owns(slot)}


class _EngineSide:
    """What a shardopt optimizer needs under a DeepSpeed engine (mixed into Dion and SignMuon).

    max_grad_norm: clip every replica's gradient by the same factor; 0 turns clipping off.
    zero_stage, node_mesh: ZeRO stage (0, 1, 2, 3) and the process group of this rank's node (the "node"
        axis of zero.py); node_mesh=None: no node axis (stage 0, every data-parallel rank a replica).
    reduce_bucket_size: stage 2, the most elements of gradients in flight to their owners during backward.
    overlap_backward: each bucket's exchange starts during engine.backward (docs/design.md §12; engine.backward
        runs the micro-batches before the accumulation boundary under `accumulating()`; at ZeRO 2 a bucket starts
        once the node means of its owned gradients are back; under fp16/bf16 it reads the master copies'
        gradients made in backward as the wrapper's step makes them). Only at ZeRO stage 0 without a "shardopt"
        mesh or at stage 2, without gradient_clipping: elsewhere the engine changes the gradients after
        backward (ValueError naming the setting). Its object: EngineBackwardOverlap.

    Global gradient norm (clipping, and engine.get_global_grad_norm() for logging), every step:
        ν = mean over replicas of ‖g_replica‖₂, ‖g_replica‖₂² = Σ over the node's ranks of ‖owned g_node‖²
    (a replica is a node when there is a shard axis, else one rank). The exact norm of the averaged
    gradient would need the full-precision exchange the compression avoids; ν ≥ ‖mean g‖ (triangle
    inequality), so clipping by min(1, max_norm / (ν + 1e-6)) clips at least as often. Cost: an all-reduce
    of one float per axis, no host sync. The same path as the optimizer's max_grad_norm (shardopt/optim/clipping.py),
    with the node axis among the split axes at ZeRO 1/2 (`gradient_split_axes`).
    """

    backward_overlap_type = EngineBackwardOverlap
    param_residency = None   # bf16 ZeRO 2/3: the packed fp32 masters (masters.PackedMasters; steps.run_in_place)

    def __init__(self, params, *args, max_grad_norm: float = 0.0, zero_stage: int = 0,
                 reduce_bucket_size: int = 500_000_000, node_mesh=None, overlap_backward: bool = False, **kwargs):
        if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm >= 0):
            raise ValueError(f"Invalid gradient_clipping: {max_grad_norm!r}; it must be a number ≥ 0")
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"Invalid zero_stage: {zero_stage!r}; shardopt runs ZeRO stages 0, 1, 2 and 3")
        self.max_grad_norm = float(max_grad_norm)
        self.reduce_bucket_size = reduce_bucket_size
        self._global_grad_norm = None
        self.overflow = False       # read by the engine: a skipped step does not advance the LR scheduler
        self.wiring = None          # the wiring.EngineWiring to its engine; until then inert: see step()
        super().__init__(params, *args, overlap_backward=False, **kwargs)
        self.node = Axis("node", node_mesh)
        # state tensors per element: AdamW keeps two moments, the others one (Dion's Q is small beside M)
        costs = [p.numel() * (2 if group["algorithm"] == "adamw" else 1) for group in self.param_groups
                 for p in group["params"]]
        self.zero = ZeroPartition([p.shape for p in self._slots()], self.node, zero_stage, costs,
                                  window_bytes=self.bucket_bytes, row_slots=row_slots(self.param_groups, zero_stage)
                                  ) if node_mesh is not None else None
        if self.zero is not None and self.zero.rows:   # the node's ranks split row slots by rows (zero3.py)
            self.shard = Axis("shard", node_mesh)
            self.axes = self.bucket_step_axes = Axes(self.replicate, self.shard, self.tensor)
        self.overlap_backward = overlap_backward

    def _switch_overlap_backward(self, value: bool) -> None:
        """ShardOptimizer's overlap_backward setter, refusing to switch it on over packed bf16 masters (masters.py)."""
        if value and self.param_residency is not None:
            raise ValueError("overlap_backward=True after the DeepSpeed wiring packed the bf16 fp32 masters "
                             "(shardopt/deepspeed/masters.py): the exchange during backward reads them whole; give "
                             "\"overlap_backward\": true in the config's optimizer params instead, which keeps whole "
                             "masters")
        ShardOptimizer.overlap_backward.fset(self, value)

    overlap_backward = property(ShardOptimizer.overlap_backward.fget, _switch_overlap_backward,
                                doc=ShardOptimizer.overlap_backward.__doc__)

    def _slots(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        if self.wiring is None:
            # DeepSpeed's fp16/bf16 wrapper "initializes optimizer state" with a step on zero
            # gradients while the engine is being built; shardopt creates its state lazily.
            if any(bool(p.grad.any()) for p in self._slots() if p.grad is not None):
                raise RuntimeError("the shardopt optimizer is not wired to its DeepSpeed engine: after "
                                   "deepspeed.initialize / accelerator.prepare, call shardopt.deepspeed.attach(engine)")
            return None
        params = self._slots()
        if self.zero is not None:
            if self.zero.stage < 2:    # stage 2 reduced after each backward (wiring.EngineWiring)
                for param, grad in zip(params, self.zero.reduce_gradients([p.grad for p in params], params)):
                    param.grad = grad
            for slot, param in enumerate(params):
                if not self.zero.owns(slot):
                    param.grad = None  # the wrapper's zeros for gradients this rank does not own
        self._clip()
        skipped = self.skipped_steps
        loss = super().step(closure)
        self.overflow = self.skipped_steps != skipped    # a non-finite gradient on some replica
        if self.zero is not None and not self.overflow:
            self.zero.gather_weights(params)
        return loss

    def _agreed(self, params: list, stale: bool | None = None):
        """The pre-step agreement; with row slots (stage 3) the shard axis is the node's group, whose ranks hold
        different whole params, so which params step is agreed over the replicate and tensor axes, as at stage 2
        (every rank of the node holds each row slot's rows)."""
        if self.zero is None or not self.zero.rows:
            return super()._agreed(params, stale)
        return self.agreement.stepping(params, self._param_label, self.replicate, (self.replicate, self.tensor),
                                       self.agreement_axes(), self._device(), stale=stale)

    def _clip(self) -> None:
        """ν (see the class doc) into _global_grad_norm; g ← g · min(1, max_norm / (ν + 1e-6))."""
        norm = self.clip_grad_norm_(self.max_grad_norm)
        self._global_grad_norm = norm
        if self.wiring.wrapper is not None:
            internals.report_global_grad_norm(self.wiring.wrapper, norm)

    def gradient_split_axes(self) -> tuple[Axis, ...]:
        """At ZeRO 1/2 each rank of the node holds the gradients it owns: the node axis splits the replica's gradient."""
        owned = self.zero is not None and self.zero.stage >= 1
        rows = owned and bool(self.zero.rows)   # the shard axis is then the node's group: counted once, as the node
        return (*(() if rows else super().gradient_split_axes()), *((self.node,) if owned else ()))

    def agreement_axes(self) -> tuple[Axis, ...]:
        """Skipping a step is agreed over the node as well (each rank checks the gradients it owns)."""
        return (*super().agreement_axes(), self.node)

    def checkpoint_event_prologue(self) -> None:
        """Called by engine.save_checkpoint on every rank before the state is gathered."""
        self.synchronize_for_checkpoint(checkpoint_exchange(self))

    def comm_stats(self) -> dict:
        """Bytes per axis, with "node": ZeRO 1/2's reduce-scatter and all-gather inside a node (and the small
        agreements over it). Deprecated, kept for one release: "shard" also counts the node's bytes, as it
        did when the node axis was reported under that name (under DeepSpeed the FSDP shard axis is empty,
        so "shard" equals "node", except at ZeRO 3 with row-split params, whose step (Dion's power iteration) runs on
        a shard axis over the node's ranks: then "shard" is every byte inside the node); read "node"."""
        stats = super().comm_stats()
        stats["node"] = self.node.stats()
        stats["shard"] = {key: stats["shard"][key] + value for key, value in stats["node"].items()}
        return stats

    def reset_comm_stats(self) -> None:
        super().reset_comm_stats()
        if hasattr(self, "node"):
            self.node.reset_stats()

    @torch.no_grad()
    def replicas_consistent(self) -> bool:
        """True when every parameter is bitwise equal on every data-parallel rank (both axes; at ZeRO 3 with every
        weight gathered for the check)."""
        release = getattr(self.wiring, "release", None)
        weights = self._slots() if self.zero is None or self.zero.weights is None else self.zero.weights   # masters.py
        weights = release.params if release is not None else weights   # stage 3: the model's, gathered whole
        with release.all_gathered() if release is not None else contextlib.nullcontext():
            return super().replicas_consistent() and replicas_equal([local(p) for p in weights], self.node)


ELEMENTWISE = ("adamw", "lion")   # the groups whose update is per entry: split by rows at ZeRO stage 3


def row_slots(param_groups: list[dict], zero_stage: int) -> tuple[int, ...]:
    """At ZeRO stage 3 the slots (positions in the param order) split by rows (dim 0) over the node's ranks: the 2-D
    params of "dion" groups that are one matrix each (no `split` into blocks), whose power iteration then runs
    row-sharded as under FSDP2, and the params with a dim 0 of the element-wise groups ("adamw", "lion": their update
    is per entry), stepped on each rank's rows as under FSDP2 (a 0-d one stays whole on an owner; docs/design.md
    §14); none at other stages."""
    slots = [group["algorithm"] in ELEMENTWISE and p.ndim >= 1 or group["algorithm"] == "dion" and single_matrix(p, group)
             for group in param_groups for p in group["params"]]
    return tuple(slot for slot, split in enumerate(slots) if split and zero_stage == 3)


class DeepSpeedDion(_EngineSide, Dion):
    """Dion as DeepSpeed's client optimizer (built by `shardopt.deepspeed.initialize`)."""


class DeepSpeedSignMuon(_EngineSide, SignMuon):
    """Sign-Muon as DeepSpeed's client optimizer (built by `shardopt.deepspeed.initialize`)."""


OPTIMIZERS = {"dion": DeepSpeedDion, "signmuon": DeepSpeedSignMuon}


class DeepSpeedLocalSteps(LocalSteps):
    """LocalSteps around a DeepSpeedDion / DeepSpeedSignMuon built without a replicate axis, as DeepSpeed's
    client optimizer ("shardopt": {"local_steps": ...}). The engine steps this one; what it
    reads from its optimizer comes from the inner one: `overflow` (an inner step skipped on this replica,
    agreed over its node: inner steps send nothing across the replicas) and `_global_grad_norm` (the
    replica's own clipping norm). Until the wiring (EngineWiring) a step is the inner one's inert step;
    a step the fp16/bf16 wrapper skips still counts towards the round (`skip_step`, patched in by the
    wiring), so the replicas reach every sync at the same step.

    ZeRO 1/2 (the inner one partitioned over the node): each rank syncs and keeps θ_outer, b and e for the
    params it owns only, with the owners of the same params on the other nodes, then the node all-gathers
    them (at the sync steps only): a node sends the model's pseudo-gradient across once, and the outer
    state is partitioned like the inner one (`ownership`: zero.py's owners, a discard agreed over the node
    too, the gathering after each sync; engine.load_checkpoint first loads data-parallel rank 0's state into
    every rank, its own file then replaces it, wiring.py: only the owned params' outer state is loaded).
    Without overlap and fragments (refused)."""

    def __init__(self, inner, **options):
        zero = inner.zero if inner.zero is not None and inner.zero.stage >= 1 else None
        if zero is not None:
            options["ownership"] = Ownership(zero.owns, (inner.node,), lambda: zero.gather_weights(self.params()))
        super().__init__(inner, **options)
        self.zero = zero
        if self.zero is not None and (self.overlap or self.fragments > 1):
            raise ValueError(f"\"local_steps\" at ZeRO stage {self.zero.stage} syncs every rank's own parameters "
                             f"at the round's end and gathers them inside the node: leave "
                             f"{'overlap' if self.overlap else 'fragments'} out (or use ZeRO stage 0)")

    def step(self, closure=None):
        if self.inner.wiring is None:   # the wrapper's construction-time step on zero gradients: not a step
            return self.inner.step(closure)
        return super().step(closure)

    def sync_now(self) -> list[int]:
        """LocalSteps.sync_now (the end of training, before saving the final model), then the model's fp16/bf16
        weights from the synced fp32 masters (the wrapper's step does that after a scheduled sync)."""
        due = super().sync_now()
        if self.inner.wiring is not None:
            self.inner.wiring.model_weights_from_masters()
        return due

    @property
    def overflow(self) -> bool:
        return self.inner.overflow

    @property
    def _global_grad_norm(self):
        return self.inner._global_grad_norm


def engine_side(optimizer) -> ShardOptimizer:
    """The DeepSpeedDion / DeepSpeedSignMuon that the engine wiring fits: `optimizer` itself, or the inner
    one of a DeepSpeedLocalSteps."""
    return optimizer.inner if isinstance(optimizer, DeepSpeedLocalSteps) else optimizer


class AgreedOverflowCheck:
    """Stands in for the fp16/bf16 wrapper's overflow check. The wrapper skips a step when that check
    says so, or when its gradient norm is not finite; with local gradients the norm is local, so this
    check asks the optimizer's own agreed non-finite test (a NaN/inf element or an overflowing norm on
    any rank): every rank skips, or none does."""

    def __init__(self, params, optimizer: ShardOptimizer):
        self.params = list(params)
        self.optimizer = optimizer

    def check(self, param_groups=None) -> bool:
        return self.optimizer.nonfinite_anywhere([p.grad for p in self.params if p.grad is not None])
