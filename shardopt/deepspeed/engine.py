"""Building the optimizer for a DeepSpeed engine and wiring the engine to it (two entry points:
`initialize`, and `client_optimizer` + `attach` for code that calls deepspeed.initialize itself)."""

from __future__ import annotations

import copy
import gc
import inspect
import sys

import torch

from ..wire.comm import split_world
from ..optim.groups import describe_groups
from ..optim.optimizer import ShardOptimizer
from . import internals, zero3
from .config import (PluginSetup, build_param_groups, check_scheduler, load_config, plugin_setup, read_config,
                     scale_scheduler_lrs)
from .optimizers import DeepSpeedLocalSteps, engine_side
from .wiring import EngineWiring
from .zero import mesh_shape


def initialize(*args, **kwargs):
    """deepspeed.initialize, with "optimizer": {"type": "Dion" | "SignMuon", "params": {...}} in the
    config built by shardopt (see the package doc). Returns (engine, optimizer, training_dataloader,
    lr_scheduler) as deepspeed.initialize does; under fp16/bf16 `optimizer` is DeepSpeed's wrapper,
    and `shard_optimizer(engine)` is the shardopt optimizer (comm_stats, replicas_consistent)."""
    deepspeed = internals.load()
    bound = inspect.signature(internals.original_initialize(deepspeed)).bind(*args, **kwargs)
    call = bound.arguments
    config, config_from_args = read_config(call)
    setup = plugin_setup(config, call.get("model"), call.get("mpu"), fp16_supported=internals.fp16_supported)
    if setup is None:
        _check_no_zero_around_a_shardopt_optimizer(call.get("optimizer"), config)
        return internals.original_initialize(deepspeed)(*args, **kwargs)
    if call.get("optimizer") is not None:
        raise ValueError(f"the config asks for the {setup.name} optimizer and an optimizer was passed too; "
                         f"give one: drop the config's \"optimizer\" section or the optimizer argument")
    if call.get("model") is None:
        raise ValueError("shardopt.deepspeed.initialize needs model=... to build the param groups")
    _check_accelerate_counts_every_rank()
    if setup.zero_stage == 3:   # a model built under deepspeed.zero.Init: whole params before the groups (zero3.py)
        call["model_parameters"] = zero3.whole_params(call["model"], call.get("model_parameters"))
    built = []
    given = call.get("model_parameters") is not None
    if given:
        call["model_parameters"] = list(call["model_parameters"])   # read twice: the scheduler's lrs, the optimizer
    scale_scheduler_lrs(setup, lambda: build_param_groups(call["model"], call.get("model_parameters"), setup.cls,
                                                             setup.section))

    def build(model_parameters):    # called by the engine once the model is cast and on its device
        built.append(_build(setup, call["model"], model_parameters if given else None,
                            check_lr_scheduler=call.get("lr_scheduler") is None))
        return built[0]

    call["optimizer"] = build
    call["config"] = setup.engine_config
    call.pop("config_params", None)
    if config_from_args:
        call["args"] = copy.copy(call["args"])
        call["args"].deepspeed_config = None
    engine, *rest = internals.original_initialize(deepspeed)(**call)
    EngineWiring(engine, built[0])
    return (engine, *rest)


def engine_config(config) -> dict:
    """The config to give DeepSpeed when shardopt's optimizer is the client optimizer (Accelerate's
    DeepSpeedPlugin(hf_ds_config=...), Transformers' TrainingArguments(deepspeed=...)): the same config
    with ZeRO stage 0 (shardopt runs stages 1/2 itself), gradient_clipping 0 (the optimizer clips,
    agreed over the replicas) and without the "optimizer" and "shardopt" sections. No process group needed."""
    internals.load()
    setup = plugin_setup(load_config(config), fp16_supported=internals.fp16_supported)
    if setup is None:
        raise ValueError("the config's \"optimizer\" type must be \"Dion\" or \"SignMuon\" for shardopt")
    if setup.section.get("scale_scheduler_lr"):
        raise ValueError("\"shardopt\": {\"scale_scheduler_lr\": true} needs the model's param groups, which "
                         "engine_config(config) does not see: call shardopt.deepspeed.register() and give DeepSpeed the "
                         "full config (or use shardopt.deepspeed.initialize), or give the scheduler's lrs as lists")
    return setup.engine_config


