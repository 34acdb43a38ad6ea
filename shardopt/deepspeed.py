"""DeepSpeed plugin: Dion and Sign-Muon from a DeepSpeed JSON config, through one call.

    import shardopt.deepspeed
    engine, optimizer, _, lr_scheduler = shardopt.deepspeed.initialize(model=model, config="dion_bf16.json")
    loss = engine(batch); engine.backward(loss); engine.step()

`initialize` has deepspeed.initialize's signature and return value. When the
config's "optimizer" type is "Dion" or "SignMuon" it builds the optimizer
(`shardopt.param_groups(model)`: 2-D weights for the matrix algorithm, the rest
for AdamW) on the engine's data-parallel group as the replicate axis and hands it
to DeepSpeed as a client optimizer; any other config goes to deepspeed.initialize
unchanged. model_parameters given as tensors (model.parameters()) select the params
to train, still split by param_groups; param-group dicts are used as given. Model
parallelism (mpu=..., PipelineModule) is refused: its shards are not whole matrices.
The optimizer's "params" are the class's keyword arguments. An optional
top-level "shardopt" section changes the grouping:

    "shardopt": {"scalar_algorithm": "adamw" | "lion",
                 "scalar_names": ["pos_emb"],       names (substrings) to treat as non-matrix
                 "head_names": ["lm_head"],         output heads (non-matrix)
                 "scalar": {"lr": 3e-4},            options of the non-matrix group
                 "matrix": {...},                   options of the matrix group
                 "verbose": true}                   print the groups on rank 0

ZeRO stage 0 only (stages 1-3 hand the optimizer flattened partitions of gradients
that are already averaged: a clear error; shard with FSDP2 instead). What the
plugin changes in the engine, and why:

- Gradient exchange: `engine.enable_backward_allreduce = False` (as DeepSpeed's
  1-bit Adam does), so backward leaves each rank's *local* gradient; the
  optimizer's step does the compressed exchange. DeepSpeed calls step only at
  the gradient accumulation boundary, so the exchange happens once per
  accumulated batch, on gradients DeepSpeed scaled by 1/gradient_accumulation_steps.
- Gradient clipping: "gradient_clipping" is taken out of the engine's config and
  done by the optimizer, so that every replica applies the *same* factor to its
  local gradient: min(1, max_norm / (ν + 1e-6)) with ν = mean over replicas of the
  local gradient norms (one 4-byte all-reduce). As ν ≥ ‖mean gradient‖ this clips
  at least as often as clipping the averaged gradient would. (Left to DeepSpeed,
  fp16/bf16 would clip each replica by its own norm.)
- fp16/bf16: DeepSpeed keeps fp32 master copies in a wrapper (FP16_UnfusedOptimizer)
  that hands them to the optimizer; its construction-time "initialize state" step
  with zero gradients is a no-op here (it would apply weight decay, and Sign-Muon's
  sign(0) = +1 would move every weight). Its overflow check is replaced by one that
  also covers the local gradient norm and agrees over the replicas (a step is
  skipped on every replica or on none; the skip decision reads one flag: a device
  sync, as DeepSpeed's own check has). With fp16, DeepSpeed 0.19 at stage 0 runs
  backward without the loss scale yet unscales in step (deepspeedai/DeepSpeed#8393);
  `engine.backward` here applies the scale (the gradient entering the loss is set to
  loss_scale / gradient_accumulation_steps, so it stays right if DeepSpeed fixes it; as in
  DeepSpeed's own fp16 wrapper, an fp16 loss tensor overflows at scale 2^16 and the first step
  is skipped: compute the loss in fp32). Use engine.backward, not engine.scale(loss).backward().
- Non-finite gradients in fp32: the optimizer's own check (nonfinite="skip", agreed over the
  replicas) skips the step on every rank and sets `optimizer.overflow`, which the engine reads:
  engine.skipped_steps counts it and the LR scheduler does not advance, as under fp16.
- Checkpoints: `engine.save_checkpoint` first averages the replicas' decoupled
  momenta (docs/design.md §6), so the one optimizer state DeepSpeed writes (data-parallel
  rank 0) holds for every replica; the saving run and a run resumed from the
  checkpoint continue on the same trajectory.

DeepSpeed's LR schedulers act on the optimizer's param groups. WarmupLR,
WarmupDecayLR, OneCycle and LRRangeTest set absolute learning rates; when the
groups' learning rates differ, give those as per-group lists (or use
WarmupCosineLR, which scales each group's own lr); otherwise an error says so.
"""

