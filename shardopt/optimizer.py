"""The optimizer classes: validation, param groups, state and the step loop (no math, no collectives).

`ShardOptimizer` holds the two mesh axes and routes each param group to its
algorithm: matrix algorithms ("dion", "signmuon", "muon") get buckets of
same-layout matrices (one stacked call, one collective per bucket), the
element-wise ones ("adamw", "lion") get the whole group.
"""

from __future__ import annotations

import logging
import zlib

import torch

from . import dion, scalar, signmuon, traffic
from .comm import Axis
from .hyperparams import DEFAULTS, MATRIX_ALGORITHMS, normalize_dtype_names, validate_group
from .placement import derive_meshes, local, matrix_buckets
from .schedule import complete, overlap

logger = logging.getLogger("shardopt")
NONFINITE = ("skip", "raise")
MATRIX_STEPS = {"dion": dion.step, "signmuon": signmuon.step, "muon": signmuon.muon_step}
MATRIX_INIT = {"dion": dion.init_state, "signmuon": signmuon.init_state, "muon": signmuon.init_state}
# the state each replica keeps for itself (averaged by synchronize_for_checkpoint)
DECOUPLED_MOMENTUM = {"dion": "momentum", "signmuon": "momentum", "muon": "momentum", "lion": "exp_avg"}


