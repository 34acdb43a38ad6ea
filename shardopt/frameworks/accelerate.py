"""HF Accelerate (docs/design.md §11): `attach(accelerator, model, optimizer)` after `accelerator.prepare`.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    shardopt.accelerate.attach(accelerator, model, optimizer)

switches off the all-reduce of the DistributedDataParallel wrapper prepare() puts around the model on
several processes (shardopt.ddp.keep_local_gradients; the micro-batches `accelerator.accumulate` runs
under no_sync() then count as accumulation for the optimizer's exchange during backward), and registers a save-state pre-hook so that every
accelerator.save_state first averages the replicas' decoupled momenta (synchronize_for_checkpoint) and
checks that the replicas' weights agree. Clip with the optimizer's max_grad_norm, not
accelerator.clip_grad_norm_ (that clips each replica by its own norm). Under fp16 (Accelerate's GradScaler,
on GPUs only) attach gives the prepared optimizer's patched step the `grad_scaler` keyword, so the scaler
hands itself to shardopt's step, which agrees its overflow over the replicas (shardopt/frameworks/gradscaler.py),
and marks a skipped step as Accelerate's overflow (`optimizer.step_was_skipped`, alike on every rank). Accelerate
privates: AcceleratedOptimizer._optimizer_patched_step_method, ._accelerate_step_called (accelerate 1.16). Accelerate's FSDP and DeepSpeed
plugins are refused with the reason. accelerate is imported here only.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from .ddp import keep_local_gradients
from .common import check_replicas, prepare_checkpoint, shardopt_optimizer
from .gradscaler import hand_over_scaler

try:
    from accelerate.utils import DistributedType
except ImportError as error:   # an optional dependency: pip install 'shardopt[hf]'
    raise ImportError("shardopt.accelerate needs accelerate; install it with pip install 'shardopt[hf]'") from error


def attach(accelerator, model, optimizer) -> None:
    """Ready a prepared `model` and `optimizer` (what accelerator.prepare returned) for shardopt: call once,
    before the first backward (see the module doc)."""
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise NotImplementedError(
            f"shardopt.accelerate.attach: Accelerator(distributed_type={accelerator.distributed_type.value}) is not "
            f"supported here: FSDP through Accelerate swaps the optimizer's params for sharded ones after shardopt "
            f"derived its axes from them (shard with fully_shard before building the optimizer instead); for "
            f"DeepSpeed see docs/trainers.md, 'Accelerate with DeepSpeed'")
    shardopt = shardopt_optimizer(optimizer, "pass shardopt.SignMuon(...) or shardopt.Dion(...) to accelerator.prepare")
    check_replicas(shardopt, accelerator.num_processes, "Accelerate")
    if isinstance(model, DistributedDataParallel):
        keep_local_gradients(model, shardopt)
    elif accelerator.num_processes > 1:
        raise TypeError(f"shardopt.accelerate.attach: Accelerate runs {accelerator.num_processes} processes but the "
                        f"model is a {type(model).__name__}, not the DistributedDataParallel that accelerator.prepare "
                        f"returns; pass attach the model prepare returned")
    hand_over_scaler(optimizer, shardopt)
    accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: prepare_checkpoint(shardopt, "accelerator.save_state"))