from __future__ import annotations

import copy
import inspect
import json
import os

import torch

from .groups import describe_groups, param_groups
from .optimizer import Dion, ShardOptimizer, SignMuon

SHARDOPT_SECTION_KEYS = ("scalar_algorithm", "scalar_names", "head_names", "scalar", "matrix", "verbose")
# DeepSpeed schedulers that set absolute learning rates, and their lr parameters (a number, or one per group).
ABSOLUTE_LR_SCHEDULERS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
    "LRRangeTest": ("lr_range_test_min_lr",),
}


def _deepspeed():
    try:
        import deepspeed
    except ImportError as error:
        raise ImportError("shardopt.deepspeed needs DeepSpeed, which is not installed: "
                          "pip install 'shardopt[deepspeed]'") from error
    return deepspeed


# ---- the optimizer DeepSpeed drives ---------------------------------------------------------------
class _EngineSide:
    """What a shardopt optimizer needs under a DeepSpeed engine (mixed into Dion and SignMuon).

    max_grad_norm: clip every replica's local gradient by the same factor (see the module doc);
        0 turns clipping off.
    """

    def __init__(self, params, *args, max_grad_norm: float = 0.0, **kwargs):
        if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm >= 0):
            raise ValueError(f"Invalid gradient_clipping: {max_grad_norm!r}; it must be a number ≥ 0")
        self.max_grad_norm = float(max_grad_norm)
        self._global_grad_norm = None
        self.overflow = False       # read by the engine: a skipped step does not advance the LR scheduler
        self._inert = True          # until initialize() has wired the engine: see step()
        super().__init__(params, *args, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        if self._inert:
            # DeepSpeed's fp16/bf16 wrapper "initializes optimizer state" with a step on zero
            # gradients while the engine is being built; shardopt creates its state lazily.
            return None
        if self.max_grad_norm > 0:
            self._clip_local_gradients()
        skipped = self.skipped_steps
        loss = super().step(closure)
        self.overflow = self.skipped_steps != skipped    # a non-finite gradient on some replica
        return loss

    def _clip_local_gradients(self) -> None:
        """g ← g · min(1, max_norm / (ν + 1e-6)), ν = mean over replicas of ‖g_local‖₂ (no host sync)."""
        self._global_grad_norm = self.clip_grad_norm_(self.max_grad_norm)

    def _adopt_master_copies(self, model_params, master_params) -> None:
        """DeepSpeed's fp16/bf16 wrapper swaps each param in the groups for an fp32 master copy (same
        group, same position); the per-param bookkeeping (seeds, names, state) follows the swap."""
        for old, new in zip(model_params, master_params):
            self._param_index[new] = self._param_index.pop(old)
            self._param_label[new] = self._param_label.pop(old)
            if old in self.state:
                self.state[new] = self.state.pop(old)

    def checkpoint_event_prologue(self) -> None:
        """Called by engine.save_checkpoint on every rank before the state is gathered."""
        self.synchronize_for_checkpoint()


class DeepSpeedDion(_EngineSide, Dion):
    """Dion as DeepSpeed's client optimizer (built by `shardopt.deepspeed.initialize`)."""


class DeepSpeedSignMuon(_EngineSide, SignMuon):
    """Sign-Muon as DeepSpeed's client optimizer (built by `shardopt.deepspeed.initialize`)."""


OPTIMIZERS = {"dion": DeepSpeedDion, "signmuon": DeepSpeedSignMuon}


class _AgreedOverflowCheck:
    """Stands in for the fp16/bf16 wrapper's overflow check. The wrapper skips a step when that check
    says so, or when its gradient norm is not finite; with local gradients the norm is local, so this
    check asks the optimizer's own agreed non-finite test (a NaN/inf element or an overflowing norm on
    any replica): every replica skips, or none does."""

    def __init__(self, params, optimizer: ShardOptimizer):
        self.params = list(params)
        self.optimizer = optimizer

    def check(self, param_groups=None) -> bool:
        return self.optimizer.nonfinite_anywhere([p.grad for p in self.params if p.grad is not None])


# ---- initialize -------------------------------------------------------------------------------------
def initialize(*args, **kwargs):
    """deepspeed.initialize, with "optimizer": {"type": "Dion" | "SignMuon", "params": {...}} in the
    config built by shardopt (see the module doc). Returns (engine, optimizer, training_dataloader,
    lr_scheduler) as deepspeed.initialize does; under fp16/bf16 `optimizer` is DeepSpeed's wrapper,
    and `shard_optimizer(engine)` is the shardopt optimizer (comm_stats, replicas_consistent)."""
    deepspeed = _deepspeed()
    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    call = bound.arguments
    config, config_from_args = _read_config(call)
    optimizer_config = config.get("optimizer") or {}
    cls = OPTIMIZERS.get(str(optimizer_config.get("type", "")).lower())
    if cls is None:
        return deepspeed.initialize(*args, **kwargs)

    name = optimizer_config["type"]
    if call.get("optimizer") is not None:
        raise ValueError(f"the config asks for the {name} optimizer and an optimizer was passed too; "
                         f"give one: drop the config's \"optimizer\" section or the optimizer argument")
    _check_supported(config, call, name)
    if call.get("model") is None:
        raise ValueError("shardopt.deepspeed.initialize needs model=... to build the param groups")
    options = _optimizer_options(cls, optimizer_config.get("params") or {}, name)
    section = _shardopt_section(config)
    max_grad_norm = config.get("gradient_clipping", 0.0) or 0.0
    config["gradient_clipping"] = 0.0           # clipped by the optimizer, the same on every replica

    built = []
    given = call.get("model_parameters") is not None

    def build(model_parameters):    # called by the engine once the model is cast and on its device
        from deepspeed.utils import groups as deepspeed_groups
        groups = _param_groups(call["model"], model_parameters if given else None, cls, section)
        optimizer = cls(groups, **options, max_grad_norm=max_grad_norm,
                        replicate_mesh=deepspeed_groups._get_data_parallel_group())
        if call.get("lr_scheduler") is None:
            _check_scheduler(config.get("scheduler"), optimizer.param_groups)
        if section.get("verbose") and torch.distributed.get_rank() == 0:
            print(describe_groups(optimizer.param_groups))
        built.append(optimizer)
        return optimizer

    call["optimizer"] = build
    call["config"] = config
    call.pop("config_params", None)
    if config_from_args:
        call["args"] = copy.copy(call["args"])
        call["args"].deepspeed_config = None
    engine, *rest = deepspeed.initialize(**call)
    _wire(engine, built[0])
    return (engine, *rest)


def shard_optimizer(engine) -> ShardOptimizer:
    """The shardopt optimizer inside a DeepSpeed engine (DeepSpeed's fp16/bf16 wrapper holds it)."""
    optimizer = getattr(engine, "basic_optimizer", None)
    if not isinstance(optimizer, ShardOptimizer):
        raise ValueError(f"this engine's optimizer is {type(optimizer).__name__}, not a shardopt optimizer")
    return optimizer


def _read_config(call: dict) -> tuple[dict, bool]:
    """The config dict (a copy) from config=, config_params= or args.deepspeed_config, and whether it
    came from args."""
    args = call.get("args")
    source = call.get("config", call.get("config_params"))
    from_args = source is None and getattr(args, "deepspeed_config", None) is not None
    if from_args:
        source = args.deepspeed_config
    if source is None:
        raise ValueError("no DeepSpeed config: pass config=<dict or path to a JSON file> "
                         "(or args with --deepspeed_config)")
    if isinstance(source, dict):
        return copy.deepcopy(source), from_args
    if isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        with open(source) as file:
            return json.load(file), from_args
    raise ValueError(f"DeepSpeed config must be a dict or the path of a JSON file, got {source!r}")


def _check_supported(config: dict, call: dict, name: str) -> None:
    stage = int((config.get("zero_optimization") or {}).get("stage", 0))
    if stage != 0:
        raise ValueError(
            f"shardopt's {name} runs under DeepSpeed with ZeRO stage 0 only, and the config sets "
            f"zero_optimization.stage = {stage}. ZeRO stages 1-3 average the gradients themselves and hand "
            f"the optimizer flattened partitions of them, while {name} needs whole 2-D matrices and does "
            f"its own compressed exchange. Set \"zero_optimization\": {{\"stage\": 0}}, or, to shard "
            f"weights and optimizer state, use shardopt with FSDP2 (fully_shard(model, mesh=...) and "
            f"{name}(..., replicate_mesh=mesh['replicate'], shard_mesh=mesh['shard']); see integrations/fsdp/train.py)")
    if type(call.get("model")).__name__ == "PipelineModule":
        raise NotImplementedError(f"shardopt's {name} under DeepSpeed does not support pipeline parallelism "
                                  f"(PipelineModule); use a plain nn.Module with ZeRO stage 0")
    if call.get("mpu") is not None:
        raise NotImplementedError(f"shardopt's {name} under DeepSpeed does not support model parallelism "
                                  f"(mpu=...): tensor-parallel shards are not whole matrices")


def _optimizer_options(cls, params: dict, name: str) -> dict:
    """The config's optimizer params as keyword arguments of the class (checked by name here, by value there)."""
    base = next(c for c in cls.__mro__ if c in (Dion, SignMuon))
    allowed = []
    for function in (base.__init__, ShardOptimizer.__init__):
        for parameter in inspect.signature(function).parameters.values():
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) and parameter.name not in (
                    "self", "params", "defaults", "replicate_mesh", "shard_mesh") and parameter.name not in allowed:
                allowed.append(parameter.name)
    unknown = [key for key in params if key not in allowed]
    if unknown:
        raise ValueError(f"optimizer.params has unknown key(s) {', '.join(map(repr, unknown))} for {name}; "
                         f"allowed: {', '.join(allowed)}")
    options = dict(params)
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    return options


