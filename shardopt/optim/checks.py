"""Input checks that run before any state changes: constructor options, the param groups added,
the gradients a step receives, the state dict a load receives. Metadata only (types, shapes, dtypes, layouts,
placements): no device sync, no collective. Each error names the parameter or tensor, what was
given, what is allowed, and the fix.
"""

from __future__ import annotations

import difflib
import math
import numbers

import torch

from ..layout.buckets import BUCKET_BYTES_BY_DEVICE, DEFAULT_BUCKET_BYTES
from ..algorithms.hyperparams import normalize_dtype_names, state_dtype, unknown_algorithm, validate_group
from ..internals import load_state_dict_pre_hooks
from ..layout.matrices import param_matrices
from ..layout.placement import is_dtensor, local

NONFINITE = ("skip", "raise")

# torch.optim keywords shardopt refuses, and what it does instead.
TORCH_OPTIM_FLAGS = {
    "foreach": "shardopt always batches: same-layout matrices are stacked into one tensor per bucket and the "
               "element-wise groups use torch._foreach kernels; there is no per-tensor loop to switch to",
    "fused": "shardopt has no fused kernel; its step is stacked tensor math plus its own collectives",
    "capturable": "a shardopt step cannot be captured in a CUDA graph: it issues collectives and reads one "
                  "non-finite flag on the host (see nonfinite=)",
    "differentiable": "a shardopt step runs under torch.no_grad() (QR, sign votes and collectives have no "
                      "useful gradient)",
}


def check_options(*, seed, agreement_timeout_s, nonfinite, max_grad_norm, maximize, double_averaging_check_every,
                  bucket_bytes, **torch_flags) -> None:
    """The ShardOptimizer keyword options (not the param-group hyperparameters)."""
    for name, value in torch_flags.items():
        if value is not None:
            raise TypeError(f"{name}={value!r} is a torch.optim option shardopt does not take: "
                            f"{TORCH_OPTIM_FLAGS[name]}. Remove {name}=")
    if nonfinite not in NONFINITE:
        raise ValueError(f"Invalid nonfinite: {nonfinite!r}; allowed: {', '.join(map(repr, NONFINITE))}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"Invalid seed: {seed!r}; seed must be an integer, the same on every rank")
    _real("agreement_timeout_s", agreement_timeout_s, "a number of seconds > 0", lambda v: v > 0)
    _real("max_grad_norm", max_grad_norm, "a number ≥ 0 (0 turns clipping off)", lambda v: v >= 0)
    if not isinstance(maximize, bool):
        raise ValueError(f"Invalid maximize: {maximize!r}; maximize must be True or False")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                     or bucket_bytes < 1):
        raise ValueError(f"Invalid bucket_bytes: {bucket_bytes!r}; bucket_bytes must be a positive integer "
                         f"(bytes of a bucket's fp32 working copy), or None for the device's default "
                         f"({', '.join(f'{d}: {b // 2**20} MiB' for d, b in BUCKET_BYTES_BY_DEVICE.items())}, "
                         f"else {DEFAULT_BUCKET_BYTES // 2**20} MiB)")
    every = double_averaging_check_every
    if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 0:
        raise ValueError(f"Invalid double_averaging_check_every: {every!r}; it must be an integer ≥ 0, the same on "
                         f"every rank (check for double averaging at step 1 and every that many steps; 0 turns the "
                         f"check off)")


def _real(name: str, value, allowed: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"Invalid {name}: {value!r}; {name} must be {allowed}")


# Group keys torch.optim or an LR scheduler put in a group besides the hyperparameters.
GROUP_BOOKKEEPING = ("params", "param_names", "algorithm", "initial_lr")


def check_group_keys(group: dict, index: int, defaults: dict) -> None:
    """No unknown key in a param group (a misspelt hyperparameter would otherwise be ignored)."""
    unknown = sorted(key for key in group if key not in defaults and key not in GROUP_BOOKKEEPING)
    if unknown:
        hints = [f"{key!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(key, list(defaults), 1))
                 else repr(key) for key in unknown]
        raise ValueError(f"param group {index} has unknown keys {', '.join(hints)}; known keys: "
                         f"{', '.join(sorted(defaults))}")


def param_labels(group: dict, index: int) -> list[str]:
    """How errors name the params of param group `index`: their "param_names", else their position."""
    names = group.get("param_names") or [None] * len(group["params"])
    return [f"{name!r}" if name else f"#{position} of param group {index}" for position, name in enumerate(names)]


