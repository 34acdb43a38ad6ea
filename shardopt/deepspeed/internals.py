"""Every DeepSpeed internal the plugin touches, in one place, checked when the plugin first loads DeepSpeed.

The plugin drives DeepSpeed through its public entry points (deepspeed.initialize, the engine's
backward/step/save_checkpoint) plus the internals below. They are not a stable API, so `load()`
checks the installed version against the tested range and that each internal is still there; an
untested or changed DeepSpeed fails with a message naming what is missing instead of misbehaving
in the middle of a run. SHARDOPT_ALLOW_UNTESTED_DEEPSPEED=1 skips the version check (the internals
are still checked).

| internal | used for |
|---|---|
| `engine.enable_backward_allreduce` | turn the engine's gradient all-reduce off (as 1-bit Adam does) |
| `engine.optimizer`, `engine.basic_optimizer` | the fp16/bf16 wrapper and the shardopt optimizer in it |
| `engine.backward(loss, ..., scale_wrt_gas)` | wrapped: fp16 loss scale (DeepSpeed#8393), ZeRO-2 reduce-scatter |
| `engine.torch_autocast_z0_gradscaler` | refused (a per-rank GradScaler) |
| `engine.has_moe_layers` | MoE expert params refused |
| `engine.destroy()` | orderly shutdown |
| `engine.save_checkpoint(save_dir, tag)` default tag `global_step<N>`, `load_checkpoint` returning `(<dir>/<tag>/<file>, client_state)` | ZeRO 1/2 and local steps: each rank's own state files next to DeepSpeed's |
| `FP16_UnfusedOptimizer.fp16_groups / fp32_groups` | master copies that replace the params in the groups |
| `FP16_UnfusedOptimizer.overflow_checker.check()` | replaced by a check agreed over the replicas |
| `FP16_UnfusedOptimizer.initialize_optimizer_states` | its step on zero gradients is a no-op here |
| `FP16_UnfusedOptimizer._skip_invalid_grad_norm()` | local steps: where its step skips; the round counts it |
| `FP16_UnfusedOptimizer.loss_scale`, `._global_grad_norm` | loss scale; the agreed gradient norm the engine logs |
| `FP16_UnfusedOptimizer.loss_scale_config.cur_scale`, `unscale_and_clip_grads` multiplying by `1. / combined_scale` | overlap_backward: the master copy's gradient made in backward as the step makes it |
| `FP16_UnfusedOptimizer.fp16_groups / fp32_groups` read anew by `step`, `zero_grad`; `step`'s `fp16_param.grad.to(fp32_param.dtype)` | ZeRO 2: the owned masters only, in both lists: the fp32 node mean is the master's gradient as it is (masters.py) |
| `FP16_UnfusedOptimizer.refresh_fp32_params()` | ZeRO 2: replaced, the owned masters from their model params (masters.py) |
| `FP16_UnfusedOptimizer.step` reading the masters' values only in its copy back `fp16_param.data.copy_(fp32_param.data)` | bf16 ZeRO 2/3: both lists hold the same packed master (a placeholder of one element): a copy onto itself, which writes nothing (masters.PackedMasters) |
| `FP16_UnfusedOptimizer.load_state_dict(state_dict, load_optimizer_states)` copying `state_dict['fp32_groups']` | ZeRO 2: wrapped to load the loss scale only; each rank's own state and masters from its files |
| `optimizer.checkpoint_event_prologue()` | averages the momenta before engine.save_checkpoint |
| `deepspeed.utils.groups._get_data_parallel_group()` | the data-parallel group (the replicate axis at stage 0) |
| `deepspeed.comm.destroy_process_group()` | destroys the groups and drops DeepSpeed's references to them |
| `deepspeed.initialize` (the module attribute) | replaced by `register()`; the frameworks look it up when they call it |
| `deepspeed.init_distributed()`, `deepspeed.comm.is_initialized()` | `client_optimizer` before deepspeed.comm is up |
| `deepspeed.accelerator.get_accelerator().is_fp16_supported()` | fp16 refused on devices without it |
| `deepspeed.moe.layer.MoE` | MoE expert params refused |
| `engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)` (rank 0's whole state dict, None elsewhere), `engine.save_16bit_model` (reads `module_state_dict` below stage 3), `engine.zero_gather_16bit_weights_on_model_save()` | stage 3: replaced / wrapped so the frameworks' saves (HF Trainer's save_model, Accelerate's get_state_dict) get the whole weights (zero3.py) |
| `param.ds_id`, `ds_shape`, `ds_numel`, `ds_tensor`, `ds_process_group` (params built under `deepspeed.zero.Init`; rank r's `ds_tensor` = elements [r·k, (r+1)·k) of the flattened weight, padded) | stage 3: gathered into whole weights (zero3.whole_params); other stages: refused (tests/test_deepspeed_zero3.py builds one) |
"""