def _shardopt_section(config: dict) -> dict:
    section = config.get("shardopt") or {}
    unknown = [key for key in section if key not in SHARDOPT_SECTION_KEYS]
    if unknown:
        raise ValueError(f"the config's \"shardopt\" section has unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(SHARDOPT_SECTION_KEYS)}")
    return section


def _param_groups(model, model_parameters, cls, section: dict) -> list:
    """shardopt.param_groups(model) with the "shardopt" section's overrides, restricted to
    `model_parameters` when those are given as tensors (the usual model.parameters()); param-group
    dicts given by the caller are used as they are."""
    if model_parameters is not None and any(isinstance(item, dict) for item in model_parameters):
        return list(model_parameters)
    options = {"scalar_algorithm": section.get("scalar_algorithm", "adamw"),
               "matrix_options": section.get("matrix"), "scalar_options": section.get("scalar"),
               "scalar_names": tuple(section.get("scalar_names", ()))}
    if "head_names" in section:
        options["head_names"] = tuple(section["head_names"])
    groups = param_groups(model, cls.matrix_algorithm, **options)
    if model_parameters is None:
        return groups
    chosen = {id(p) for p in model_parameters}
    known = {id(p) for group in groups for p in group["params"]}
    if chosen - known:
        raise ValueError(f"{len(chosen - known)} of model_parameters are not trainable parameters of the model; "
                         f"pass the model's own parameters (or param-group dicts)")
    for group in groups:
        kept = [(p, n) for p, n in zip(group["params"], group["param_names"]) if id(p) in chosen]
        group["params"], group["param_names"] = [p for p, _ in kept], [n for _, n in kept]
    return [group for group in groups if group["params"]]


