"""Building the optimizer for a DeepSpeed engine and wiring the engine to it (two entry points:
`initialize`, and `client_optimizer` + `attach` for code that calls deepspeed.initialize itself)."""

from __future__ import annotations

import copy
import gc
import inspect
import os

import torch

from ..comm import split_world
from ..groups import describe_groups
from ..optimizer import ShardOptimizer
from . import internals
from .config import Plan, build_param_groups, check_scheduler, load_config, plan, read_config
from .optimizers import AgreedOverflowCheck
from .zero import BackwardReducer, mesh_shape


def initialize(*args, **kwargs):
    """deepspeed.initialize, with "optimizer": {"type": "Dion" | "SignMuon", "params": {...}} in the
    config built by shardopt (see the package doc). Returns (engine, optimizer, training_dataloader,
    lr_scheduler) as deepspeed.initialize does; under fp16/bf16 `optimizer` is DeepSpeed's wrapper,
    and `shard_optimizer(engine)` is the shardopt optimizer (comm_stats, replicas_consistent)."""
    deepspeed = internals.load()
    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    call = bound.arguments
    config, config_from_args = read_config(call)
    the_plan = plan(config, call.get("model"), call.get("mpu"), fp16_supported=internals.fp16_supported)
    if the_plan is None:
        return deepspeed.initialize(*args, **kwargs)
    if call.get("optimizer") is not None:
        raise ValueError(f"the config asks for the {the_plan.name} optimizer and an optimizer was passed too; "
                         f"give one: drop the config's \"optimizer\" section or the optimizer argument")
    if call.get("model") is None:
        raise ValueError("shardopt.deepspeed.initialize needs model=... to build the param groups")
    built = []
    given = call.get("model_parameters") is not None

    def build(model_parameters):    # called by the engine once the model is cast and on its device
        built.append(_build(the_plan, call["model"], model_parameters if given else None,
                            check_lr_scheduler=call.get("lr_scheduler") is None))
        return built[0]

    call["optimizer"] = build
    call["config"] = the_plan.engine_config
    call.pop("config_params", None)
    if config_from_args:
        call["args"] = copy.copy(call["args"])
        call["args"].deepspeed_config = None
    engine, *rest = deepspeed.initialize(**call)
    wire(engine, built[0])
    return (engine, *rest)


def engine_config(config) -> dict:
    """The config to give DeepSpeed when shardopt's optimizer is the client optimizer (Accelerate's
    DeepSpeedPlugin(hf_ds_config=...), Transformers' TrainingArguments(deepspeed=...)): the same config
    with ZeRO stage 0 (shardopt runs stages 1/2 itself), gradient_clipping 0 (the optimizer clips,
    agreed over the replicas) and without the "optimizer" and "shardopt" sections. No process group needed."""
    internals.load()
    the_plan = plan(load_config(config), fp16_supported=internals.fp16_supported)
    if the_plan is None:
        raise ValueError("the config's \"optimizer\" type must be \"Dion\" or \"SignMuon\" for shardopt")
    return the_plan.engine_config


def client_optimizer(model, config, model_parameters=None) -> ShardOptimizer:
    """The shardopt optimizer the config asks for, built on `model`'s parameters, to hand to code that
    calls deepspeed.initialize itself (accelerator.prepare(model, optimizer, ...)); after that call
    `attach(engine)`. Needs the process group (create the Accelerator first). The config is the full
    one (with "optimizer", "gradient_clipping", ZeRO stage and "shardopt"); DeepSpeed must be given
    engine_config(config)."""
    internals.load()
    the_plan = plan(load_config(config), model, fp16_supported=internals.fp16_supported)
    if the_plan is None:
        raise ValueError("the config's \"optimizer\" type must be \"Dion\" or \"SignMuon\" for shardopt")
    return _build(the_plan, model, model_parameters, check_lr_scheduler=True)