from __future__ import annotations

import inspect
import os

TESTED = ((0, 19), (0, 20))   # [low, high): DeepSpeed 0.19.x
ALLOW_UNTESTED = "SHARDOPT_ALLOW_UNTESTED_DEEPSPEED"
_checked = []
_original_initialize: list = []   # DeepSpeed's deepspeed.initialize while register() has replaced it


def _version(text: str) -> tuple[int, int]:
    parts = text.split("+")[0].split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def missing_internals(deepspeed) -> list[str]:
    """The internals of the table above that this DeepSpeed lacks (empty when all are there)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.utils import groups
    import deepspeed.comm
    import deepspeed.moe.layer
    from deepspeed.accelerator import get_accelerator
    checks = {
        "DeepSpeedEngine.backward(scale_wrt_gas=...)":
            "scale_wrt_gas" in inspect.signature(unwrapped(DeepSpeedEngine.backward)).parameters,
        "DeepSpeedEngine.destroy": hasattr(DeepSpeedEngine, "destroy"),
        "DeepSpeedEngine._take_model_step reads optimizer.overflow":
            "overflow" in inspect.getsource(DeepSpeedEngine._take_model_step),
        "FP16_UnfusedOptimizer.initialize_optimizer_states": hasattr(FP16_UnfusedOptimizer, "initialize_optimizer_states"),
        "FP16_UnfusedOptimizer.step uses overflow_checker and fp16_groups/fp32_groups":
            all(name in inspect.getsource(FP16_UnfusedOptimizer.step) for name in ("overflow_checker", "fp16_groups",
                                                                                    "fp32_groups", "_global_grad_norm",
                                                                                    "_skip_invalid_grad_norm",
                                                                                    "fp16_param.grad.to(fp32_param.dtype)")),
        "FP16_UnfusedOptimizer.refresh_fp32_params": hasattr(FP16_UnfusedOptimizer, "refresh_fp32_params"),
        "FP16_UnfusedOptimizer.load_state_dict copies state_dict['fp32_groups'] into fp32_groups":
            "state_dict['fp32_groups']" in inspect.getsource(FP16_UnfusedOptimizer.load_state_dict)
            and "load_optimizer_states" in inspect.signature(FP16_UnfusedOptimizer.load_state_dict).parameters,
        "FP16_UnfusedOptimizer.zero_grad and refresh_fp32_params read fp16_groups":
            all("self.fp16_groups" in inspect.getsource(getattr(FP16_UnfusedOptimizer, name))
                for name in ("zero_grad", "refresh_fp32_params")),
        "FP16_UnfusedOptimizer.loss_scale": hasattr(FP16_UnfusedOptimizer, "loss_scale"),
        "FP16_UnfusedOptimizer.unscale_and_clip_grads multiplies by 1. / loss_scale_config.cur_scale":
            all(text in inspect.getsource(FP16_UnfusedOptimizer.unscale_and_clip_grads)
                for text in ("loss_scale_config.cur_scale", "mul_(1. / combined_scale)")),
        "DeepSpeedEngine._zero3_consolidated_16bit_state_dict, save_16bit_model, zero_gather_16bit_weights_on_model_save":
            all(hasattr(DeepSpeedEngine, name) for name in ("_zero3_consolidated_16bit_state_dict", "save_16bit_model",
                                                            "zero_gather_16bit_weights_on_model_save")),
        "deepspeed.utils.groups._get_data_parallel_group": hasattr(groups, "_get_data_parallel_group"),
        "deepspeed.comm.destroy_process_group": hasattr(deepspeed.comm, "destroy_process_group"),
        "deepspeed.init_distributed and deepspeed.comm.is_initialized":
            hasattr(deepspeed, "init_distributed") and hasattr(deepspeed.comm, "is_initialized"),
        "deepspeed.moe.layer.MoE": hasattr(deepspeed.moe.layer, "MoE"),
        "accelerator.is_fp16_supported": hasattr(get_accelerator(), "is_fp16_supported"),
        "deepspeed.initialize(optimizer=callable)": "optimizer" in inspect.signature(deepspeed.initialize).parameters,
    }
    return [name for name, present in checks.items() if not present]


def unscale_factor(wrapper) -> float:
    """What the fp16/bf16 wrapper multiplies the fp32 copies of the gradients by in its step, without clipping
    (unscale_and_clip_grads: combined_scale = loss_scale_config.cur_scale)."""
    return 1. / wrapper.loss_scale_config.cur_scale


def keep_original_initialize(deepspeed) -> None:
    """Remember DeepSpeed's own `deepspeed.initialize` before `register()` replaces the module attribute."""
    if not _original_initialize:
        _original_initialize.append(deepspeed.initialize)