def _check_scheduler(scheduler: dict | None, groups: list[dict]) -> None:
    """A DeepSpeed scheduler that sets one absolute lr for all groups would overwrite differing group lrs."""
    if not scheduler or scheduler.get("type") not in ABSOLUTE_LR_SCHEDULERS:
        return
    lrs = [group["lr"] for group in groups]
    if len(set(lrs)) <= 1:
        return
    params = scheduler.get("params") or {}
    single = [key for key in ABSOLUTE_LR_SCHEDULERS[scheduler["type"]] if not isinstance(params.get(key), (list, tuple))]
    if single:
        shown = ", ".join(f"{group['lr']:g} ({group['algorithm']})" for group in groups)
        raise ValueError(f"the {scheduler['type']} scheduler sets one {'/'.join(single)} for every param group, but "
                         f"the param groups have different learning rates: {shown}. Give "
                         f"{' and '.join(single)} as a list with one value per group in this order, or use "
                         f"WarmupCosineLR, which scales each group's own lr")


def _wire(engine, optimizer: ShardOptimizer) -> None:
    """Turn the engine's gradient all-reduce off and fit the optimizer to DeepSpeed's fp16/bf16 wrapper."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
        raise NotImplementedError("shardopt optimizers under DeepSpeed do not support torch_autocast with float16 "
                                  "(its GradScaler decides to skip a step on each rank alone); use "
                                  "\"fp16\": {\"enabled\": true} or bf16")
    engine.enable_backward_allreduce = False
    wrapper = engine.optimizer
    if wrapper is not optimizer:
        if not isinstance(wrapper, FP16_UnfusedOptimizer):
            raise NotImplementedError(f"DeepSpeed wrapped the shardopt optimizer in {type(wrapper).__name__}; "
                                      f"shardopt supports ZeRO stage 0 with fp32, bf16 or fp16")
        for model_params, master_params in zip(wrapper.fp16_groups, wrapper.fp32_groups):
            optimizer._adopt_master_copies(model_params, master_params)
        wrapper.overflow_checker = _AgreedOverflowCheck([p for g in wrapper.fp16_groups for p in g], optimizer)
        wrapper.checkpoint_event_prologue = optimizer.checkpoint_event_prologue
        if engine.fp16_enabled():
            _scale_loss_in_backward(engine)
    optimizer._inert = False


def _scale_loss_in_backward(engine) -> None:
    """engine.backward with the fp16 loss scale: the gradient entering the loss is set to
    loss_scale / gradient_accumulation_steps (loss_scale without scale_wrt_gas), whatever the
    engine multiplies the loss by, as DeepSpeed's fp16 wrapper expects when it unscales in step."""
    original = engine.backward
    signature = inspect.signature(original)

    def backward(loss, *args, **kwargs):
        scale_wrt_gas = signature.bind(loss, *args, **kwargs).arguments.get("scale_wrt_gas", True)
        factor = engine.optimizer.loss_scale / (engine.gradient_accumulation_steps() if scale_wrt_gas else 1)
        handle = loss.register_hook(lambda grad: torch.full_like(grad, factor))
        try:
            return original(loss, *args, **kwargs)
        finally:
            handle.remove()

    backward.__doc__ = original.__doc__
    engine.backward = backward