def attach(engine) -> ShardOptimizer:
    """Wire an engine that someone else built around a `client_optimizer` (the engine's gradient
    all-reduce off, fp16/bf16 master copies, agreed overflow, ZeRO 1/2). Returns the shardopt optimizer.
    With Accelerate: engine = model after accelerator.prepare (a DeepSpeedEngine)."""
    internals.load()
    optimizer = shard_optimizer(engine)
    if not optimizer._inert:
        return optimizer
    if engine.zero_optimization_stage() != 0 or engine.gradient_clipping() != 0:
        raise ValueError(f"DeepSpeed was given ZeRO stage {engine.zero_optimization_stage()} and gradient_clipping "
                         f"{engine.gradient_clipping()}; give DeepSpeed shardopt.deepspeed.engine_config(config) "
                         f"(ZeRO stage 0, clipping 0: shardopt does both itself) and the full config to client_optimizer")
    wire(engine, optimizer)
    return optimizer


def shard_optimizer(engine) -> ShardOptimizer:
    """The shardopt optimizer inside a DeepSpeed engine (DeepSpeed's fp16/bf16 wrapper holds it)."""
    optimizer = getattr(engine, "basic_optimizer", None)
    if not isinstance(optimizer, ShardOptimizer):
        raise ValueError(f"this engine's optimizer is {type(optimizer).__name__}, not a shardopt optimizer")
    return optimizer


def shutdown(engine=None) -> None:
    """An orderly end of a DeepSpeed run: the engine's resources (engine.destroy()), then every process
    group through deepspeed.comm (which also drops DeepSpeed's references to them, so no group is
    left to be torn down during interpreter exit), then a garbage collection. Call it on every rank
    once no collective is pending (e.g. after a barrier)."""
    deepspeed = internals.load()
    if engine is not None:
        engine.destroy()
    if torch.distributed.is_initialized():
        deepspeed.comm.destroy_process_group()
    gc.collect()


def _build(the_plan: Plan, model, model_parameters, check_lr_scheduler: bool) -> ShardOptimizer:
    """The optimizer on the plan's mesh: the replicate group (DeepSpeed's data-parallel group when
    there is no mesh) and, with a mesh, this rank's node group."""
    from deepspeed.utils import groups as deepspeed_groups
    groups = build_param_groups(model, model_parameters, the_plan.cls, the_plan.section)
    mesh = mesh_shape(the_plan.mesh, the_plan.zero_stage, torch.distributed.get_world_size())
    replicate, node = split_world(*mesh) if mesh else (deepspeed_groups._get_data_parallel_group(), None)
    optimizer = the_plan.cls(groups, **the_plan.options, max_grad_norm=the_plan.max_grad_norm,
                             zero_stage=the_plan.zero_stage, reduce_bucket_size=the_plan.reduce_bucket_size,
                             node_mesh=node, replicate_mesh=replicate)
    if check_lr_scheduler:
        check_scheduler(the_plan.scheduler, optimizer.param_groups)
    if the_plan.section.get("verbose") and torch.distributed.get_rank() == 0:
        print(describe_groups(optimizer.param_groups))
    return optimizer


