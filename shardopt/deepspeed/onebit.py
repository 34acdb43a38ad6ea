"""DeepSpeed's 1-bit family after its removal (DeepSpeed ≥ 0.19: deepspeedai/DeepSpeed#8489, #8490, #8535).

With `shardopt.deepspeed.register()` (or through `shardopt.deepspeed.initialize`) a config that still says

    "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 400, ...}}

runs shardopt's 1-bit Adam (shardopt/algorithms/onebit_adam.py) with the same meaning of its params:
exact Adam for `freeze_step` steps, then the variance frozen and the momentum exchanged across the
replicas in 1 bit per entry with a scale and error feedback (shardopt/wire/onebit.py), through the
replicate axis like every shardopt exchange, at ZeRO stage 0, 1 and 2 (DeepSpeed's never ran with
ZeRO). Every param is in the one "onebit_adam" group, as DeepSpeed's optimizer had them.

DeepSpeed's params: lr, freeze_step, betas, eps, weight_decay are taken; amsgrad=true is refused
(DeepSpeed refused it too); cuda_aware and comm_backend_name chose DeepSpeed's compressed backend and
are not needed (a warning says so); bias_correction, eps_inside_sqrt and max_grad_norm were accepted
by DeepSpeed's and never applied: they are accepted, not applied, and a warning says so (clip with
"gradient_clipping"). "OneBitLamb" and "ZeroOneAdam" stop with an error naming the shardopt config
that does their job (`check_removed`).
"""

from __future__ import annotations

import warnings

from ..optim.onebit_adam import OneBitAdam
from .optimizers import _EngineSide


class DeepSpeedOneBitAdam(_EngineSide, OneBitAdam):
    """1-bit Adam as DeepSpeed's client optimizer. Its worker and server errors are each rank's own, so
    engine.save_checkpoint also writes every rank's optimizer state and engine.load_checkpoint reads it
    back (wiring.EngineWiring._wrap_checkpoints): a resume continues bit-exact (DeepSpeed's reset them)."""

    per_replica_state = True


ONEBIT_OPTIMIZERS = {"onebitadam": DeepSpeedOneBitAdam}
TAKEN = {"lr": "lr", "freeze_step": "freeze_step", "betas": "betas", "eps": "eps", "weight_decay": "weight_decay"}
NOT_NEEDED = ("cuda_aware", "comm_backend_name")        # DeepSpeed's choice of compressed backend
NOT_APPLIED = ("bias_correction", "eps_inside_sqrt", "max_grad_norm")   # accepted by DeepSpeed's, never applied
# shardopt's own optimizer options a OneBitAdam config may add
SHARDOPT_OPTIONS = ("seed", "agreement_timeout_s", "nonfinite", "maximize", "double_averaging_check_every")
SECTION_KEYS = ("verbose", "mesh", "scale_scheduler_lr")

LOCAL_STEPS_CONFIG = ('"optimizer": {"type": "SignMuon", "params": {"lr": 0.003}}, "shardopt": {"local_steps": '
                      '{"sync_every": 10, "exchange": "sign_mean"}} (integrations/deepspeed/'
                      'signmuon_local_steps_bf16.json)')
REMOVED = {
    "onebitlamb": ("DeepSpeed 0.19 removed 1-bit Lamb (deepspeedai/DeepSpeed#8535), and shardopt does not run it: its "
                   "layer-wise trust ratio (max_coeff, min_coeff) and its frozen scaling ratios are not reproduced. "
                   "The shardopt configs doing its job: \"optimizer\": {\"type\": \"OneBitAdam\", \"params\": {\"lr\": "
                   "..., \"freeze_step\": <your freeze_step>}} (exact Adam, then the momentum in 1 bit across the "
                   "replicas; retune lr: no trust ratio), or a per-layer normalized update with a 1-bit vote, "
                   "\"optimizer\": {\"type\": \"SignMuon\", \"params\": {\"lr\": 0.003}} (integrations/deepspeed/"
                   "signmuon_bf16.json). See the migration table in integrations/deepspeed/README.md"),
    "zerooneadam": ("DeepSpeed 0.19 removed 0/1 Adam (deepspeedai/DeepSpeed#8535), and shardopt does not run it. Its "
                    "job — few, 1-bit synchronizations across the replicas — is shardopt's local steps with a 1-bit "
                    f"exchange: {LOCAL_STEPS_CONFIG}; sync_every plays local_step_clipper's part (steps between "
                    "syncs). Or, to exchange every step, \"type\": \"OneBitAdam\" with your var_freeze_step as "
                    "freeze_step. See the migration table in integrations/deepspeed/README.md"),
}


