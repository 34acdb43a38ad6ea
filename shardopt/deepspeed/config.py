"""The DeepSpeed JSON config as the plugin reads it: what shardopt takes out of it (optimizer, clipping,
ZeRO stage, mesh, grouping) and the config DeepSpeed itself is given. No distributed calls here."""

from __future__ import annotations

import copy
import inspect
import json
import os
import warnings
from dataclasses import dataclass, field

from ..optim.groups import param_groups
from ..localsteps.optimizer import LocalSteps
from ..optim.onebit_adam import OneBitAdam
from ..optim.optimizer import Dion, ShardOptimizer, SignMuon
from .onebit import ONEBIT_OPTIMIZERS, check_removed, onebit_options, onebit_param_groups
from .optimizers import OPTIMIZERS

SHARDOPT_SECTION_KEYS = ("nonmatrix_algorithm", "nonmatrix_names", "head_names", "nonmatrix", "matrix", "verbose",
                         "mesh", "scale_scheduler_lr", "local_steps")
# LocalSteps' keyword arguments the plugin fills in itself (the others come from "shardopt": {"local_steps": ...})
LOCAL_STEPS_FILLED = ("self", "inner", "replicate_mesh", "model", "ownership")
# the "shardopt" section's keys before 0.3 (still read, with a DeprecationWarning) → their names now
DEPRECATED_SECTION_KEYS = {"scalar_algorithm": "nonmatrix_algorithm", "scalar_names": "nonmatrix_names",
                           "scalar": "nonmatrix"}
# ZeRO keys that change where state or work lives and that the plugin does not do: refused, not ignored.
REFUSED_ZERO_KEYS = ("offload_optimizer", "offload_param", "cpu_offload", "zero_hpz_partition_size",
                     "zero_quantized_weights", "zero_quantized_gradients", "mics_shard_size")
# DeepSpeed schedulers that set absolute learning rates, and their lr parameters (a number, or one per group).
ABSOLUTE_LR_SCHEDULERS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
    "LRRangeTest": ("lr_range_test_min_lr",),
}
# "auto" is HF Transformers' and Accelerate's placeholder for a value they fill in, and they reject one they do
# not know; in a DeepSpeed config the vote format with the fewest bytes (the optimizers' vote="auto") is spelled:
VOTE_FEWEST_BYTES = "fewest_bytes"
# and LocalSteps' exchange="auto" (the 1-bit format measured best at the round's replica count, formats.by_replicas):
EXCHANGE_BY_REPLICAS = "by_replicas"
# The matrix lr docs/tuning.md recommends (Sign-Muon with lr_scale "none": an absolute step, 1/10-1/20 of a 0.02 init
# std up to the demo's 3e-3; with post_polar it is Muon-like, as Dion's). HF Transformers fills "lr": "auto" with
# TrainingArguments(learning_rate=...), default 5e-5 (an AdamW fine-tuning lr): a matrix lr LR_WARN_FACTOR times
# or more outside the range is warned about.
DOCUMENTED_LR = {"dion": (0.01, 0.02), "signmuon": (1e-3, 3e-3), "signmuon_post_polar": (0.01, 0.02)}
LR_WARN_FACTOR = 10
HF_DEFAULT_LEARNING_RATE = 5e-5
DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000   # elements, DeepSpeed's default: the stage-2 gradients in flight

@dataclass
class PluginSetup:
    """What the plugin does for one config: the optimizer class and its keyword arguments, the
    "shardopt" section, the clipping it takes over, the ZeRO stage it runs itself (DeepSpeed is
    given stage 0), the (replicate, shard) mesh (None: every data-parallel rank is a replica) and
    LocalSteps' keyword arguments (None: the optimizer exchanges every step)."""

    cls: type
    name: str
    options: dict
    section: dict
    max_grad_norm: float
    zero_stage: int
    reduce_bucket_size: int
    mesh: tuple[int, int] | None
    local_steps: dict | None = None
    scheduler: dict | None = None
    engine_config: dict = field(default_factory=dict)


