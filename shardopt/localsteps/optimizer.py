"""Local steps: a DiLoCo-style outer loop over the replicate axis (docs/design.md §10).

`LocalSteps` wraps an inner optimizer that exchanges nothing on the replicate axis. Every step is an
inner step (the replicas drift apart); every `sync_every` steps each replica sends its pseudo-gradient
through an outer exchange format (outer.py) and every replica takes the same outer step:

    x  = Δ + e,  Δ = θ_start − θ                 local (θ_start = θ_outer without overlap)
    (Δ̄, own) = exchange(x)                       replicate axis: Δ̄ bitwise equal everywhere
    e ← x − own                                  lossy formats only (error feedback, local)
    b ← μ·b + Δ̄,  d = Δ̄ + μ·b (Nesterov) or b    outer SGD momentum
    θ_outer ← θ_outer − lr_outer·d
    θ ← θ_outer                                  (overlap: θ ← θ_outer + (θ − θ_start), θ_start ← θ)

A non-finite x on any replica (the flag rides in the exchange) discards the round on every replica:
θ ← θ_outer, nothing else changes, a warning is logged.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict

import torch

from ..wire.comm import Axes, Axis
from ..algorithms.dion import compressed, init_state, rank_of
from ..optim.guard import check_not_double_averaged, replicas_equal
from .formats import EXCHANGES, LowRank, LowRankMatrix, outer_format
from ..layout.placement import derive_meshes, is_dtensor, local, matrix_layout
from ..optim.schedule import complete
from ..wire.seeds import mix_seed

logger = logging.getLogger("shardopt")

STATE_DTYPES = (torch.float32, torch.bfloat16)


def outer_sgd(theta_outer: torch.Tensor, momentum: torch.Tensor | None, mean_delta: torch.Tensor, *, lr: float,
              mu: float, nesterov: bool) -> None:
    """In place, fp32 math, shapes alike (n,): b ← μ·b + Δ̄; d = Δ̄ + μ·b (nesterov) or b; θ ← θ − lr·d.
    momentum None (μ = 0): d = Δ̄. torch.optim.SGD's rule with dampening 0."""
    direction = mean_delta
    if momentum is not None:
        buffer = momentum.float().mul_(mu).add_(mean_delta)
        momentum.copy_(buffer)
        direction = mean_delta + mu * buffer if nesterov else buffer
    theta_outer.copy_(theta_outer.float() - lr * direction)