def check_param_group(group: dict, index: int, explicit_keys: list, defaults: dict, algorithms: dict) -> None:
    """A param group as torch.optim added it (number `index`), before the optimizer takes it: no unknown key
    (`defaults`: every registered key), dtype names made strings (in place, hyperparams.normalize_dtype_names),
    a registered algorithm (algorithms: name → record, registry.ALGORITHMS) whose hyperparameters are valid
    (explicit_keys: those the caller set, each one the algorithm reads), floating-point params and, in a
    matrix group, params that are 2-D or 3-D with a `split` that fits. ValueError naming the param (`param_labels`)."""
    check_group_keys(group, index, defaults)
    normalize_dtype_names(group)
    if group["algorithm"] not in algorithms:
        raise unknown_algorithm(group["algorithm"], index, algorithms.values())
    record = algorithms[group["algorithm"]]
    validate_group(group, index, record, algorithms.values(), explicit_keys)
    for param, label in zip(group["params"], param_labels(group, index)):
        if not param.dtype.is_floating_point:
            raise ValueError(f"param {label} ({group['algorithm']!r}) has dtype "
                             f"{param.dtype}; shardopt optimizes floating-point tensors only (float32, "
                             f"float64, bfloat16, float16)")
        if record.matrix:
            param_matrices(param, group, label)   # 2-D or 3-D, a `split` that fits (ValueError)


# ---- step: the gradients ---------------------------------------------------------------------------
def check_gradients(labeled_params) -> None:
    """Every gradient a step will read must be a dense tensor like its param: same shape, dtype,
    device, and the same DTensor placement (or plain, for a plain param).

    labeled_params: (param, label) pairs; params without a gradient are skipped."""
    for param, label in labeled_params:
        grad = param.grad
        if grad is None:
            continue
        if grad.layout != torch.strided:
            raise ValueError(f"param {label} has a {grad.layout} gradient; shardopt needs dense gradients "
                             f"(build nn.Embedding / nn.EmbeddingBag with sparse=False, or call grad.to_dense())")
        if is_dtensor(param) != is_dtensor(grad):
            raise ValueError(f"param {label} is {'a DTensor' if is_dtensor(param) else 'a plain tensor'} but its "
                             f"gradient is {'a DTensor' if is_dtensor(grad) else 'a plain tensor'}; gradients must be "
                             f"placed like their params (let FSDP2's backward produce them)")
        if is_dtensor(param) and tuple(grad.placements) != tuple(param.placements):
            raise ValueError(f"param {label} is placed {param.placements} but its gradient {grad.placements}; "
                             f"gradients must be placed like their params")
        for what, have, want in (("shape", tuple(grad.shape), tuple(param.shape)),
                                 ("local shape", tuple(local(grad).shape), tuple(local(param).shape)),
                                 ("dtype", grad.dtype, param.dtype), ("device", grad.device, param.device)):
            if have != want:
                raise ValueError(f"param {label} has {what} {want} but its gradient has {what} {have}; a gradient "
                                 f"must match its param (for mixed precision keep fp32 gradients on fp32 params, "
                                 f"e.g. FSDP2 MixedPrecisionPolicy(reduce_dtype=torch.float32))")


