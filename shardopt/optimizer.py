"""The optimizer classes: validation, param groups, state and the step loop (no math, no collectives).

`ShardOptimizer` holds the two mesh axes and routes each param group to its
algorithm: matrix algorithms ("dion", "signmuon", "muon") get buckets of
same-layout matrices (one stacked call, one collective per bucket; a param's
matrices come from shardopt/matrices.py: a 2-D weight, each expert of a 3-D
stack, each block of a `split` param), the element-wise ones ("adamw", "lion")
get the whole group.
"""

from __future__ import annotations

import logging
import zlib

import torch

from . import dion, scalar, signmuon, traffic
from .buckets import DEFAULT_BUCKET_BYTES, capped_buckets
from .checks import check_gradients, check_group_keys, check_options, check_state_dict
from .clipping import clip_grad_norm_
from .comm import Axis
from .guard import check_not_double_averaged, replicas_equal
from .hyperparams import DEFAULTS, MATRIX_ALGORITHMS, normalize_dtype_names, state_dtype, validate_group
from .matrices import matrix_seed, param_matrices
from .placement import derive_meshes, local, tensor_split
from .schedule import complete, overlap

logger = logging.getLogger("shardopt")
MATRIX_STEPS = {"dion": dion.step, "signmuon": signmuon.step, "muon": signmuon.muon_step}
MATRIX_INIT = {"dion": dion.init_state, "signmuon": signmuon.init_state, "muon": signmuon.init_state}
# The tensors of each algorithm's per-param state (besides "step"); load_state_dict checks against it.
STATE_KEYS = {"dion": ("momentum", "Q"), "signmuon": ("momentum",), "muon": ("momentum",),
              "adamw": ("exp_avg", "exp_avg_sq"), "lion": ("exp_avg",)}
# state whose rows are each matrix's b side (dion.py), not the param's rows: a matrix's rows of it
# are ParamMatrix.of_state (the rest of a matrix algorithm's state is shaped like the param)
B_SIDE_STATE = ("Q",)
MATRIX_SPLIT = {"dion": dion.work_split, "signmuon": signmuon.work_split, "muon": signmuon.work_split}
# the state each replica keeps for itself (averaged by synchronize_for_checkpoint)
DECOUPLED_MOMENTUM = {"dion": "momentum", "signmuon": "momentum", "muon": "momentum", "lion": "exp_avg"}