def fragment_of(sizes: list[int], fragments: int) -> list[int]:
    """Fragment (0..F−1) of each param, in param order, cut where the running element count passes
    f/F of the total (the same on every rank: global sizes)."""
    total, running, out = sum(sizes), 0, []
    for size in sizes:
        out.append(min(fragments - 1, running * fragments // max(total, 1)))
        running += size
    return out


def sync_offset(fragment: int, fragments: int, sync_every: int) -> int:
    """Fragment f syncs at the steps t with t mod H = ⌊(f+1)·H/F⌋ mod H (the last at multiples of H)."""
    return (fragment + 1) * sync_every // fragments % sync_every


def _state_like(param: torch.Tensor, dtype: torch.dtype, device, fill=None) -> torch.Tensor:
    """A copy of the param's local tensor (or zeros) in `dtype` on `device`, a DTensor placed like the param
    when it is one."""
    piece = local(param).detach()
    piece = torch.zeros_like(piece, dtype=dtype, device=device) if fill == 0 else \
        piece.to(dtype=dtype, device=device, copy=True)
    if not is_dtensor(param):
        return piece
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(piece, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _replicate_ranks(mesh) -> list[int] | None:
    import torch.distributed as dist
    if mesh is None:
        return None
    group = mesh.get_group() if hasattr(mesh, "get_group") else mesh
    return dist.get_process_group_ranks(group)


class LocalSteps(torch.optim.Optimizer):
    """Local steps with a compressed outer exchange (module docstring; docs/design.md §10).

    A torch.optim.Optimizer subclass (so lr schedulers, DCP's get_state_dict and `isinstance` checks
    take it) that holds no param groups of its own: `param_groups` is the inner optimizer's list (a
    scheduler drives the inner lr), `state` holds the outer state per param.

    inner: a shardopt optimizer built without replicate_mesh, or any torch.optim.Optimizer, over params
        whose gradients nobody averages across the replicas (FSDP2 on the shard mesh only; DDP only
        inside a replica).
    replicate_mesh: 1-D DeviceMesh or ProcessGroup of the replicas (the slow axis).
    sync_every: H ≥ 1, inner steps per round.
    outer_lr, outer_momentum, nesterov: the outer SGD (MuLoCo's 0.7 / 0.6 / Nesterov by default).
    exchange: one of outer.EXCHANGES ("mean", "mean_bf16", "int8", "int4", "sign_vote", "sign_mean",
        "lowrank").
    rank_fraction: "lowrank"'s r = ⌈rank_fraction·min(m, n)⌉ per 2-D param (one whose (a+b)·r < a·b;
        the others go by sign_vote), with a warm-started Q (b×r, N(0,1) from the seed) in the state.
    block: entries per scale of "int8" / "int4" / "sign_vote" / "sign_mean"; vote: "sign_vote"'s wire format (vote.py,
        or "auto").
    overlap: round k's exchange runs during round k+1 (one collective advanced per inner step) and is
        applied at round k+1's end, with the inner progress made meanwhile kept on top. θ_outer is
        bitwise equal on every replica after every sync; θ then differs by each replica's own progress.
    fragments: F ≥ 1 (≤ H) groups of params, in param order and balanced by size, synced at staggered
        steps (fragment f at t ≡ ⌊(f+1)·H/F⌋ mod H): each sync sends about 1/F of the model.
    state_dtype: torch.float32 (default) or torch.bfloat16 for θ_outer, b and e; state_device: None (the
        param's) or "cpu" (offload; the sync copies through the host).
    seed: the vote's tie coins (equal on every replica). model: optional, the wrapped nn.Module, checked
        for a DistributedDataParallel whose group reaches across the replicas.
    double_averaging_check: at the first sync with a nonzero Δ, raise shardopt.DoubleAveragingError
        when every replica's Δ is bitwise equal (someone averaged the gradients over the replicas, or
        all read the same batches): 24 bytes once.

    Memory beyond the inner optimizer, per param element (s = state_dtype's size): θ_outer s, b s
    (outer_momentum > 0), e s (lossy formats), with overlap θ_start, the pending Δ̄ and e: 3 s more.
    Per sync: a flat fp32 x and the format's decoded copies of the syncing fragment, O(model / F).
    Each sync reads one flag back to the host (one device sync).
    """

    def __init__(self, inner: torch.optim.Optimizer, *, replicate_mesh, sync_every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.6, nesterov: bool = True, exchange: str = "sign_vote",
                 block: int = 4096, vote: str = "alltoall_1bit", rank_fraction: float = 0.25,
                 overlap: bool = False, fragments: int = 1,
                 state_dtype=torch.float32, state_device=None, seed: int = 0, model=None,
                 double_averaging_check: bool = True):
        if not isinstance(inner, torch.optim.Optimizer):
            raise ValueError(f"inner must be a torch.optim.Optimizer (a shardopt optimizer or a torch one), got "
                             f"{type(inner).__name__}")
        if isinstance(inner, LocalSteps):
            raise ValueError("inner is already a LocalSteps; wrap the inner optimizer once")
        if type(sync_every) is not int or sync_every < 1:
            raise ValueError(f"sync_every must be an int ≥ 1 (inner steps per round), got {sync_every!r}")
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr!r}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        if not 0 < rank_fraction <= 1:
            raise ValueError(f"rank_fraction must be in (0, 1] (rank / min(m, n) of \"lowrank\"), got {rank_fraction!r}")
        if type(fragments) is not int or not 1 <= fragments <= sync_every:
            raise ValueError(f"fragments must be an int in [1, sync_every={sync_every}] (each fragment syncs once "
                             f"per round, at its own step), got {fragments!r}")
        state_dtype = getattr(torch, state_dtype) if isinstance(state_dtype, str) else state_dtype
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype!r}")
        if state_device not in (None, "cpu"):
            raise ValueError(f"state_device must be None (the param's device) or 'cpu', got {state_device!r}")
        replica_axis = getattr(inner, "replicate", None)
        if isinstance(replica_axis, Axis) and replica_axis.size > 1:
            raise ValueError(f"inner ({type(inner).__name__}) exchanges on a replicate axis of {replica_axis.size} "
                             f"ranks (its replicate_mesh, given or derived from the params' placements); build it "
                             f"without replicate_mesh (FSDP2: fully_shard(model, mesh=mesh['shard'])) and pass the "
                             f"mesh to LocalSteps(replicate_mesh=...)")
        self.inner = inner
        self.format = outer_format(exchange, block=block, vote=vote)   # ("lowrank": its non-matrix part)
        self.exchange_name, self.rank_fraction = exchange, rank_fraction
        self._formats: list = []   # per fragment: self.format, or its LowRank
        self.sync_every, self.outer_lr, self.outer_momentum, self.nesterov = sync_every, outer_lr, outer_momentum, \
            nesterov
        self.overlap, self.fragments, self.seed = bool(overlap), fragments, int(seed)
        self.state_dtype, self.state_device = state_dtype, state_device
        self.double_averaging_check = double_averaging_check
        self.replicate = Axis("replicate", replicate_mesh)
        self.replicate.attach(self, per_step=False)   # torchft: healing (shardopt/torchft)
        self._check_model(model)
        self.other_axes = self._other_axes(replicate_mesh)
        # torch.optim.Optimizer's own attributes, without its param groups (the inner ones serve)
        self.defaults = inner.defaults
        for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                      "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                      "_optimizer_load_state_dict_post_hooks"):
            setattr(self, hooks, OrderedDict())
        self._patch_step_function()
        self.state: defaultdict = defaultdict(dict)
        self._in_flight: dict[int, list] = {}   # fragment → [generator, its pending collective, x]
        self.steps = 0
        self.discarded_rounds = 0
        self._checked_double_averaging = not double_averaging_check

    # ---- construction checks -------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.inner.param_groups for p in group["params"]]

    def _check_model(self, model) -> None:
        """A DDP whose process group holds another replica of this one's replicate axis averages the
        gradients across the replicas every step (bytes on the slow axis, replicas identical)."""
        from torch.nn.parallel import DistributedDataParallel
        if model is None or not isinstance(model, DistributedDataParallel) or self.replicate.size == 1:
            return
        import torch.distributed as dist
        ddp_ranks = set(dist.get_process_group_ranks(model.process_group))
        replicas = set(dist.get_process_group_ranks(self.replicate.group))
        if len(ddp_ranks & replicas) > 1:
            raise ValueError(f"model is a DistributedDataParallel over ranks {sorted(ddp_ranks)}, which include "
                             f"other replicas of replicate_mesh (ranks {sorted(replicas)}): DDP would average the "
                             f"gradients across the replicas every step; build DDP on the ranks of one replica "
                             f"(DistributedDataParallel(module, process_group=intra_replica_group)) or pass "
                             f"inner an optimizer over the plain module")

    def _other_axes(self, replicate_mesh) -> list[Axis]:
        """The shard / tensor axes of the params (the inner shardopt optimizer's, else from the DTensor
        placements): a round's discard is agreed over them too, so a replica never applies half a round."""
        if isinstance(getattr(self.inner, "shard", None), Axis):
            return [self.inner.shard, self.inner.tensor]
        params = self._params()
        derived, shard, tensor = derive_meshes([(p, f"#{i}") for i, p in enumerate(params)], None, None)
        if derived is not None and _replicate_ranks(derived) != _replicate_ranks(replicate_mesh):
            raise ValueError(f"the params are replicated over ranks {_replicate_ranks(derived)} of their mesh, but "
                             f"replicate_mesh holds ranks {_replicate_ranks(replicate_mesh)}; pass the params' "
                             f"replicate mesh dim (mesh['replicate'])")
        return [Axis("shard", shard), Axis("tensor", tensor)]

    # ---- state ------------------------------------------------------------------------------------
    def _synced_params(self) -> list[torch.Tensor]:
        """The params this rank syncs and keeps outer state for: all of them (a subclass may own a part)."""
        return self._params()

    def _agreement_axes(self) -> list[Axis]:
        """The axes besides the replicas over which a round's discard is agreed."""
        return self.other_axes

    def _fragments(self) -> list[int]:
        return fragment_of([p.numel() for p in self._synced_params()], self.fragments)

    def _init_state(self) -> None:
        for param in self._synced_params():
            if self.state.get(param):
                continue
            device = self.state_device or local(param).device
            state = self.state[param]
            state["outer_params"] = _state_like(param, self.state_dtype, device)
            if self.outer_momentum > 0:
                state["outer_momentum"] = _state_like(param, self.state_dtype, device, fill=0)
            if self.format.lossy:
                state["outer_error"] = _state_like(param, self.state_dtype, device, fill=0)
            if self.overlap:
                state["outer_start"] = _state_like(param, self.state_dtype, device)
                state["outer_pending_mean"] = _state_like(param, torch.float32, device, fill=0)
                if self.format.lossy:
                    state["outer_pending_error"] = _state_like(param, self.state_dtype, device, fill=0)
                state["outer_pending"] = torch.zeros((), dtype=torch.int64)   # 0 none, 1 apply, 2 discard
            state["outer_rounds"] = torch.zeros((), dtype=torch.int64)
            if self._low_rank(param):
                state["outer_Q"] = init_state(param, self._dion_group(), self._param_seed(param))["Q"]
        if not self._formats:
            self._formats = [self._fragment_format(fragment) for fragment in range(self.fragments)]

    def _dion_group(self) -> dict:
        return {"rank_fraction": self.rank_fraction, "rank_multiple_of": 1, "state_dtype": "float32", "split": None,
                "algorithm": "dion"}

    def _param_seed(self, param) -> int:
        index = next(i for i, p in enumerate(self._params()) if p is param)
        return mix_seed(self.seed, index)

    def _low_rank(self, param) -> bool:
        return self.exchange_name == "lowrank" and param.ndim == 2 and compressed(matrix_layout(param),
                                                                                  self._dion_group())

    def _fragment_format(self, fragment: int):
        """The fragment's format: self.format, or for "lowrank" a LowRank over its matrices' Q state."""
        if self.exchange_name != "lowrank":
            return self.format
        matrices, offset = [], 0
        for param in self._fragment_params(fragment):
            if self._low_rank(param):
                layout = matrix_layout(param)
                Q = self.state.get(param, {}).get("outer_Q")   # (None: a format for bytes() only)
                matrices.append(LowRankMatrix(offset, tuple(local(param).shape), layout,
                                              rank_of(layout, self._dion_group()), None if Q is None else local(Q)))
            offset += local(param).numel()
        return LowRank(matrices, self.format, Axes(self.replicate, *self.other_axes))

    def _fragment_params(self, fragment: int) -> list:
        return [p for p, f in zip(self._synced_params(), self._fragments()) if f == fragment]

    def _local(self, param: torch.Tensor, key: str) -> torch.Tensor:
        return local(self.state[param][key])

    def _flat(self, params: list, key_or_fn) -> torch.Tensor:
        return torch.cat([key_or_fn(p).reshape(-1).float() for p in params])

    def _scatter(self, flat: torch.Tensor, params: list, write) -> None:
        """write(param, piece) for each param's piece of `flat`, shaped like its local tensor."""
        for param, piece in zip(params, flat.split([local(p).numel() for p in params])):
            write(param, piece.view(local(param).shape))

    # ---- step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One inner step; then the syncs of the fragments due at this step (module docstring)."""
        self._init_state()
        with torch.enable_grad():
            loss = self.inner.step(closure)
        self._count_step()
        return loss

    @torch.no_grad()
    def skip_step(self) -> None:
        """A step whose inner step someone else skipped (DeepSpeed's fp16/bf16 wrapper on an overflow): it
        counts towards the round as step() does, and the syncs due at it run (every replica must reach
        each sync at the same step, whatever its own inner steps did)."""
        self._init_state()
        self._count_step()

    def _count_step(self) -> None:
        self.steps += 1
        for fragment in sorted(self._in_flight):
            self._advance(fragment)
        for fragment in range(self.fragments):
            if self.steps % self.sync_every == sync_offset(fragment, self.fragments, self.sync_every):
                self._sync(fragment, self._fragment_params(fragment))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def replace_params(self, pairs) -> None:
        """Each (old, new): `new` takes `old`'s outer state, and the inner optimizer's (its own
        replace_params, where it has one): DeepSpeed's fp32 master copies stand in for the params."""
        for old, new in pairs:
            if old in self.state:
                self.state[new] = self.state.pop(old)
        if hasattr(self.inner, "replace_params"):
            self.inner.replace_params(pairs)

    def add_param_group(self, param_group: dict) -> None:
        self.inner.add_param_group(param_group)

    @property
    def last_grad_norm(self):
        """The inner optimizer's agreed gradient norm of its last clipped step (None if it keeps none)."""
        return getattr(self.inner, "last_grad_norm", None)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups):   # torch.optim.Optimizer.__setstate__ and load paths assign it
        self.inner.param_groups = groups

    def _round_seed(self, fragment: int, params: list) -> int:
        """The vote's coins of this round of this fragment: the same on every replica."""
        return mix_seed(self.seed, int(self.state[params[0]]["outer_rounds"]) * self.fragments + fragment)

    def _pseudo_gradient(self, params: list, start_key: str) -> torch.Tensor:
        """x = (θ_start − θ) + e, flat fp32 on the params' device."""
        def delta(p):
            d = self._local(p, start_key).to(local(p).device).float() - local(p).float()
            return d + self._local(p, "outer_error").to(d.device).float() if self.format.lossy else d
        return self._flat(params, delta)

    def _sync(self, fragment: int, params: list) -> None:
        if not params:
            return
        if self.overlap:
            return self._overlapped_sync(fragment, params)
        self.replicate.begin_round()   # torchft: the quorum (shardopt/torchft/axis.py)
        x = self.replicate.contribution(self._pseudo_gradient(params, "outer_params"))   # torchft: 0 while healing
        self._check_double_averaging(x)
        fmt = self._formats[fragment]
        mean, own, nonfinite = complete(fmt.exchange(x, self.replicate, self._round_seed(fragment, params)))
        if self.replicate.end_round(not self._agreed_discard(nonfinite, params)):   # torchft: agreed should_commit
            fmt.commit()
            self._commit(params, mean, x - own if self.format.lossy else None)
        self._reset(params)

    def _overlapped_sync(self, fragment: int, params: list) -> None:
        """Apply the exchange started at this fragment's last sync (its result waited for now), start
        this round's: θ ← θ_outer + (θ − θ_start), θ_start ← θ."""
        self._finish(fragment)
        pending = int(self.state[params[0]]["outer_pending"])
        if pending == 1:
            self._commit(params, self._flat(params, lambda p: self._local(p, "outer_pending_mean")),
                         self._flat(params, lambda p: self._local(p, "outer_pending_error"))
                         if self.format.lossy else None)
        x = self._pseudo_gradient(params, "outer_start")
        self._check_double_averaging(x)
        generator = self._formats[fragment].exchange(x, self.replicate, self._round_seed(fragment, params))
        self._in_flight[fragment] = [generator, None, x, params]
        self._advance(fragment)
        for param in params:
            outer = self._local(param, "outer_params").to(local(param).device).float()
            progress = local(param).float() - self._local(param, "outer_start").to(outer.device).float()
            local(param).copy_(outer if pending == 2 else outer + progress)
            self._local(param, "outer_start").copy_(local(param))
            self.state[param]["outer_rounds"] += 1

    def _advance(self, fragment: int) -> None:
        """Resume the fragment's exchange with its last collective's result, up to its next collective
        (or its end: the result goes to the pending state)."""
        flight = self._in_flight[fragment]
        generator, pending, x, params = flight
        try:
            flight[1] = generator.send(None if pending is None else pending.wait())
        except StopIteration as stop:
            del self._in_flight[fragment]
            mean, own, nonfinite = stop.value
            discard = self._agreed_discard(nonfinite, params)
            if not discard:
                self._formats[fragment].commit()
            self._scatter(mean, params, lambda p, piece: self._local(p, "outer_pending_mean").copy_(piece))
            if self.format.lossy:
                self._scatter(x - own, params, lambda p, piece: self._local(p, "outer_pending_error").copy_(piece))
            for param in params:
                self.state[param]["outer_pending"].fill_(2 if discard else 1)

    def _finish(self, fragment: int) -> None:
        while fragment in self._in_flight:
            self._advance(fragment)

    def _agreed_discard(self, nonfinite: torch.Tensor, params: list) -> bool:
        """Whether the round is discarded: the exchange's flag (agreed over the replicas), agreed over
        the shard and tensor axes (one small all-reduce each) and read on the host (the sync's one
        device sync). Logs the warning."""
        flag = nonfinite.float().reshape(1)
        for axis in self._agreement_axes():
            flag = axis.all_reduce(flag, "max")
        if not bool(flag.item()):
            return False
        self.discarded_rounds += 1
        logger.warning("shardopt LocalSteps: a non-finite pseudo-gradient on some replica at step %d; the round of "
                       "%d params is discarded on every replica (θ ← θ_outer)", self.steps, len(params))
        return True

    def _reset(self, params: list) -> None:
        """θ ← θ_outer; the round is over."""
        for param in params:
            local(param).copy_(self._local(param, "outer_params"))
            self.state[param]["outer_rounds"] += 1

    def _commit(self, params: list, mean: torch.Tensor, error: torch.Tensor | None) -> None:
        """e ← error; the outer SGD step on θ_outer with Δ̄ = mean (flat over `params`)."""
        def update(param, piece):
            state = self.state[param]
            outer = local(state["outer_params"])
            momentum = local(state["outer_momentum"]) if "outer_momentum" in state else None
            outer_sgd(outer, momentum, piece.to(outer.device), lr=self.outer_lr, mu=self.outer_momentum,
                      nesterov=self.nesterov)
        if error is not None:
            self._scatter(error, params, lambda p, piece: self._local(p, "outer_error").copy_(piece))
        self._scatter(mean, params, update)

    def _check_double_averaging(self, x: torch.Tensor) -> None:
        if not self._checked_double_averaging and self.replicate.size > 1:
            self._checked_double_averaging = check_not_double_averaged(
                [x], self.replicate, [axis for axis in self.other_axes if axis.size > 1], x.device, self.steps)

    # ---- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The inner optimizer's state dict (torch.optim's format) with the outer state added to each
        param's entry (keys outer_*, DTensors where the params are) and the step count: what DCP and
        safetensors save. With an exchange in flight it is waited for first (every replica must call
        state_dict at the same step, as for any checkpoint) and its result saved as pending."""
        for fragment in sorted(self._in_flight):
            self._finish(fragment)
        inner = self.inner.state_dict()
        for index, param in enumerate(self._params()):
            outer = dict(self.state.get(param, {}))
            if outer or index == 0:   # (the step count also where this rank syncs no params: ZeRO's owners)
                outer["outer_steps"] = torch.tensor(self.steps, dtype=torch.int64)
            inner["state"][index] = {**inner["state"].get(index, {}), **outer}   # (torch's entries are live state)
        return inner

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what state_dict() returned: the inner keys into the inner optimizer, the outer_* keys
        here (copied into freshly made tensors of this optimizer's dtypes and devices)."""
        # the state's keys are what the groups' "params" list (indices; DCP's set_state_dict gives FQNs), in
        # param order, as torch.optim.Optimizer.load_state_dict maps them
        position = {key: i for i, key in enumerate(key for group in state_dict["param_groups"] for key in group["params"])}
        inner_state, outer_states = {}, {}
        for key, entry in state_dict["state"].items():
            inner_state[key] = {k: v for k, v in entry.items() if not k.startswith("outer_")}
            outer_states[position[key]] = {k: v for k, v in entry.items() if k.startswith("outer_")}
        if any(outer_states.values()):
            self._init_state()
        for index, param in enumerate(self._params()):
            outer = outer_states.get(index, {})
            for key, value in outer.items():
                if key == "outer_steps":
                    self.steps = int(value)
                    continue
                if key not in self.state[param]:
                    raise ValueError(f"state_dict holds {key!r} for param #{index}, which this LocalSteps does not "
                                     f"keep (exchange {self.format.name!r}, overlap {self.overlap}, outer_momentum "
                                     f"{self.outer_momentum}); build LocalSteps with the checkpoint's settings")
                local(self.state[param][key]).copy_(local(value))
        self._in_flight.clear()
        self.inner.load_state_dict({"state": {k: v for k, v in inner_state.items() if v},
                                    "param_groups": state_dict["param_groups"]})

    # ---- traffic and checks -----------------------------------------------------------------------
    def comm_stats(self) -> dict:
        """Bytes sent/received and calls per axis: the outer exchange on "replicate", the inner
        optimizer's own axes (shard, tensor) as it counts them."""
        inner = self.inner.comm_stats() if hasattr(self.inner, "comm_stats") else {}
        axes = {axis.name: axis.stats() for axis in self.other_axes}
        return {**axes, **{name: stats for name, stats in inner.items() if name != "replicate"},
                "replicate": self.replicate.stats()}

    def reset_comm_stats(self) -> None:
        self.replicate.reset_stats()
        for axis in self.other_axes:
            axis.reset_stats()
        if hasattr(self.inner, "reset_comm_stats"):
            self.inner.reset_comm_stats()

    def sync_bytes(self, replicas: int | None = None) -> list[int]:
        """Replicate-axis bytes of each fragment's sync at `replicas` (the format's bytes() of its local
        elements); 0 on the inner steps."""
        replicas = self.replicate.size if replicas is None else replicas
        formats = self._formats or [self._fragment_format(fragment) for fragment in range(self.fragments)]
        return [formats[fragment].bytes(sum(local(p).numel() for p in self._fragment_params(fragment)), replicas)
                for fragment in range(self.fragments)]

    def describe(self, replicas: int | None = None) -> str:
        replicas = self.replicate.size if replicas is None else replicas
        total = sum(self.sync_bytes(replicas))
        numel = sum(local(p).numel() for p in self._synced_params())
        ddp = 8 * numel * (replicas - 1) // max(replicas, 1)
        ratio = f", {ddp * self.sync_every / total:.0f}× fewer than an fp32 all-reduce every step" if total else ""
        lines = [f"LocalSteps: sync every {self.sync_every} steps, exchange {self.format.name!r}, outer lr "
                 f"{self.outer_lr:g}, momentum {self.outer_momentum:g}{' Nesterov' if self.nesterov else ''}, "
                 f"{self.fragments} fragment(s){', overlapped' if self.overlap else ''}",
                 f"  replicate axis ({replicas} replicas): {total:,} B per round of {self.sync_every} steps "
                 f"({total / self.sync_every:,.0f} B/step){ratio}; inner steps send 0 B"]
        if hasattr(self.inner, "describe"):
            lines.append("inner optimizer (its replicate axis unused):\n" + self.inner.describe())
        return "\n".join(lines)

    @torch.no_grad()
    def replicas_consistent(self) -> bool:
        """True when what the contract makes bitwise equal on every replica is: the params right after a
        sync without overlap; θ_outer with overlap (one hash per tensor, one all-gather)."""
        if self.overlap:
            tensors = [self._local(p, "outer_params") for p in self._params() if self.state[p]]
        else:
            tensors = [local(p) for p in self._params()]
        return replicas_equal(tensors, self.replicate)