def forget_original_initialize() -> None:
    """After `unregister()` has put DeepSpeed's initialize back."""
    _original_initialize.clear()


def original_initialize(deepspeed):
    """DeepSpeed's own initialize, registered or not."""
    return _original_initialize[0] if _original_initialize else deepspeed.initialize


def report_global_grad_norm(wrapper, norm) -> None:
    """Give the fp16/bf16 wrapper the agreed gradient norm, which engine.get_global_grad_norm() reads from it."""
    wrapper._global_grad_norm = norm


def unwrapped(function):
    """The function under DeepSpeed's instrument_w_nvtx decorator (which does not set __wrapped__)."""
    if function.__name__ == "wrapped_fn" and function.__closure__:
        inner = [cell.cell_contents for cell in function.__closure__ if callable(cell.cell_contents)]
        if len(inner) == 1:
            return inner[0]
    return function


def load():
    """Import DeepSpeed, check it once (version range and internals), and return the module."""
    try:
        import deepspeed
    except ImportError as error:
        raise ImportError("shardopt.deepspeed needs DeepSpeed, which is not installed: "
                          "pip install 'shardopt[deepspeed]'") from error
    if _checked:
        return deepspeed
    low, high = TESTED
    version = _version(deepspeed.__version__)
    if not low <= version < high and os.environ.get(ALLOW_UNTESTED) != "1":
        raise ImportError(f"shardopt.deepspeed is tested with DeepSpeed {low[0]}.{low[1]}.x, and DeepSpeed "
                          f"{deepspeed.__version__} is installed; the plugin relies on DeepSpeed internals (listed in "
                          f"shardopt/deepspeed/internals.py). Install 'deepspeed>={low[0]}.{low[1]},<{high[0]}.{high[1]}' "
                          f"(pip install 'shardopt[deepspeed]'), or set {ALLOW_UNTESTED}=1 to try this version")
    missing = missing_internals(deepspeed)
    if missing:
        raise ImportError(f"DeepSpeed {deepspeed.__version__} lacks internals the shardopt plugin relies on: "
                          f"{'; '.join(missing)}. Install 'deepspeed>={low[0]}.{low[1]},<{high[0]}.{high[1]}'")
    _checked.append(True)
    return deepspeed


def fp16_supported() -> bool:
    """Whether DeepSpeed's accelerator runs fp16 here (its CPU accelerator needs mkldnn fp16)."""
    from deepspeed.accelerator import get_accelerator
    return bool(get_accelerator().is_fp16_supported())