def read_config(call: dict) -> tuple[dict, bool]:
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
    return load_config(source), from_args


def load_config(source) -> dict:
    """A copy of the config given as a dict or as the path of a JSON file."""
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        with open(source) as file:
            return json.load(file)
    raise ValueError(f"DeepSpeed config must be a dict or the path of a JSON file, got {source!r}")


def plugin_setup(config: dict, model=None, mpu=None, *, fp16_supported=None) -> PluginSetup | None:
    """The PluginSetup for a config whose "optimizer" type is Dion or SignMuon (None for any other type),
    after every check that needs no process group. `fp16_supported`: a callable, asked only when
    the config enables fp16."""
    optimizer_config = config.get("optimizer") or {}
    kind = str(optimizer_config.get("type", "")).lower()
    check_removed(kind)    # DeepSpeed's removed OneBitLamb / ZeroOneAdam: an error naming the shardopt config
    cls = OPTIMIZERS.get(kind) or ONEBIT_OPTIMIZERS.get(kind)
    if cls is None:
        return None
    name = optimizer_config["type"]
    zero = dict(config.get("zero_optimization") or {})
    stage = int(zero.get("stage", 0))
    section = _shardopt_section(config)
    _check_supported(config, zero, stage, model, mpu, name, fp16_supported)
    engine_config = copy.deepcopy(config)
    engine_config["gradient_clipping"] = 0.0            # clipped by the optimizer, the same on every replica
    engine_config["zero_optimization"] = {"stage": 0}   # stages 1-3 are done by shardopt (zero.py, zero3.py)
    engine_config.pop("optimizer", None)
    engine_config.pop("shardopt", None)
    options = _optimizer_options(cls, optimizer_config.get("params") or {}, name)
    _warn_if_lr_far_outside_tuning(cls.matrix_algorithm, name, {**options, **(section.get("matrix") or {})})
    return PluginSetup(cls=cls, name=name, options=options, section=section,
                       max_grad_norm=config.get("gradient_clipping", 0.0) or 0.0, zero_stage=stage,
                       reduce_bucket_size=_positive_int(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET_SIZE),
                                                        "zero_optimization.reduce_bucket_size"),
                       mesh=_mesh(section.get("mesh"), stage), local_steps=_local_steps(section.get("local_steps")),
                       scheduler=config.get("scheduler"), engine_config=engine_config)


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 or value != int(value):
        raise ValueError(f"{name} must be a positive integer (elements), got {value!r}")
    return int(value)


def _check_supported(config: dict, zero: dict, stage: int, model, mpu, name: str, fp16_supported) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    _check_stage_3(config, zero, stage, model, name)
    refused = [key for key in REFUSED_ZERO_KEYS if zero.get(key)]
    if refused:
        raise ValueError(f"zero_optimization.{refused[0]} is not supported with shardopt's {name} (the plugin runs "
                         f"ZeRO stages 1, 2 and 3 itself, without offload or quantized collectives); remove it")
    if (config.get("fp16") or {}).get("enabled") and fp16_supported is not None and not fp16_supported():
        raise ValueError("the config enables \"fp16\", which DeepSpeed's accelerator does not support on this device "
                         "(its CPU accelerator needs mkldnn fp16: torch.ops.mkldnn._is_mkldnn_fp16_supported() is "
                         "False here); use \"bf16\": {\"enabled\": true} instead, or fp32")
    if type(model).__name__ == "PipelineModule":
        raise NotImplementedError(f"shardopt's {name} under DeepSpeed does not support pipeline parallelism "
                                  f"(PipelineModule); use a plain nn.Module")
    if mpu is not None:
        raise NotImplementedError(f"shardopt's {name} under DeepSpeed does not support model parallelism "
                                  f"(mpu=...): tensor-parallel shards are not whole matrices")
    experts = [n for n, p in (model.named_parameters() if model is not None else ()) if getattr(p, "allreduce", True)
               is False]
    if experts:
        raise NotImplementedError(f"shardopt's {name} under DeepSpeed does not support MoE expert parameters "
                                  f"(e.g. {experts[0]!r}, from deepspeed.moe.layer.MoE): each expert lives on its "
                                  f"expert-parallel ranks and must be averaged over the expert-data-parallel group, "
                                  f"not over all replicas. Train MoE models with shardopt under FSDP2 (3-D expert "
                                  f"stacks are a batch of matrices there), or use DeepSpeed's own optimizer")