def check_removed(kind: str) -> None:
    """ValueError naming the shardopt config to use for an optimizer type of the removed 1-bit family that
    shardopt does not run ("OneBitLamb", "ZeroOneAdam"; `kind` lower case)."""
    if kind in REMOVED:
        raise ValueError(f"optimizer type {kind!r}: {REMOVED[kind]}")


def onebit_options(params: dict, name: str) -> dict:
    """OneBitAdam's keyword arguments from DeepSpeed's OneBitAdam params (the module doc), with warnings for
    the params that are not needed or were never applied; ValueError naming an unknown or refused one."""
    known = (*TAKEN, *NOT_NEEDED, *NOT_APPLIED, "amsgrad", *SHARDOPT_OPTIONS)
    unknown = [key for key in params if key not in known]
    if unknown:
        raise ValueError(f"optimizer.params has unknown key(s) {', '.join(map(repr, unknown))} for {name}; allowed: "
                         f"{', '.join(known)}")
    if params.get("amsgrad"):
        raise ValueError(f"optimizer.params.amsgrad = {params['amsgrad']!r}: 1-bit Adam has no AMSGrad variant "
                         f"(DeepSpeed's refused it too); remove amsgrad or set it to false")
    ignored = [key for key in NOT_NEEDED if key in params]
    if ignored:
        warnings.warn(f"{name}: {', '.join(ignored)} not needed: shardopt's 1-bit exchange goes through the engine's "
                      f"process groups (gloo or NCCL), with no compressed backend to choose", UserWarning, stacklevel=4)
    unapplied = [key for key in NOT_APPLIED if params.get(key)]
    if unapplied:
        warnings.warn(f"{name}: {', '.join(unapplied)} accepted and not applied, as in DeepSpeed's OneBitAdam (its "
                      f"update was m/(√v + eps) without bias correction; to clip, set \"gradient_clipping\")",
                      UserWarning, stacklevel=4)
    options = {TAKEN[key]: value for key, value in params.items() if key in TAKEN}
    options.update({key: value for key, value in params.items() if key in SHARDOPT_OPTIONS})
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    return options


def onebit_param_groups(model, model_parameters, section: dict) -> list:
    """One "onebit_adam" group of the model's trainable params (or of `model_parameters` given as tensors;
    param-group dicts are used as given), as DeepSpeed's OneBitAdam stepped them all alike."""
    extra = [key for key in section if key not in SECTION_KEYS]
    if extra:
        raise ValueError(f"the \"shardopt\" section's {', '.join(map(repr, extra))} do not apply to OneBitAdam, which "
                         f"steps every param with 1-bit Adam (one group); allowed there: {', '.join(SECTION_KEYS)}. "
                         f"For local steps use Dion or SignMuon: {LOCAL_STEPS_CONFIG}")
    if model_parameters is not None and any(isinstance(item, dict) for item in model_parameters):
        return list(model_parameters)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if model_parameters is not None:
        chosen = {id(p) for p in model_parameters}
        if chosen - {id(p) for _, p in named}:
            raise ValueError("model_parameters holds tensors that are not trainable parameters of the model; pass the "
                             "model's own parameters (or param-group dicts)")
        named = [(n, p) for n, p in named if id(p) in chosen]
    return [{"params": [p for _, p in named], "param_names": [n for n, _ in named], "algorithm": "onebit_adam"}]