class ShardOptimizer(torch.optim.Optimizer):
    """Base of Dion and SignMuon. Param groups choose their `algorithm`; groups without one get
    the class's `matrix_algorithm`.

    replicate_mesh: 1-D DeviceMesh or ProcessGroup of the data-parallel replicas whose
        gradients this optimizer exchanges itself (nobody else may average them), or None.
    shard_mesh: 1-D DeviceMesh of the weight-parallel axis, or None.
    seed: seeds Dion's Q₀ and Sign-Muon's tie-breaking coins; must be equal on all ranks.
    agreement_timeout_s: bound on the construction-time check that all ranks hold the same
        parameters and settings (a mismatch raises on every rank instead of hanging later).
    nonfinite: what a NaN/inf gradient on any rank does to a step. "skip" (default): the step is
        skipped on every rank, no state changes (momenta, Q, step counts), `skipped_steps` counts
        it and a warning is logged. "raise": FloatingPointError on every rank, state untouched.
        The check is one all-reduce of one float per axis and one device sync per step.
    """

    matrix_algorithm = "dion"
    overlap_depth = 2   # bucket steps in flight: one bucket's collective overlaps the next one's compute

    def __init__(self, params, defaults: dict, *, replicate_mesh=None, shard_mesh=None, seed: int = 0,
                 agreement_timeout_s: float = 60.0, nonfinite: str = "skip"):
        if nonfinite not in NONFINITE:
            raise ValueError(f"Invalid nonfinite: {nonfinite!r}; allowed: {', '.join(map(repr, NONFINITE))}")
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self.seed = int(seed)
        self._param_index: dict[torch.Tensor, int] = {}
        self._param_label: dict[torch.Tensor, str] = {}
        super().__init__(params, {**DEFAULTS, **defaults})
        labeled = list(self._param_label.items())
        replicate_mesh, shard_mesh = derive_meshes(labeled, replicate_mesh, shard_mesh)
        self.replicate = Axis("replicate", replicate_mesh)
        self.shard = Axis("shard", shard_mesh)
        self._check_ranks_agree(agreement_timeout_s)
        self.reset_comm_stats()

    # ---- param groups -------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        param_group.setdefault("algorithm", self.matrix_algorithm)
        explicit_keys = [key for key in param_group if key in DEFAULTS]
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        names = group.get("param_names") or [None] * len(group["params"])
        labels = [f"{name!r}" if name else f"#{position} of param group {index}" for position, name in enumerate(names)]
        try:
            normalize_dtype_names(group)
            validate_group(group, index, explicit_keys)
            for param, label in zip(group["params"], labels):
                if not param.dtype.is_floating_point:
                    raise ValueError(f"param {label} of param group {index} ({group['algorithm']!r}) has dtype "
                                     f"{param.dtype}; shardopt optimizes floating-point tensors only (float32, "
                                     f"float64, bfloat16, float16)")
                if group["algorithm"] in MATRIX_ALGORITHMS and param.ndim != 2:
                    raise ValueError(f"param {label} with shape {tuple(param.shape)} is in a {group['algorithm']!r} "
                                     f"group but is not 2-D; put it in an 'adamw' or 'lion' group "
                                     f"(shardopt.param_groups(model) does this)")
        except ValueError:
            self.param_groups.pop()   # a rejected group leaves nothing behind (DESIGN §7)
            raise
        for param, label in zip(group["params"], labels):
            self._param_index[param] = len(self._param_index)
            self._param_label[param] = label

    def _check_ranks_agree(self, timeout_s: float) -> None:
        """Every rank of each axis must hold the same parameters (shapes, dtypes, placements) and
        settings; otherwise the first collective of a step would hang. One small all-gather per axis."""
        description = [f"{label}|{tuple(p.shape)}|{p.dtype}|{getattr(p, 'placements', None)}"
                       for p, label in self._param_label.items()]
        settings = [repr(sorted((k, v) for k, v in g.items() if k not in ("params", "lr"))) for g in self.param_groups]
        fields = {"number of params": len(description), "param shapes/dtypes/placements": zlib.crc32("\n".join(description).encode()),
                  "group settings": zlib.crc32("\n".join(settings).encode()), "seed": self.seed}
        for axis in (self.replicate, self.shard):
            per_rank = axis.agree(list(fields.values()), timeout_s)
            for position, field in enumerate(fields):
                values = [row[position] for row in per_rank]
                if len(set(values)) > 1:
                    shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)) if field in ("number of params", "seed") \
                        else ", ".join(f"rank {r}: {'same as rank 0' if v == values[0] else 'different'}" for r, v in enumerate(values))
                    raise ValueError(f"ranks of the {axis.name} axis disagree on the {field} ({shown}); every rank "
                                     f"must build the optimizer from the same model and arguments")

    # ---- step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._nonfinite_gradients():
            return loss
        overlap(self._bucket_steps(), depth=self.overlap_depth)
        return loss

    def nonfinite_anywhere(self, grads: list[torch.Tensor]) -> bool:
        """True, on every rank alike, when any rank of either axis has a NaN/inf in its local `grads`
        (or a gradient norm that overflows its dtype). One all-reduce of one float per axis and one
        device sync: every rank must take the same branch."""
        if grads:
            norms = torch.stack(torch._foreach_norm(grads)).float()
            flag = (~torch.isfinite(norms)).any().float().reshape(1)
        else:
            flag = torch.zeros(1, device=local(self.param_groups[0]["params"][0]).device)
        for axis in self.agreement_axes():
            axis.all_reduce(flag, "max")
        return bool(flag.item())

    def agreement_axes(self) -> tuple[Axis, ...]:
        """The axes over which every rank must take the same branch of a step."""
        return (self.replicate, self.shard)

    def _nonfinite_gradients(self) -> bool:
        """True when the step must be skipped (nonfinite="skip"); raises for nonfinite="raise"."""
        grads = [local(p.grad) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not self.nonfinite_anywhere(grads):
            return False
        local_bad = [self._param_label[p] for group in self.param_groups for p in group["params"]
                     if p.grad is not None and not bool(torch.isfinite(local(p.grad)).all())]
        where = f"this rank's params {', '.join(local_bad[:5])}" if local_bad else "another rank"
        if self.nonfinite == "raise":
            raise FloatingPointError(f"non-finite gradient (NaN/inf) in {where}; no state was changed "
                                     f"(nonfinite='raise'; use nonfinite='skip' to skip such steps)")
        self.skipped_steps += 1
        logger.warning("shardopt: skipped a step with a non-finite gradient in %s (%d skipped so far)", where,
                       self.skipped_steps)
        return True

    def _bucket_steps(self):
        """One step generator per bucket (matrix groups) or per group (element-wise), in param order."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["algorithm"] in MATRIX_ALGORITHMS:
                for (layout, _, _), bucket in self._buckets(params).items():
                    yield self._matrix_step(bucket, group, layout)
            else:
                yield self._scalar_step(params, group)

    def _buckets(self, params) -> dict:
        return matrix_buckets(params)

    def _states(self, params, init) -> list[dict]:
        states = []
        for param in params:
            state = self.state[param]
            if not state:
                state.update(init(param))
                state["step"] = torch.tensor(0.0)
            state["step"] += 1
            states.append(state)
        return states

    def _matrix_step(self, params, group: dict, layout):
        algorithm = group["algorithm"]
        init = MATRIX_INIT[algorithm]
        states = self._states(params, lambda p: init(p, layout, group, self._seed(p)))
        return MATRIX_STEPS[algorithm]([local(p) for p in params], [local(p.grad) for p in params], _local_states(states),
                                group, layout, self.replicate, self.shard, self._step_seed(params[0], states[0]))

    def _scalar_step(self, params, group: dict):
        states = self._states(params, lambda p: scalar.init_state(p, group["algorithm"]))
        return scalar.step([local(p) for p in params], [local(p.grad) for p in params], _local_states(states), group,
                    self.replicate, self._step_seed(params[0], states[0]))

    def _seed(self, param) -> int:
        return (self.seed * 1_000_003 + self._param_index[param]) % 2**63

    def _step_seed(self, first_param, first_state) -> int:
        """The seed of one bucket's coins at this step: equal on every rank, new every step."""
        return (self._seed(first_param) * 1_000_003 + int(first_state["step"])) % 2**63

    # ---- traffic ------------------------------------------------------------------------------
    def replicate_bytes_per_step(self, replicas: int | None = None) -> list[int]:
        """Bytes this rank sends on the replicate axis per step, per param group, at `replicas`
        replicas (default: this optimizer's replicate axis); see traffic.py. The step's non-finite
        check (`traffic.nonfinite_check_bytes`) comes on top, once per step."""
        replicas = self.replicate.size if replicas is None else replicas
        return [traffic.group_bytes(group, replicas) for group in self.param_groups]

    def describe(self, replicas: int | None = None) -> str:
        """One line per param group with its replicate-axis bytes per step, and the whole model
        against a float32 all-reduce of every parameter (traffic.describe)."""
        return traffic.describe(self.param_groups, self.replicate.size if replicas is None else replicas)

    # ---- distributed helpers ------------------------------------------------------------------
    def comm_stats(self) -> dict:
        """Bytes this rank sent/received and calls issued per axis since construction (or the last reset)."""
        return {"replicate": self.replicate.stats(), "shard": self.shard.stats()}

    def reset_comm_stats(self) -> None:
        self.replicate.reset_stats()
        self.shard.reset_stats()

    @torch.no_grad()
    def synchronize_for_checkpoint(self) -> None:
        """Average the decoupled momenta (matrix groups' "momentum", Lion groups' "exp_avg") over the
        replicate axis (one all-reduce per dtype), so a checkpoint holds one momentum that every
        replica agrees on. AdamW's moments come from averaged gradients: equal already."""
        momenta = [local(self.state[p][DECOUPLED_MOMENTUM[group["algorithm"]]]) for group in self.param_groups
                   for p in group["params"] if group["algorithm"] in DECOUPLED_MOMENTUM and self.state.get(p)]
        if momenta:
            for momentum, mean in zip(momenta, complete(scalar.mean_gradients(momenta, self.replicate))):
                momentum.copy_(mean)

    @torch.no_grad()
    def replicas_consistent(self) -> bool:
        """True when every parameter is bitwise equal on all replicas (one all-gather of one hash
        per parameter; reading the answer is a device sync)."""
        params = [local(p) for group in self.param_groups for p in group["params"]]
        if self.replicate.size == 1 or not params:
            return True
        hashes = torch.stack([bit_hash(p) for p in params])
        gathered = self.replicate.all_gather(hashes)
        return bool((gathered == gathered[0]).all())


def _local_states(states: list[dict]) -> list[dict]:
    """The same state with every DTensor replaced by its local tensor (a view: writes go through)."""
    return [{key: local(value) for key, value in state.items()} for state in states]


def bit_hash(tensor: torch.Tensor) -> torch.Tensor:
    """A position-weighted int64 hash of the raw bits of `tensor` (equal bits ⇒ equal hash)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    raw = tensor.detach().contiguous().view(bits).reshape(-1).to(torch.int64)
    weights = torch.arange(raw.numel(), device=raw.device, dtype=torch.int64) * 2654435761 + 1
    return (raw * weights).sum()


class Dion(ShardOptimizer):
    """Dion (DESIGN §1). Non-matrix params go in groups with algorithm "adamw" or "lion"
    (see `shardopt.param_groups`), which use lr, betas, epsilon and weight_decay ("lion" groups
    also `vote`, the wire format of their 1-bit vote). wire_dtype: torch.bfloat16 (default) or
    torch.float32, the precision of P and R on the replicate axis (rounded before the exchange).
    `options`: seed, agreement_timeout_s, nonfinite (see ShardOptimizer)."""

    matrix_algorithm = "dion"

    def __init__(self, params, lr: float = 0.01, mu: float = 0.95, rank_fraction: float = 1.0,
                 rank_multiple_of: int = 1, weight_decay: float = 0.01, epsilon: float = 1e-8,
                 qr_method: str = "qr", betas=(0.9, 0.95), wire_dtype=torch.bfloat16, vote: str = "auto", *,
                 replicate_mesh=None, shard_mesh=None, **options):
        defaults = dict(lr=lr, mu=mu, rank_fraction=rank_fraction, rank_multiple_of=rank_multiple_of,
                        weight_decay=weight_decay, epsilon=epsilon, qr_method=qr_method, betas=betas,
                        wire_dtype=wire_dtype, vote=vote)
        super().__init__(params, defaults, replicate_mesh=replicate_mesh, shard_mesh=shard_mesh, **options)


class SignMuon(ShardOptimizer):
    """Sign-Muon (DESIGN §2). vote: "allreduce_int8", "allgather_1bit", "alltoall_1bit" or "auto"
    (also the format of "lion" groups' vote). wire_dtype: precision of the shard-axis all-to-all of
    orthogonalize="full": torch.float32 (default, the exact Muon direction) or torch.bfloat16 (half
    the shard-axis bytes; only the signs of the result are used).
    `options`: seed, agreement_timeout_s, nonfinite (see ShardOptimizer)."""

    matrix_algorithm = "signmuon"

    def __init__(self, params, lr: float, momentum: float = 0.9, nesterov: bool = False, ns_steps: int = 5,
                 post_polar: bool = False, lr_scale: str = "none", weight_decay: float = 0.0,
                 betas=(0.9, 0.95), epsilon: float = 1e-8, ns_dtype: str | None = None, vote: str = "auto",
                 orthogonalize: str = "shard", wire_dtype=torch.float32, *, replicate_mesh=None, shard_mesh=None,
                 **options):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, post_polar=post_polar,
                        lr_scale=lr_scale, weight_decay=weight_decay, betas=betas, epsilon=epsilon,
                        ns_dtype=ns_dtype, vote=vote, orthogonalize=orthogonalize, wire_dtype=wire_dtype)
        super().__init__(params, defaults, replicate_mesh=replicate_mesh, shard_mesh=shard_mesh, **options)
