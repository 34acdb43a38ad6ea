"""Local steps: a DiLoCo-style outer loop over the replicate axis (docs/design.md §10).

`LocalSteps` wraps an inner optimizer that exchanges nothing on the replicate axis. Every step is an
inner step (the replicas drift apart); every `sync_every` steps each fragment of the params (fragment.py)
sends its pseudo-gradient through an outer exchange format (formats.py) and every replica takes the same
outer step:

    x  = Δ + e,  Δ = θ_start − θ                 local (θ_start = θ_outer without overlap)
    (Δ̄, own) = exchange(x)                       replicate axis: Δ̄ bitwise equal everywhere
    e ← x − own                                  lossy formats only (error feedback, local)
    b ← μ·b + Δ̄,  d = Δ̄ + μ·b (Nesterov) or b    outer SGD momentum
    θ_outer ← θ_outer − lr_outer·d
    θ ← θ_outer                                  (overlap: θ ← θ_outer + (θ − θ_start), θ_start ← θ)

A non-finite x on any replica (the flag rides in the exchange) discards the round on every replica:
θ ← θ_outer, nothing else changes, a warning is logged. LocalSteps itself is the facade: the torch.optim
surface (surface.py), the per-param outer state (state.py), the fragments' schedule, the checkpoints;
`sync_now()` ends a run between two syncs with bitwise-equal replicas (finish.py).

Memory beyond the inner optimizer, per param element (s = state_dtype's size): θ_outer s, b s
(outer_momentum > 0), e s (lossy formats), with overlap θ_start, the pending Δ̄ and e: 3 s more.
Per sync: a flat fp32 x and the format's decoded copies of the syncing fragment, O(model / F).
Each sync reads one flag back to the host (one device sync).
"""

from __future__ import annotations

import torch

from ..layout.placement import local
from ..wire.comm import Axes
from ..wire.replicas import replicate_axis
from . import finish, traffic
from .checks import SyncChecks, check_local_steps, check_model, inner_axes
from .formats import outer_format
from .fragment import EVERY_PARAM, Fragment, OuterSGD, Ownership, SyncSettings, split_fragments, sync_offset
from .lowrank import FragmentFormats
from .state import load_outer_state, new_outer_state, split_state_dict, with_outer_state
from .surface import OptimizerAround