def client_optimizer(model, config, model_parameters=None) -> ShardOptimizer | DeepSpeedLocalSteps:
    """The shardopt optimizer the config asks for, built on `model`'s parameters, to hand to code that
    calls deepspeed.initialize itself (accelerator.prepare(model, optimizer, ...)); after that call
    `attach(engine)`. Before deepspeed.comm is up (e.g. before the Accelerator exists) it starts it as
    deepspeed.initialize would (deepspeed.init_distributed(), from the launcher's environment). The config
    is the full one (with "optimizer", "gradient_clipping", ZeRO stage and "shardopt"); DeepSpeed must be
    given engine_config(config)."""
    deepspeed = internals.load()
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed()
    setup = plugin_setup(load_config(config), model, fp16_supported=internals.fp16_supported)
    if setup is None:
        raise ValueError("the config's \"optimizer\" type must be \"Dion\" or \"SignMuon\" for shardopt")
    if setup.zero_stage == 3:   # a model built under deepspeed.zero.Init: whole params (zero3.py)
        model_parameters = zero3.whole_params(model, model_parameters)
    return _build(setup, model, model_parameters, check_lr_scheduler=True)


def attach(engine) -> ShardOptimizer | DeepSpeedLocalSteps:
    """Wire an engine that someone else built around a `client_optimizer` (the engine's gradient
    all-reduce off, fp16/bf16 master copies, agreed overflow, ZeRO 1/2). Returns the shardopt optimizer.
    With Accelerate: engine = model after accelerator.prepare (a DeepSpeedEngine)."""
    internals.load()
    optimizer = shard_optimizer(engine)
    if engine_side(optimizer).wiring is not None:
        return optimizer
    if engine.zero_optimization_stage() != 0 or engine.gradient_clipping() != 0:
        raise ValueError(f"DeepSpeed was given ZeRO stage {engine.zero_optimization_stage()} and gradient_clipping "
                         f"{engine.gradient_clipping()}; give DeepSpeed shardopt.deepspeed.engine_config(config) "
                         f"(ZeRO stage 0, clipping 0: shardopt does both itself) and the full config to client_optimizer")
    EngineWiring(engine, optimizer)
    return optimizer


def detach(engine) -> ShardOptimizer | DeepSpeedLocalSteps:
    """Undo the wiring of `engine` (wiring.EngineWiring.detach): every attribute the plugin set on the engine
    and DeepSpeed's fp16/bf16 wrapper restored, its gradient hooks removed; the optimizer is inert again
    (`attach(engine)` wires it anew). Returns the shardopt optimizer."""
    optimizer = shard_optimizer(engine)
    if engine_side(optimizer).wiring is not None:
        engine_side(optimizer).wiring.detach()
    return optimizer


def shard_optimizer(engine) -> ShardOptimizer | DeepSpeedLocalSteps:
    """The shardopt optimizer inside a DeepSpeed engine (DeepSpeed's fp16/bf16 wrapper holds it): with
    "local_steps" the LocalSteps (comm_stats, describe, replicas_consistent), its `inner` the Dion or
    Sign-Muon."""
    optimizer = getattr(engine, "basic_optimizer", None)
    if not isinstance(optimizer, (ShardOptimizer, DeepSpeedLocalSteps)):
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