def wire(engine, optimizer: ShardOptimizer) -> None:
    """Turn the engine's gradient all-reduce off and fit the optimizer to DeepSpeed's fp16/bf16 wrapper."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
        raise NotImplementedError("shardopt optimizers under DeepSpeed do not support torch_autocast with float16 "
                                  "(its GradScaler decides to skip a step on each rank alone); use "
                                  "\"fp16\": {\"enabled\": true} or bf16")
    if getattr(engine, "has_moe_layers", False):
        raise NotImplementedError("shardopt under DeepSpeed does not support MoE layers (deepspeed.moe.layer.MoE); "
                                  "see shardopt/deepspeed/config.py")
    engine.enable_backward_allreduce = False
    wrapper = engine.optimizer
    model_params = optimizer._slots()
    if wrapper is not optimizer:
        if not isinstance(wrapper, FP16_UnfusedOptimizer):
            raise NotImplementedError(f"DeepSpeed wrapped the shardopt optimizer in {type(wrapper).__name__}; "
                                      f"shardopt supports fp32, bf16 or fp16 with DeepSpeed given ZeRO stage 0")
        for lp_params, master_params in zip(wrapper.fp16_groups, wrapper.fp32_groups):
            optimizer.adopt_master_copies(lp_params, master_params)
        model_params = [p for group in wrapper.fp16_groups for p in group]
        wrapper.overflow_checker = AgreedOverflowCheck(model_params, optimizer)
        wrapper.checkpoint_event_prologue = optimizer.checkpoint_event_prologue
        optimizer._wrapper = wrapper
    _wrap_backward(engine, optimizer, model_params)
    if optimizer.zero is not None and optimizer.zero.stage >= 1:
        _wrap_checkpoints(engine, optimizer)
    optimizer._inert = False


def _wrap_checkpoints(engine, optimizer) -> None:
    """ZeRO 1/2: DeepSpeed (given stage 0) writes the optimizer state of data-parallel rank 0 only, one
    partition. engine.save_checkpoint here also writes every rank's own state (its partition, momenta
    averaged over the replicas first) as <dir>/<tag>/shardopt_zero_rank<rank>.safetensors, and
    engine.load_checkpoint reads it back, so a resumed run continues the saving run's trajectory. The
    same world size and mesh are needed to load (the file of each rank holds that rank's partition)."""
    from ..checkpoint import load_optimizer_state, save_optimizer_state
    save, load = engine.save_checkpoint, engine.load_checkpoint
    save_signature = inspect.signature(internals.unwrapped(type(engine).save_checkpoint))

    def own_file(directory) -> str:
        return os.path.join(directory, f"shardopt_zero_rank{torch.distributed.get_rank()}.safetensors")

    def save_checkpoint(save_dir, *args, **kwargs):
        tag = save_signature.bind(engine, save_dir, *args, **kwargs).arguments.get("tag")
        tag = f"global_step{engine.global_steps}" if tag is None else tag   # DeepSpeed's default tag
        result = save(save_dir, *args, **kwargs)
        save_optimizer_state(optimizer, own_file(os.path.join(save_dir, str(tag))))   # each rank reads its own
        return result

    def load_checkpoint(load_dir, *args, **kwargs):
        path, client_state = load(load_dir, *args, **kwargs)
        if path is not None:
            own = own_file(os.path.dirname(path))
            if not os.path.exists(own):
                raise FileNotFoundError(f"{own} not found: the checkpoint was not written by shardopt at ZeRO stage "
                                        f"1/2 with this world size ({torch.distributed.get_world_size()} ranks)")
            load_optimizer_state(optimizer, own)
        return path, client_state

    save_checkpoint.__doc__, load_checkpoint.__doc__ = save.__doc__, load.__doc__
    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint


def _wrap_backward(engine, optimizer, model_params: list[torch.Tensor]) -> None:
    """engine.backward, plus:
    - fp16: the loss scale. DeepSpeed 0.19 at stage 0 runs backward without it yet unscales in step
      (deepspeedai/DeepSpeed#8393): the gradient entering the loss is set to loss_scale /
      gradient_accumulation_steps (loss_scale without scale_wrt_gas), whatever the engine multiplies
      the loss by, as DeepSpeed's fp16 wrapper expects when it unscales in step.
    - ZeRO stage 2: during backward each fresh local gradient goes to its owner (zero.BackwardReducer);
      after it the owned node means are added to the owned gradients kept from earlier micro-batches."""
    fp16 = engine.fp16_enabled()
    reducer = None
    if optimizer.zero is not None and optimizer.zero.stage == 2:
        reducer = BackwardReducer(optimizer.zero, model_params, optimizer.reduce_bucket_size)
    if not fp16 and reducer is None:
        return
    original = engine.backward
    signature = inspect.signature(internals.unwrapped(type(engine).backward))

    def backward(loss, *args, **kwargs):
        handle = None
        if fp16:
            scale_wrt_gas = signature.bind(engine, loss, *args, **kwargs).arguments.get("scale_wrt_gas", True)
            factor = engine.optimizer.loss_scale / (engine.gradient_accumulation_steps() if scale_wrt_gas else 1)
            handle = loss.register_hook(lambda grad: torch.full_like(grad, factor))
        kept = [p.grad for p in model_params]
        if reducer is not None:
            for param in model_params:
                param.grad = None
            reducer.begin()
        try:
            result = original(loss, *args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
            fresh = reducer.end() if reducer is not None else None
        if reducer is not None:
            for slot, (param, old) in enumerate(zip(model_params, kept)):
                new = fresh.get(slot)
                new = None if new is None else new.view(param.shape).to(param.dtype)
                param.grad = new if old is None else old if new is None else old.add_(new)
        return result

    backward.__doc__ = original.__doc__
    engine.backward = backward