class LocalSteps(OptimizerAround):
    """Local steps with a compressed outer exchange (module docstring; docs/design.md §10).

    A torch.optim.Optimizer over the inner optimizer's param groups (surface.py: lr schedulers, DCP and
    `isinstance` take it); `state` holds the outer state per param (state.OuterState).

    inner: a shardopt optimizer built without replicate_mesh, or any torch.optim.Optimizer, over params
        whose gradients nobody averages across the replicas (FSDP2 on the shard mesh only; DDP only
        inside a replica).
    replicate_mesh: 1-D DeviceMesh or ProcessGroup of the replicas (the slow axis).
    sync_every: H ≥ 1, inner steps per round.
    outer_lr, outer_momentum, nesterov: the outer SGD (0.7 / 0 / Nesterov by default: momentum 0 measured
        0.29–0.48 lower val loss than MuLoCo's 0.6 at 2 and 4 replicas and every size, docs/tuning.md).
    exchange: one of formats.EXCHANGES (mean, mean_bf16, int8, int4, sign_vote, sign_mean, topk, lowrank, auto);
        "auto" (default): sign_mean at 2 replicas, sign_vote from 3, per round (formats.by_replicas, docs/tuning.md).
    rank_fraction: "lowrank"'s r = ⌈rank_fraction·min(m, n)⌉ per 2-D param (one whose (a+b)·r < a·b;
        the others go by sign_vote), with a warm-started Q (b×r, N(0,1) from the seed) in the state.
    block: entries per scale of "int8" / "int4" / "sign_vote" / "sign_mean" / "topk" (None: the format's own,
        128 for the sign formats, 4096 for the others: formats.py); vote: "sign_vote"'s
        wire format (vote.py, or "auto"); density: "topk"'s fraction of each block sent (0.01–0.03 typical).
    overlap: round k's exchange runs during round k+1 (one collective advanced per inner step) and is
        applied at round k+1's end, with the inner progress made meanwhile kept on top. θ_outer is
        bitwise equal on every replica after every sync; θ then differs by each replica's own progress.
    fragments: F ≥ 1 (≤ H) groups of params, in param order and balanced by size, synced at staggered
        steps (fragment f at t ≡ ⌊(f+1)·H/F⌋ mod H): each sync sends about 1/F of the model.
    state_dtype: torch.float32 (default) or torch.bfloat16 for θ_outer, b and e; state_device: None (the
        param's) or "cpu" (offload; the sync copies through the host).
    seed: the vote's tie coins (equal on every replica). model: optional, the wrapped nn.Module, checked
        for a DistributedDataParallel whose group reaches across the replicas.
    double_averaging_check: before the first inner step with a nonzero gradient, raise
        shardopt.DoubleAveragingError when every replica's gradients are bitwise equal (someone averaged
        them over the replicas, or all read the same batches): 24 bytes once (checks.SyncChecks).
    ownership: the params this rank syncs (fragment.Ownership): all of them, or DeepSpeed ZeRO 1/2's own.

    """

    def __init__(self, inner: torch.optim.Optimizer, *, replicate_mesh, sync_every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.0, nesterov: bool = True, exchange: str = "auto",
                 block: int | None = None, vote: str = "alltoall_1bit", rank_fraction: float = 0.25,
                 density: float = 0.02, overlap: bool = False, fragments: int = 1,
                 state_dtype=torch.float32, state_device=None, seed: int = 0, model=None,
                 double_averaging_check: bool = True, ownership: Ownership = EVERY_PARAM):
        state_dtype = check_local_steps(inner, sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum,
                                        exchange=exchange, rank_fraction=rank_fraction, fragments=fragments,
                                        state_dtype=state_dtype, state_device=state_device, density=density)
        super().__init__(inner)
        self.format = outer_format(exchange, block=block, vote=vote, density=density)   # ("lowrank": its non-matrix part)
        self.formats = FragmentFormats(self.format, rank_fraction if exchange == "lowrank" else None, int(seed))
        self.sync_every, self.outer_lr, self.outer_momentum, self.nesterov = sync_every, outer_lr, outer_momentum, \
            nesterov
        self.overlap, self.fragments, self.seed = bool(overlap), fragments, int(seed)
        self.state_dtype, self.state_device = state_dtype, state_device
        self.double_averaging_check, self.ownership = double_averaging_check, ownership
        self.replicate = replicate_axis(replicate_mesh, self, per_step=False)   # (torchft: healing)
        check_model(model, self.replicate)
        self.other_axes = inner_axes(inner, self.params(), replicate_mesh)
        self.checks = SyncChecks(self.replicate, self.other_axes, [*self.other_axes, *ownership.axes],
                                 double_averaging_check)
        self.steps = 0
        self._fragments: list[Fragment] = []   # built with the state, at the first step (or load)

    discarded_rounds = property(lambda self: self.checks.discarded_rounds,
                                doc="Rounds discarded on every replica for a non-finite pseudo-gradient on some replica.")
    heal_counters = property(lambda self: self.checks)   # what torchft healing copies (wire/rounds.HealCounters)

    # ---- state and fragments ----------------------------------------------------------------------
    def _partition(self) -> list[list[torch.Tensor]]:
        """The params this rank syncs (`ownership`), by fragment."""
        params = self.params()
        return split_fragments([params[slot] for slot in self.ownership.slots(len(params))], self.fragments)

    def _init_state(self) -> None:
        """The outer state of every synced param that has none yet; the fragments, once."""
        params = self.params()
        for slot in self.ownership.slots(len(params)):
            if not self.state.get(params[slot]):
                self.state[params[slot]] = new_outer_state(
                    params[slot], dtype=self.state_dtype, device=self.state_device, momentum=self.outer_momentum > 0,
                    lossy=self.format.lossy, overlap=self.overlap, Q=self.formats.initial_q(params[slot], slot))
        if not self._fragments:
            settings = SyncSettings(self.replicate, OuterSGD(self.outer_lr, self.outer_momentum, self.nesterov),
                                    self.checks, self.seed, self.fragments, self.overlap)
            axes = Axes(self.replicate, *self.other_axes)
            self._fragments = [Fragment(index, part, self.state, self.formats.of(part, axes, self.state), settings)
                               for index, part in enumerate(self._partition())]

    def _repartition(self) -> None:
        """The fragments' params again, after the inner optimizer's params changed."""
        for fragment, part in zip(self._fragments, self._partition()):
            fragment.params = part

    # ---- step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """The double-averaging check (before anything changes, SyncChecks), one inner step, then the syncs of
        the fragments due at this step (module docstring). A closure runs here, once, before both."""
        loss = None if closure is None else torch.enable_grad()(closure)()
        self.checks.check_gradients(self.params(), self.steps + 1)
        self._init_state()
        with torch.enable_grad():
            self.inner.step()
        self._count_step()
        return loss

    @torch.no_grad()
    def skip_step(self) -> None:
        """A step whose inner step someone else skipped (DeepSpeed's fp16/bf16 wrapper on an overflow) counts
        as step() does, its syncs run: every replica reaches each sync at the same step."""
        self._init_state()
        self._count_step()

    def _count_step(self) -> None:
        self.steps += 1
        for fragment in self._fragments:
            if fragment.flight is not None:
                fragment.advance(self.steps)
        for fragment in self._fragments:
            if self.steps % self.sync_every == sync_offset(fragment.index, self.fragments, self.sync_every):
                self._sync(fragment)

    def sync_now(self) -> list[int]:
        """Sync, off the schedule, every fragment with inner progress since its last sync on some replica (the
        end of training, before saving the final model; finish.py): afterwards the replicas' params are bitwise
        equal. Every rank calls it at the same step. Returns the indices of the fragments synced."""
        return finish.sync_pending(self)

    def _sync(self, fragment: Fragment, settle: bool = False) -> None:
        if fragment.params:
            fragment.settle(self.steps) if settle else fragment.sync(self.steps)
        elif self.ownership.axes:   # owning none of the fragment, still in its owners' discard agreement
            self.checks.discard(torch.zeros((), device=local(self.params()[0]).device), 0, self.steps)
        self.ownership.after_sync()

    def replace_params(self, pairs) -> None:
        """Each (old, new): `new` takes `old`'s outer state, and the inner optimizer's (its own
        replace_params, where it has one): DeepSpeed's fp32 master copies stand in for the params."""
        for old, new in pairs:
            if old in self.state:
                self.state[new] = self.state.pop(old)
        if hasattr(self.inner, "replace_params"):
            self.inner.replace_params(pairs)
        self._repartition()

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._repartition()

    # ---- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The inner optimizer's state dict (torch.optim's format) with the outer state added to each
        param's entry (keys outer_*, DTensors where the params are) and the step count: what DCP and
        safetensors save. With an exchange in flight it is waited for first (every replica must call
        state_dict at the same step, as for any checkpoint) and its result saved as pending."""
        for fragment in self._fragments:
            fragment.finish(self.steps)
        return with_outer_state(self.inner.state_dict(), self.params(), self.state, self.steps)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what state_dict() returned: the inner keys into the inner optimizer, the outer_* keys
        here (copied into freshly made tensors of this optimizer's dtypes and devices), of the params this
        rank syncs (`ownership`)."""
        inner_state, outer = split_state_dict(state_dict, set(self.ownership.slots(len(self.params()))))
        if any(outer.values()):
            self._init_state()
        steps = load_outer_state(self.params(), self.state, outer, f"exchange {self.format.name!r}, overlap "
                                 f"{self.overlap}, outer_momentum {self.outer_momentum}")
        self.steps = self.steps if steps is None else steps
        for fragment in self._fragments:
            fragment.drop()
        self.inner.load_state_dict({"state": {k: v for k, v in inner_state.items() if v},
                                    "param_groups": state_dict["param_groups"]})

    # ---- traffic and checks -----------------------------------------------------------------------
    def comm_stats(self) -> dict:
        """Bytes sent/received and calls per axis (traffic.comm_stats)."""
        return traffic.comm_stats(self.replicate, self.other_axes, self.inner)

    def reset_comm_stats(self) -> None:
        traffic.reset_comm_stats(self.replicate, self.other_axes, self.inner)

    def sync_bytes(self, replicas: int | None = None) -> list[int]:
        """Replicate-axis bytes of each fragment's sync at `replicas` (its exchange counted on meta tensors,
        traffic.py); 0 on the inner steps."""
        axes = traffic.counting_axes(self.replicate.size if replicas is None else replicas, *self.other_axes)
        return [traffic.sync_bytes(self.formats.of(part, axes), sum(local(p).numel() for p in part), axes.replicate)
                for part in self._partition()]

    def describe(self, replicas: int | None = None) -> str:
        return traffic.describe(self, self.replicate.size if replicas is None else replicas)

    def replicas_consistent(self) -> bool:
        """True when the params (θ_outer with overlap) are bitwise equal on every replica (finish.py)."""
        return finish.replicas_consistent(self)