# ---- load: the state dict ----------------------------------------------------------------------------
def check_state_dict(state_dict, param_groups: list[dict], labels: dict, algorithms: dict) -> None:
    """A state dict that `load_state_dict` may load into these param groups, or ValueError naming
    the group / param / tensor that does not fit (before torch.optim copies anything).

    labels: param → its name for errors; algorithms: name → record (registry.ALGORITHMS)."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"not an optimizer state dict (got {keys}); expected the dict of "
                         f"optimizer.state_dict() with 'state' and 'param_groups'")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"the state dict has {len(saved_groups)} param groups, this optimizer {len(param_groups)}; "
                         f"build the optimizer with the same param groups as the one that saved it")
    owner = {}
    for index, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        algorithm = saved.get("algorithm")
        if algorithm is None:
            raise ValueError(f"param group {index} of the state dict has no 'algorithm': it was not saved by a "
                             f"shardopt optimizer (a torch.optim one?); load a shardopt optimizer's state_dict()")
        if algorithm != group["algorithm"]:
            raise ValueError(f"param group {index} of the state dict holds {algorithm!r} state but this optimizer's "
                             f"group {index} runs {group['algorithm']!r}; load a state saved with the same "
                             f"algorithm (or start this group's state fresh)")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"param group {index} of the state dict has {len(saved['params'])} params, this "
                             f"optimizer's {len(group['params'])}; build the optimizer from the same model")
        validate_group({**group, **saved}, index, algorithms[saved["algorithm"]], algorithms.values())
        for key, param in zip(saved["params"], group["params"]):
            owner[key] = (param, {**group, **saved})
    for key, param_state in state_dict["state"].items():
        if key not in owner:
            raise ValueError(f"the state dict holds state for param {key!r}, which no param group lists")
        param, group = owner[key]
        _check_param_state(param_state, param, group, labels[param], algorithms[group["algorithm"]])


def _check_param_state(param_state, param, group: dict, label: str, record) -> None:
    where = f"the state of param {label} ({group['algorithm']!r})"
    if not isinstance(param_state, dict):
        raise ValueError(f"{where} is a {type(param_state).__name__}, not a dict of tensors")
    wanted = set(record.state_keys) | {"step"}
    if param_state.keys() != wanted:
        missing, extra = sorted(wanted - param_state.keys()), sorted(param_state.keys() - wanted)
        raise ValueError(f"{where} has keys {sorted(param_state)}; expected {sorted(wanted)}"
                         + (f" (missing {missing})" if missing else "") + (f" (unexpected {extra})" if extra else "")
                         + "; was it saved by another algorithm or optimizer?")
    step = param_state["step"]
    step_value = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if isinstance(step_value, bool) or not isinstance(step_value, numbers.Real) or not math.isfinite(step_value) \
            or step_value < 0:
        raise ValueError(f"{where}: 'step' is {step!r}; expected a finite count ≥ 0")
    for key, (global_shape, local_shape) in record.state_shapes(param, group).items():
        value = param_state[key]
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{where}: {key!r} is a {type(value).__name__}, not a tensor")
        if not value.dtype.is_floating_point:
            raise ValueError(f"{where}: {key!r} has dtype {value.dtype}; optimizer state is floating point")
        shape = tuple(value.shape)
        if shape != (global_shape if is_dtensor(value) else local_shape):
            raise ValueError(f"{where}: {key!r} has shape {shape} but this optimizer expects {global_shape}"
                             + (f" (this rank's shard: {local_shape})" if local_shape != global_shape else "")
                             + "; was it saved for another model, rank_fraction or mesh? (to change the world "
                               "size, load through torch.distributed.checkpoint, which reshards)")
        if is_dtensor(value) and (not is_dtensor(param) or tuple(value.placements) != tuple(param.placements)
                                  or tuple(local(value).shape) != local_shape):
            placed = f"placed {tuple(param.placements)} like the param" if is_dtensor(param) else "a plain tensor"
            raise ValueError(f"{where}: {key!r} is a DTensor placed {tuple(value.placements)} with local shape "
                             f"{tuple(local(value).shape)}, but this optimizer keeps it {placed}, local shape "
                             f"{local_shape}; load the optimizer's own state_dict() of this mesh, or change the mesh "
                             f"through torch.distributed.checkpoint (get/set_optimizer_state_dict), which reshards")


def load_checked(optimizer, state_dict, load, algorithms: dict) -> None:
    """optimizer.load_state_dict: `load` (torch.optim's) of the `loadable` state dict, its pre-hooks already
    run (not again inside `load`), then the matrix groups' state in its `state_dtype` (`keep_state_dtypes`).
    algorithms: name → record (registry.ALGORITHMS)."""
    state_dict = loadable(optimizer, state_dict, algorithms)
    hooks = load_state_dict_pre_hooks(optimizer)
    held = dict(hooks)
    hooks.clear()
    try:
        load(state_dict)
    finally:
        hooks.update(held)
    keep_state_dtypes(optimizer, state_dict, algorithms)


def loadable(optimizer, state_dict, algorithms: dict) -> dict:
    """What optimizer.load_state_dict loads: `state_dict` after the optimizer's load_state_dict
    pre-hooks (a hook may repair it; what it returns is checked), with the saved groups' missing keys
    set to the optimizer's defaults, checked by `check_state_dict` (algorithms: name → record)."""
    state_dict = dict(state_dict) if isinstance(state_dict, dict) else state_dict
    for hook in load_state_dict_pre_hooks(optimizer).values():
        state_dict = hook(optimizer, state_dict) or state_dict
    state_dict = with_current_defaults(state_dict, optimizer.defaults)
    check_state_dict(state_dict, optimizer.param_groups, optimizer._param_label, algorithms)
    return state_dict


def with_current_defaults(state_dict: dict, defaults: dict) -> dict:
    """The state dict with each saved group's missing hyperparameters (keys added to shardopt after it
    was saved, e.g. maximize) set to `defaults` (the optimizer's), so an older checkpoint loads."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
        return state_dict   # (check_state_dict says what is wrong with it)
    groups = [{**{key: value for key, value in defaults.items() if key not in group}, **group}
              if isinstance(group, dict) else group for group in state_dict["param_groups"]]
    return {**state_dict, "param_groups": groups}


def keep_state_dtypes(optimizer, state_dict: dict, algorithms: dict) -> None:
    """After torch.optim's load (which casts floating state to each param's dtype): a matrix group's
    state in its `state_dtype`, copied from the loaded dict. algorithms: name → record."""
    saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    params = [(p, group) for group in optimizer.param_groups for p in group["params"]]
    for saved_id, (param, group) in zip(saved_ids, params):
        if not algorithms[group["algorithm"]].matrix or not group.get("state_dtype") or saved_id not in state_dict["state"]:
            continue
        for key, value in state_dict["state"][saved_id].items():
            if key != "step" and isinstance(value, torch.Tensor):
                optimizer.state[param][key] = value.to(device=optimizer.state[param][key].device,
                                                       dtype=state_dtype(group, param), copy=True)