def _check_stage_3(config: dict, zero: dict, stage: int, model, name: str) -> None:
    """What shardopt's ZeRO stage 3 (zero3.py) does not do, refused, and a zero.Init model at another stage;
    DeepSpeed's stage-3 tuning knobs, which act on DeepSpeed's own parameter fetching (shardopt gathers each
    module's params itself), named in a warning."""
    initialized = [(n, p) for n, p in (model.named_parameters() if model is not None else ()) if hasattr(p, "ds_id")]
    if initialized and stage != 3:
        param_name, param = initialized[0]
        raise ValueError(f"the model was built under deepspeed.zero.Init (parameter {param_name!r} is one of its "
                         f"partitions, ds_shape {tuple(getattr(param, 'ds_shape', ()))}), which partitions weights for "
                         f"ZeRO stage 3, and the config sets zero_optimization.stage = {stage}: set it to 3, or build "
                         f"the model without zero.Init")
    if stage != 3:
        return
    knobs = sorted(key for key in zero if key.startswith("stage3_") or key in ("sub_group_size", "memory_efficient_linear"))
    if knobs:
        warnings.warn(f"zero_optimization.{', '.join(knobs)} tune DeepSpeed's own stage-3 parameter fetching, which "
                      f"does not run with shardopt's {name}: shardopt gathers each module's params from their owners "
                      f"inside the node, and every weight whole for a model save (save_16bit_model, HF Trainer's "
                      f"save_model, Accelerate's get_state_dict; shardopt/deepspeed/zero3.py), and these settings "
                      f"have no effect; remove them to silence this warning", UserWarning, stacklevel=4)
    if str((config.get("optimizer") or {}).get("type", "")).lower() in ONEBIT_OPTIMIZERS:
        raise ValueError(f"{name} runs at ZeRO stages 0, 1 and 2; set zero_optimization.stage to 2 (its state is "
                         f"partitioned there) or use \"type\": \"SignMuon\" / \"Dion\" at stage 3")
    if (config.get("shardopt") or {}).get("local_steps") is not None:
        raise ValueError("\"shardopt\": {\"local_steps\": ...} runs at ZeRO stages 0, 1 and 2 (each rank syncs and "
                         "keeps whole weights between rounds); set zero_optimization.stage to 2, or remove local_steps")


def _mesh(mesh, stage: int) -> tuple[int, int] | None:
    """(replicate, shard) from the "shardopt": {"mesh": ...} section, checked by name and type; the
    product is checked against the world size once the process group is up (zero.make_mesh)."""
    if mesh is None:
        return None
    if not isinstance(mesh, dict) or set(mesh) != {"replicate", "shard"} or not all(
            type(v) is int and v >= 1 for v in mesh.values()):
        raise ValueError(f"\"shardopt\": {{\"mesh\": ...}} must be {{\"replicate\": R, \"shard\": S}} with positive "
                         f"integers R·S = the data-parallel world size, got {mesh!r}")
    return mesh["replicate"], mesh["shard"]