def _check_no_zero_around_a_shardopt_optimizer(optimizer, config: dict) -> None:
    """A shardopt optimizer passed to DeepSpeed with ZeRO 1-3 in the config (e.g. accelerator.prepare(model,
    shardopt.SignMuon(...)) with DeepSpeedPlugin(zero_stage=3)) refused: DeepSpeed's own ZeRO would hand it flat
    1-D partitions (no matrices) and average the gradients itself."""
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if isinstance(optimizer, (ShardOptimizer, DeepSpeedLocalSteps)) and stage not in (0, "auto"):
        raise ValueError(f"a shardopt optimizer ({type(optimizer).__name__}) was passed to DeepSpeed with "
                         f"zero_optimization.stage = {stage}: DeepSpeed's own ZeRO would give it flat partitions, not "
                         f"matrices. Name it in the config instead, \"optimizer\": {{\"type\": \"SignMuon\" or "
                         f"\"Dion\", \"params\": {{...}}}}, so shardopt runs the ZeRO stage (with Accelerate: "
                         f"DeepSpeedPlugin(hf_ds_config=config) and DummyOptim; docs/trainers.md)")


def _check_accelerate_counts_every_rank() -> None:
    """Accelerate (and HF Trainer through it) on a machine without GPUs finds no distributed backend for
    DeepSpeed (accelerate.state.PartialState._prepare_backend: no accelerator device, no default backend)
    and then counts one process, so it neither splits the data nor sizes the batch for the world: every
    rank trains on the same batches. Refused here, naming the settings that give Accelerate its backend."""
    state = sys.modules.get("accelerate.state")
    if state is None or not state.is_initialized() or not torch.distributed.is_initialized():
        return
    processes, world = state.AcceleratorState().num_processes, torch.distributed.get_world_size()
    if processes != world:
        raise RuntimeError(f"Accelerate counts {processes} process(es) but {world} ranks are running: it found no "
                           f"distributed backend for DeepSpeed on this machine (no GPU), so every rank would train on the "
                           f"same batches. Give it one: with HF Trainer, TrainingArguments(..., use_cpu=True) (--use_cpu; "
                           f"DeepSpeed still runs, on gloo), or before TrainingArguments: os.environ["
                           f"\"ACCELERATE_USE_DEEPSPEED\"] = \"true\"; accelerate.PartialState(backend=\"gloo\") and "
                           f"TrainingArguments(..., accelerator_config={{\"use_configured_state\": True}}); with Accelerate, "
                           f"Accelerator(deepspeed_plugin=..., kwargs_handlers=[InitProcessGroupKwargs(backend=\"gloo\")]) "
                           f"(not Accelerator(cpu=True), which leaves DeepSpeed out) (see docs/trainers.md)")


def _build(setup: PluginSetup, model, model_parameters, check_lr_scheduler: bool) -> ShardOptimizer | DeepSpeedLocalSteps:
    """The optimizer on the setup's mesh: the replicate group (DeepSpeed's data-parallel group when
    there is no mesh) and, with a mesh, this rank's node group. With "local_steps" the Dion / Sign-Muon
    has no replicate axis and a DeepSpeedLocalSteps over the replicate group wraps it."""
    from deepspeed.utils import groups as deepspeed_groups
    groups = build_param_groups(model, model_parameters, setup.cls, setup.section)
    mesh = mesh_shape(setup.mesh, setup.zero_stage, torch.distributed.get_world_size())
    replicate, node = split_world(*mesh) if mesh else (deepspeed_groups._get_data_parallel_group(), None)
    optimizer = setup.cls(groups, **setup.options, max_grad_norm=setup.max_grad_norm,
                             zero_stage=setup.zero_stage, reduce_bucket_size=setup.reduce_bucket_size,
                             node_mesh=node, replicate_mesh=None if setup.local_steps else replicate)
    if setup.local_steps:
        optimizer = DeepSpeedLocalSteps(optimizer, replicate_mesh=replicate, **setup.local_steps)
    if check_lr_scheduler:
        check_scheduler(setup.scheduler, optimizer.param_groups)
    if setup.section.get("verbose") and torch.distributed.get_rank() == 0:
        print(describe_groups(optimizer.param_groups))
    return optimizer