class ShardOptimizer(torch.optim.Optimizer):
    """Base of Dion and SignMuon. Param groups choose their `algorithm`; groups without one get
    the class's `matrix_algorithm`. Matrix groups take 2-D weights and 3-D expert stacks (E, m, n),
    and the option `split=(dim, sizes)` for fused projections (shardopt/matrices.py).

    replicate_mesh: 1-D DeviceMesh or ProcessGroup of the data-parallel replicas whose
        gradients this optimizer exchanges itself (nobody else may average them), or None.
    shard_mesh: 1-D DeviceMesh of the weight-parallel axis, or None.
    tensor_mesh: 1-D DeviceMesh (or ProcessGroup) of the tensor-parallel axis, or None; like
        shard_mesh derived from the params' placements when not given (shardopt/placement.py).
    seed: seeds Dion's Q₀ and Sign-Muon's tie-breaking coins; must be equal on all ranks.
    agreement_timeout_s: bound on the construction-time check that all ranks hold the same
        parameters and settings (a mismatch raises on every rank instead of hanging later).
    nonfinite: what a NaN/inf gradient on any rank does to a step. "skip" (default): the step is
        skipped on every rank, no state changes (momenta, Q, step counts), `skipped_steps` counts
        it and a warning is logged. "raise": FloatingPointError on every rank, state untouched.
        The check is one all-reduce of one float per axis and one device sync per step.
    max_grad_norm: clip the gradients before the step, g ← g·min(1, max_grad_norm/(ν + 1e-6)), with ν
        agreed by all ranks (see `clip_grad_norm_`), so every replica and shard applies the same factor.
        0 (default): no clipping. Costs one all-reduce of one float per axis, no device sync.
    maximize: step along +gradient (torch.optim's maximize), for every algorithm; a group default.
    foreach, fused, capturable, differentiable: torch.optim options shardopt refuses with a
        TypeError that says what it does instead (None, the default, is accepted).
    bucket_bytes: cap on a bucket's stacked working copy (fp32; fp64 for fp64 params), so a step's
        transient memory is O(bucket_bytes), not O(model); see shardopt/buckets.py.
    double_averaging_check_every: at the first step and every this many steps after (steps 1, 1+N,
        1+2N, …), raise `DoubleAveragingError` on every rank, state untouched, when all replicas'
        local gradients are bitwise identical: something averaged them already (DDP without
        no_sync(), FSDP2 HSDP's replicate all-reduce, the DeepSpeed engine's all-reduce)
        and this optimizer would average them again (docs/design.md §9). 0 turns it off (replicas
        that legitimately see identical gradients). Only with more than one replica; costs one
        all-reduce of 3 int64 on the replicate axis, one of 2 bytes on the other axes and one device
        sync, at those steps only (`traffic.double_averaging_check_bytes`).

    Which params a step updates is agreed by all ranks: those with a gradient on at least one
    rank. A rank without a local gradient for such a param steps it with a zero gradient (it
    joins the same collectives); a param without a gradient on every rank is skipped everywhere.
    The same one-float check carries it; only a step where some rank lacks a gradient adds one
    all-reduce of one byte per param.
    """

    matrix_algorithm = "dion"
    overlap_depth = 2   # bucket steps in flight: one bucket's collective overlaps the next one's compute

    def __init__(self, params, defaults: dict, *, replicate_mesh=None, shard_mesh=None, tensor_mesh=None, seed: int = 0,
                 agreement_timeout_s: float = 60.0, nonfinite: str = "skip", max_grad_norm: float = 0.0,
                 maximize: bool = False, foreach=None, fused=None, capturable=None, differentiable=None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 double_averaging_check_every: int = traffic.DOUBLE_AVERAGING_CHECK_EVERY):
        check_options(seed=seed, agreement_timeout_s=agreement_timeout_s, nonfinite=nonfinite,
                      max_grad_norm=max_grad_norm, maximize=maximize,
                      double_averaging_check_every=double_averaging_check_every, foreach=foreach, fused=fused,
                      capturable=capturable, differentiable=differentiable)
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"Invalid bucket_bytes: {bucket_bytes!r}; bucket_bytes must be a positive integer "
                             f"(bytes of a bucket's fp32 working copy, default {DEFAULT_BUCKET_BYTES})")
        self.bucket_bytes = bucket_bytes
        self.double_averaging_check_every = double_averaging_check_every
        self.steps_called = 0   # steps the double-averaging schedule counted (not raises, not zero-gradient steps)
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self._warned_no_gradients = False
        self.seed = int(seed)
        self.max_norm = float(max_grad_norm)   # (the DeepSpeed plugin keeps its own max_grad_norm)
        self.last_grad_norm = None             # ν of the last clipped step (a 0-d tensor), for logging
        self._param_index: dict[torch.Tensor, int] = {}
        self._param_label: dict[torch.Tensor, str] = {}
        super().__init__(params, {**DEFAULTS, **defaults, "maximize": maximize})
        labeled = list(self._param_label.items())
        replicate_mesh, shard_mesh, tensor_mesh = derive_meshes(labeled, replicate_mesh, shard_mesh, tensor_mesh)
        self.replicate = Axis("replicate", replicate_mesh)
        self.shard = Axis("shard", shard_mesh)
        self.tensor = Axis("tensor", tensor_mesh)
        self.axes = (self.replicate, self.shard, self.tensor)   # the axes whose ranks hold the same params
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
            check_group_keys(group, index, DEFAULTS)
            normalize_dtype_names(group)
            validate_group(group, index, explicit_keys)
            for param, label in zip(group["params"], labels):
                if not param.dtype.is_floating_point:
                    raise ValueError(f"param {label} of param group {index} ({group['algorithm']!r}) has dtype "
                                     f"{param.dtype}; shardopt optimizes floating-point tensors only (float32, "
                                     f"float64, bfloat16, float16)")
                if group["algorithm"] in MATRIX_ALGORITHMS:
                    param_matrices(param, group, label)   # 2-D or 3-D, a `split` that fits (ValueError)
        except ValueError:
            self.param_groups.pop()   # a rejected group leaves nothing behind (docs/design.md §7)
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
                  "group settings": zlib.crc32("\n".join(settings).encode()), "seed": self.seed,
                  "bucket_bytes": self.bucket_bytes, "double_averaging_check_every": self.double_averaging_check_every}
        for axis in self.axes:
            per_rank = axis.agree(list(fields.values()), timeout_s)
            for position, field in enumerate(fields):
                values = [row[position] for row in per_rank]
                if len(set(values)) > 1:
                    shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)) \
                        if field in ("number of params", "seed", "bucket_bytes", "double_averaging_check_every") \
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
        check_gradients(self._param_label.items())
        self._check_not_double_averaged()
        stepping = self._agreed_gradients()
        if stepping is None:
            return loss
        if self.max_norm > 0:
            self.last_grad_norm = self.clip_grad_norm_(self.max_norm)
        overlap(self._bucket_steps(stepping), depth=self.overlap_depth)
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip every rank's local gradients in place by one agreed factor; returns the agreed norm ν
        (a 0-d tensor, no device sync). See `shardopt.clipping.clip_grad_norm_`."""
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        return clip_grad_norm_([local(p.grad) for p in params], max_norm, replicate=self.replicate,
                               split=self.gradient_split_axes(), device=self._device(), tensor=self.tensor,
                               tensor_split=[tensor_split(p) for p in params])

    def gradient_split_axes(self) -> tuple[Axis, ...]:
        """The axes whose ranks hold disjoint pieces of one replica's gradient (clipping sums their squares)."""
        return (self.shard,)

    def replace_params(self, pairs) -> None:
        """For each (old, new) param: `new` takes over `old`'s seed index, label and state (for a wrapper
        that swaps the params in the groups for copies, e.g. DeepSpeed's fp32 master copies)."""
        for old, new in pairs:
            self._param_index[new] = self._param_index.pop(old)
            self._param_label[new] = self._param_label.pop(old)
            if old in self.state:
                self.state[new] = self.state.pop(old)

    def nonfinite_anywhere(self, grads: list[torch.Tensor]) -> bool:
        """True, on every rank alike, when any rank of either axis has a NaN/inf in its local `grads`
        (or a gradient norm that overflows its dtype). One all-reduce of one float per axis and one
        device sync: every rank must take the same branch."""
        return self._gradient_flag(grads, missing=False) == 2

    def _gradient_flag(self, grads: list[torch.Tensor], missing: bool) -> int:
        """max over all ranks of both axes of: 2 if the rank's `grads` hold a NaN/inf, else 1 if
        `missing` (the rank lacks a gradient some param may have elsewhere), else 0. One all-reduce
        of one float per axis and one device sync."""
        if grads:
            norms = torch.stack(torch._foreach_norm(grads)).float()
            flag = torch.where((~torch.isfinite(norms)).any(), 2.0, float(missing)).reshape(1)
        else:
            flag = torch.full((1,), float(missing), device=self._device())
        for axis in self.agreement_axes():
            axis.all_reduce(flag, "max")
        return int(flag.item())

    def _check_not_double_averaged(self) -> None:
        """At the steps `traffic.double_averaging_checked` names (with more than one replica), raise
        `DoubleAveragingError` on every rank alike when the replicas' local gradients are bitwise
        identical (shardopt/guard.py). Raising, or finding zero/absent gradients everywhere (no evidence:
        e.g. torch.distributed.checkpoint's state initialization), leaves the schedule's step count as
        it was, so the next step is checked again."""
        step = self.steps_called + 1
        if self.replicate.size > 1 and traffic.double_averaging_checked(step, self.double_averaging_check_every):
            grads = [local(p.grad) for group in self.param_groups for p in group["params"] if p.grad is not None]
            others = [axis for axis in self.agreement_axes() if axis is not self.replicate]
            if not check_not_double_averaged(grads, self.replicate, others, self._device(), step):
                return
        self.steps_called = step

    def agreement_axes(self) -> tuple[Axis, ...]:
        """The axes over which every rank must take the same branch of a step."""
        return self.axes

    def _device(self) -> torch.device:
        """Where this rank's small collectives live (its first param's device)."""
        return local(self.param_groups[0]["params"][0]).device

    def _agreed_gradients(self) -> set | None:
        """The params every rank steps now (those with a gradient on some rank of the replicate, shard
        and tensor axes), or None when the step is skipped for a non-finite gradient (nonfinite="raise" raises)."""
        params = [p for group in self.param_groups for p in group["params"]]
        grads = [local(p.grad) for p in params if p.grad is not None]
        flag = self._gradient_flag(grads, missing=len(grads) < len(params))
        if flag == 2:
            self._report_nonfinite()
            return None
        if flag == 0:
            return set(params)
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=self._device())
        for axis in self.axes:                      # the axes whose ranks step the same params (a subclass's
            axis.all_reduce(has_grad, "max")        # further agreement axes, e.g. ZeRO's node, may own others)
        stepping = {p for p, anywhere in zip(params, has_grad.tolist()) if anywhere}
        if not stepping and not self._warned_no_gradients:
            self._warned_no_gradients = True
            logger.warning("shardopt: no parameter has a gradient on any rank, so this step changed nothing "
                           "(said once). Under FSDP2 HSDP, set_requires_all_reduce(False) on a 2-D mesh keeps the "
                           "gradients inside FSDP2: shard with fully_shard(model, mesh=mesh['shard']) and pass "
                           "replicate_mesh=mesh['replicate'] (docs/design.md §9)")
        return stepping

    def _report_nonfinite(self) -> None:
        """Raise (nonfinite="raise") or count and log a skipped step, naming this rank's bad params."""
        local_bad = [self._param_label[p] for group in self.param_groups for p in group["params"]
                     if p.grad is not None and not bool(torch.isfinite(local(p.grad)).all())]
        where = f"this rank's params {', '.join(local_bad[:5])}" if local_bad else "another rank"
        if self.nonfinite == "raise":
            raise FloatingPointError(f"non-finite gradient (NaN/inf) in {where}; no state was changed "
                                     f"(nonfinite='raise'; use nonfinite='skip' to skip such steps)")
        self.skipped_steps += 1
        logger.warning("shardopt: skipped a step with a non-finite gradient in %s (%d skipped so far)", where,
                       self.skipped_steps)

    def _bucket_steps(self, stepping: set):
        """One step generator per bucket (matrix groups) or per group (element-wise), in param order;
        made lazily, so only the buckets in flight hold working copies."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p in stepping]
            if not params:
                continue
            if group["algorithm"] in MATRIX_ALGORITHMS:
                init = MATRIX_INIT[group["algorithm"]]   # every param gets state, also one with no local matrix
                self._states(params, lambda p: init(p, group, self._seed(p)))
                for layout, bucket in self._buckets(params, group):
                    yield self._matrix_step(bucket, group, layout)
            else:
                yield self._scalar_step(params, group)

    def _buckets(self, params, group: dict):
        """(layout, bucket) pairs: the (param, matrix) pairs sharing (layout, dtype, device), in
        parameter order, cut into buckets under `bucket_bytes` (shardopt/buckets.py)."""
        split = MATRIX_SPLIT[group["algorithm"]]
        for layout, _, bucket in capped_buckets(params, group, self.bucket_bytes,
                                                lambda layout: split(layout, group, self.replicate.size)):
            yield layout, bucket

    def _states(self, params, init) -> list[dict]:
        """Each param's state (made by init(param) on its first step), its step count advanced."""
        states = []
        for param in params:
            state = self.state[param]
            if not state:
                state.update(init(param))
                state["step"] = torch.tensor(0.0)
            state["step"] += 1
            states.append(state)
        return states

    def _matrix_step(self, bucket, group: dict, layout):
        """The step generator of a bucket of (param, ParamMatrix) pairs: the algorithm sees each
        matrix's 2-D views of the param, its gradient and its state, and the shard and tensor axes;
        the layout says which of them split the matrix (a whole matrix — a 2-D param held whole, a
        local expert — joins no shard- or tensor-axis collective: those ranks hold other matrices)."""
        params = [param for param, _ in bucket]
        matrices = [matrix for _, matrix in bucket]
        states = [{key: (matrix.of_state if key in B_SIDE_STATE else matrix.of)(local(value))
                   for key, value in self.state[param].items() if key != "step"} for param, matrix in bucket]
        seed = self._step_seed(params[0], matrices[0].index)
        return MATRIX_STEPS[group["algorithm"]]([matrix.of(local(p)) for p, matrix in bucket],
                                                _gradients(params, group, matrices), states, group, layout,
                                                self.replicate, self.shard, seed, tensor=self.tensor)

    def _scalar_step(self, params, group: dict):
        states = self._states(params, lambda p: scalar.init_state(p, group["algorithm"]))
        return scalar.step([local(p) for p in params], _gradients(params, group), _local_states(states), group,
                    self.replicate, self._step_seed(params[0]))

    def _seed(self, param) -> int:
        return (self.seed * 1_000_003 + self._param_index[param]) % 2**63

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim's load_state_dict, after checking that every group's algorithm, every param's
        state keys, tensor shapes and dtypes fit this optimizer (ValueError naming the tensor; nothing
        is loaded then); matrix-group state keeps the group's `state_dtype` (torch.optim casts every
        floating state tensor to its param's dtype, which would round fp32 momenta of bf16 params)."""
        check_state_dict(state_dict, self.param_groups, self._param_label, STATE_KEYS)
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        groups = [group for group in self.param_groups for _ in group["params"]]
        for saved_id, param, group in zip(saved_ids, params, groups):
            if group["algorithm"] not in MATRIX_ALGORITHMS or not group.get("state_dtype") \
                    or saved_id not in state_dict["state"]:
                continue
            for key, value in state_dict["state"][saved_id].items():
                if key != "step" and isinstance(value, torch.Tensor):
                    self.state[param][key] = value.to(device=self.state[param][key].device,
                                                      dtype=state_dtype(group, param), copy=True)

    def _step_seed(self, first_param, first_matrix: int = 0) -> int:
        """The seed of one bucket's coins at this step: equal on every rank, new every step; from the
        bucket's first param and the index of its first matrix there (matrices.matrix_seed)."""
        step = int(self.state[first_param]["step"])
        return (matrix_seed(self._seed(first_param), first_matrix) * 1_000_003 + step) % 2**63

    # ---- traffic ------------------------------------------------------------------------------
    def replicate_bytes_per_step(self, replicas: int | None = None) -> list[int]:
        """Bytes this rank sends on the replicate axis per step, per param group, at `replicas`
        replicas (default: this optimizer's replicate axis); see traffic.py. The step's non-finite
        check (`traffic.nonfinite_check_bytes`) comes on top, once per step, and at the steps it runs the
        double-averaging check (`traffic.double_averaging_check_bytes`)."""
        replicas = self.replicate.size if replicas is None else replicas
        return [traffic.group_bytes(group, replicas, self.bucket_bytes) for group in self.param_groups]

    def describe(self, replicas: int | None = None) -> str:
        """One line per param group with its replicate-axis bytes per step, and the whole model
        against a float32 all-reduce of every parameter (traffic.describe)."""
        return traffic.describe(self.param_groups, self.replicate.size if replicas is None else replicas,
                                self.bucket_bytes, clipping=self.max_norm > 0,
                                double_averaging_check_every=self.double_averaging_check_every)

    # ---- distributed helpers ------------------------------------------------------------------
    def comm_stats(self) -> dict:
        """Bytes this rank sent/received and calls issued per axis since construction (or the last reset)."""
        return {axis.name: axis.stats() for axis in self.axes}

    def reset_comm_stats(self) -> None:
        for axis in self.axes:
            axis.reset_stats()

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
        """True when every parameter is bitwise equal on all replicas (guard.replicas_equal: one
        all-gather of one hash per parameter; reading the answer is a device sync)."""
        return replicas_equal([local(p) for group in self.param_groups for p in group["params"]], self.replicate)


def _gradients(params, group: dict, matrices=None) -> list[torch.Tensor]:
    """The local gradients a step reads (with `matrices`, each param's ParamMatrix: that matrix's view
    of it): g, or −g (new tensors) when the group maximizes; zeros where this rank has none (another
    rank has one, so this rank still joins the bucket's collectives)."""
    grads = []
    for param, matrix in zip(params, matrices or [None] * len(params)):
        view = matrix.of if matrix is not None else (lambda tensor: tensor)
        grads.append(view(local(param.grad)) if param.grad is not None else torch.zeros_like(view(local(param))))
    return torch._foreach_neg(grads) if group["maximize"] else grads


def _local_states(states: list[dict]) -> list[dict]:
    """The same state with every DTensor replaced by its local tensor (a view: writes go through)."""
    return [{key: local(value) for key, value in state.items()} for state in states]


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