def _local_steps(options) -> dict | None:
    """LocalSteps' keyword arguments from "shardopt": {"local_steps": {"sync_every": H, ...}} (checked by
    name here, by value when LocalSteps is built); "exchange": "by_replicas" (the config's spelling) as "auto"."""
    if options is None:
        return None
    allowed = [n for n in inspect.signature(LocalSteps.__init__).parameters if n not in LOCAL_STEPS_FILLED]
    if not isinstance(options, dict) or "sync_every" not in options:
        raise ValueError(f"\"shardopt\": {{\"local_steps\": ...}} must be a dict with \"sync_every\": H (inner steps "
                         f"per round) and any of {', '.join(allowed)}; got {options!r}")
    unknown = [key for key in options if key not in allowed]
    if unknown:
        raise ValueError(f"\"shardopt\": {{\"local_steps\": ...}} has unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(allowed)}")
    return _auto_spelled(options, "exchange", EXCHANGE_BY_REPLICAS)


def _optimizer_options(cls, params: dict, name: str) -> dict:
    """The config's optimizer params as keyword arguments of the class (checked by name here, by value there)."""
    if cls in ONEBIT_OPTIMIZERS.values():
        return onebit_options(params, name)
    base = next(c for c in cls.__mro__ if c in (Dion, SignMuon))
    allowed = []
    for function in (base.__init__, ShardOptimizer.__init__):
        for parameter in inspect.signature(function).parameters.values():
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) and parameter.name not in (
                    "self", "params", "defaults", "replicate_mesh", "shard_mesh", "tensor_mesh") and parameter.name not in allowed:
                allowed.append(parameter.name)
    unknown = [key for key in params if key not in allowed]
    if unknown:
        raise ValueError(f"optimizer.params has unknown key(s) {', '.join(map(repr, unknown))} for {name}; "
                         f"allowed: {', '.join(allowed)}")
    options = _auto_spelled(params, "vote", VOTE_FEWEST_BYTES)
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    return options


def _warn_if_lr_far_outside_tuning(algorithm: str, name: str, options: dict) -> None:
    """A warning where the matrix params' lr (`options`: the optimizer params with the "shardopt" section's
    "matrix" ones over them) is LR_WARN_FACTOR or more outside docs/tuning.md's range for `algorithm`. Sign-Muon
    with lr_scale "unit_gain" (lr grows with √fan_in) is not checked; a non-number is left to the class."""
    lr = options.get("lr")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or options.get("lr_scale", "none") != "none":
        return
    key = f"{algorithm}_post_polar" if options.get("post_polar") else algorithm
    if key not in DOCUMENTED_LR:
        return
    low, high = DOCUMENTED_LR[key]
    if low / LR_WARN_FACTOR < lr < high * LR_WARN_FACTOR:
        return
    where = (f"; {lr:g} is TrainingArguments' default learning_rate, which HF Transformers' Trainer puts where the "
             f"config says \"lr\": \"auto\"" if lr == HF_DEFAULT_LEARNING_RATE else "")
    warnings.warn(f"{name}'s lr for the matrix params is {lr:g}, {LR_WARN_FACTOR}× or more outside {low:g}-{high:g}, "
                  f"the range docs/tuning.md recommends for {name}{' with post_polar' if options.get('post_polar') else ''}{where}. With HF Trainer and \"lr\": \"auto\" set "
                  f"TrainingArguments(learning_rate=...) (--learning_rate), or give the optimizer's lr as a number",
                  UserWarning, stacklevel=4)


def _shardopt_section(config: dict) -> dict:
    section = dict(config.get("shardopt") or {})
    for old, new in DEPRECATED_SECTION_KEYS.items():
        if old in section:
            if new in section:
                raise ValueError(f"the config's \"shardopt\" section has both {old!r} and {new!r}; keep {new!r} "
                                 f"({old!r} is its name before shardopt 0.3)")
            warnings.warn(f"the config's \"shardopt\" key {old!r} is deprecated; call it {new!r}", DeprecationWarning,
                          stacklevel=3)
            section[new] = section.pop(old)
    unknown = [key for key in section if key not in SHARDOPT_SECTION_KEYS]
    if unknown:
        raise ValueError(f"the config's \"shardopt\" section has unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(SHARDOPT_SECTION_KEYS)}")
    return {**section, **{key: _auto_spelled(section[key], "vote", VOTE_FEWEST_BYTES) for key in ("nonmatrix", "matrix")
                          if section.get(key)}}


def _auto_spelled(options: dict, key: str, spelling: str) -> dict:
    """A copy of `options` with `key` given as `spelling` (a config's name for one of shardopt's "auto" choices:
    VOTE_FEWEST_BYTES, EXCHANGE_BY_REPLICAS) as "auto", which is still accepted as such outside HF Transformers
    and Accelerate (they take "auto" for their placeholder)."""
    return {**options, key: "auto"} if options.get(key) == spelling else dict(options)


def build_param_groups(model, model_parameters, cls, section: dict) -> list:
    """shardopt.param_groups(model) with the "shardopt" section's overrides, restricted to
    `model_parameters` when those are given as tensors (the usual model.parameters()); param-group
    dicts given by the caller are used as they are."""
    if cls in ONEBIT_OPTIMIZERS.values():
        return onebit_param_groups(model, model_parameters, section)
    if model_parameters is not None and any(isinstance(item, dict) for item in model_parameters):
        groups = list(model_parameters)
        if any(group.get("moe") for group in groups):
            raise NotImplementedError("a param group is marked \"moe\": True (DeepSpeed expert parameters); shardopt "
                                      "under DeepSpeed does not support MoE expert parameters")
        return groups
    options = {"nonmatrix_algorithm": section.get("nonmatrix_algorithm", "adamw"),
               "matrix_options": section.get("matrix"), "nonmatrix_options": section.get("nonmatrix"),
               "nonmatrix_names": tuple(section.get("nonmatrix_names", ()))}
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


def scale_scheduler_lrs(setup: PluginSetup, param_groups_of_model) -> None:
    """"shardopt": {"scale_scheduler_lr": true}: the absolute-lr scheduler's learning rates (one number each)
    are the first param group's; DeepSpeed is given one per group, lr·(group lr / first group's lr), so
    every group follows the schedule at its own lr (the config then names one lr, as HF Transformers'
    TrainingArguments(learning_rate=...) does). `param_groups_of_model()`: the groups the optimizer will get."""
    flag = setup.section.get("scale_scheduler_lr", False)
    if not isinstance(flag, bool):
        raise ValueError(f"\"shardopt\": {{\"scale_scheduler_lr\": ...}} must be true or false, got {flag!r}")
    if not flag:
        return
    scheduler = setup.engine_config.get("scheduler") or {}
    if scheduler.get("type") not in ABSOLUTE_LR_SCHEDULERS:
        raise ValueError(f"\"shardopt\": {{\"scale_scheduler_lr\": true}} scales the learning rates of the "
                         f"{', '.join(ABSOLUTE_LR_SCHEDULERS)} schedulers; the config's scheduler is "
                         f"{scheduler.get('type')!r}: remove scale_scheduler_lr")
    default = inspect.signature(next(c for c in setup.cls.__mro__ if c in (Dion, SignMuon, OneBitAdam)).__init__
                                ).parameters["lr"].default
    lrs = [group.get("lr", setup.options.get("lr", default)) for group in param_groups_of_model()]
    params = scheduler.setdefault("params", {})
    for key in ABSOLUTE_LR_SCHEDULERS[scheduler["type"]]:
        if key not in params:
            continue
        if not isinstance(params[key], (int, float)) or isinstance(params[key], bool):
            raise ValueError(f"scheduler.params.{key} must be one number with \"scale_scheduler_lr\": true (the "
                             f"first param group's; the others are scaled to their lr), got {params[key]!r}")
        params[key] = [params[key] / lrs[0] * lr for lr in lrs]   # exactly lr where params[key] == lrs[0]
    setup.scheduler = scheduler


def check_scheduler(scheduler: dict | None, groups: list[dict]) -> None:
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
