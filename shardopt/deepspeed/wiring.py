"""Every change the plugin makes to DeepSpeed objects, owned by one object that can undo it.

`EngineWiring(engine, optimizer)` fits an engine that holds a shardopt optimizer (built by
`initialize`, or handed over by `client_optimizer` and `attach`) and records each change in a
`Patches` list; `detach()` restores every attribute it set, in reverse order, and removes the
gradient hooks it registered, so the engine is as DeepSpeed built it (the optimizer goes back to
inert: a step on non-zero gradients raises). What is changed, and why (shardopt/deepspeed/__init__.py):

| object | attribute | change |
|---|---|---|
| engine | `enable_backward_allreduce` | False: backward leaves local gradients, the optimizer exchanges |
| engine | `backward` | fp16: the loss scale (DeepSpeed#8393); ZeRO 2: each gradient reduced to its owner; before the accumulation boundary under `optimizer.accumulating()` (overlap_backward) |
| engine | `save_checkpoint`, `load_checkpoint` | ZeRO 1/2: each rank's own partition next to DeepSpeed's files; local steps: each rank's optimizer state and params |
| fp16/bf16 wrapper | `fp16_groups`, `fp32_groups`, `load_state_dict`; the masters of slots owned elsewhere | ZeRO 2/3: fp32 master copies only for the owned slots, the gather into the model's params (masters.py); bf16: those packed between steps (the optimizer's `param_residency`) |
| fp16/bf16 wrapper | `overflow_checker` | a check agreed over all data-parallel ranks |
| fp16/bf16 wrapper | `checkpoint_event_prologue` | the momenta averaged before DeepSpeed gathers the state |
| fp16/bf16 wrapper | `_skip_invalid_grad_norm` | local steps: a skipped step still counts towards the round; overlap_backward: the work begun in backward is dropped |
| optimizer | `wiring` (the inner one under local steps); its params ↔ the wrapper's fp32 master copies | `replace_params` both ways |
| engine, modules, params | `backward`, `save_checkpoint`, `load_checkpoint`; forward hooks; post-accumulate-grad hooks | ZeRO 3: the weights not owned here released outside the modules using them (zero3.py) |
| optimizer, masters, engine | the Dion matrices' params (fp32) or masters' data and their pairs in `wiring.masters` (fp16/bf16); engine `zero_grad` (fp32), `load_checkpoint` (rank 0's optimizer state skipped) | ZeRO 3: Dion's matrices split by rows over the node (zero3.split_rows) |
| params | post-accumulate-grad hooks | ZeRO 2/3 (zero.BackwardReducer), fp16/bf16: with overlap_backward each final gradient handed to the optimizer's round |
"""

from __future__ import annotations

import contextlib
import inspect
import os

import torch

from ..checkpoint import load_optimizer_state, load_tensors, save_optimizer_state, save_tensors
from . import internals, masters, zero3
from .optimizers import AgreedOverflowCheck, DeepSpeedLocalSteps, engine_side
from .zero import BackwardReducer

_ABSENT = object()


class Patches:
    """Attributes set on objects, each with what it replaced; `undo()` puts every one back (an
    attribute that was not on the instance before is deleted, so the class's own shows again)."""

    def __init__(self):
        self._done: list[tuple[object, str, object]] = []

    def set(self, obj, name: str, value) -> None:
        self._done.append((obj, name, vars(obj).get(name, _ABSENT)))
        setattr(obj, name, value)

    def on_undo(self, restore) -> None:
        """Call restore() when undo() reaches this point (what no attribute records, e.g. a tensor's storage)."""
        self._done.append((None, restore, None))

    def undo(self) -> None:
        while self._done:
            obj, name, old = self._done.pop()
            if obj is None:
                name()
            elif old is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


class EngineWiring:
    """The shardopt optimizer `optimizer` fitted to `engine` (see the module doc); `detach()` undoes it."""

    def __init__(self, engine, optimizer):
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

        if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
            raise NotImplementedError("shardopt optimizers under DeepSpeed do not support torch_autocast with float16 "
                                      "(its GradScaler decides to skip a step on each rank alone); use "
                                      "\"fp16\": {\"enabled\": true} or bf16")
        if getattr(engine, "has_moe_layers", False):
            raise NotImplementedError("shardopt under DeepSpeed does not support MoE layers (deepspeed.moe.layer.MoE); "
                                      "see shardopt/deepspeed/config.py")
        wrapper = engine.optimizer
        if wrapper is not optimizer and not isinstance(wrapper, FP16_UnfusedOptimizer):
            raise NotImplementedError(f"DeepSpeed wrapped the shardopt optimizer in {type(wrapper).__name__}; "
                                      f"shardopt supports fp32, bf16 or fp16 with DeepSpeed given ZeRO stage 0")
        self.engine, self.optimizer = engine, optimizer   # what the engine steps (a LocalSteps or the Dion/Sign-Muon)
        self.side = side = engine_side(optimizer)         # the Dion / Sign-Muon
        self.local_steps = isinstance(optimizer, DeepSpeedLocalSteps)
        self.wrapper = wrapper if wrapper is not optimizer else None
        self.patches = Patches()
        self.hooks = []
        self.masters: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.patches.set(engine, "enable_backward_allreduce", False)
        model_params = side._slots()
        if self.wrapper is not None:
            self.masters = [pair for lp, fp32 in zip(wrapper.fp16_groups, wrapper.fp32_groups) for pair in zip(lp, fp32)]
            optimizer.replace_params(self.masters)
            model_params = [lp for lp, _ in self.masters]
        blocks = zero3.split_rows(self, model_params) if side.zero is not None and side.zero.stage == 3 else {}
        if self.wrapper is not None:
            if masters.applies(self):
                masters.own_masters_only(self)
            self.patches.set(wrapper, "overflow_checker", AgreedOverflowCheck(masters.gradient_holders(self), side))
            self.patches.set(wrapper, "checkpoint_event_prologue", side.checkpoint_event_prologue)
            self._wrap_skipped_steps()
        self._wrap_backward(model_params)
        if (side.zero is not None and side.zero.stage >= 1) or self.local_steps or getattr(side, "per_replica_state", False):
            self._wrap_checkpoints()   # per_replica_state: 1-bit Adam's error feedback (deepspeed/onebit.py)
        if side.zero is not None and side.zero.stage == 3:
            zero3.release_weights(self, model_params, blocks)   # the weights too, on their owners only (zero3.py)
        self.patches.set(side, "wiring", self)
        if side.overlap_backward:
            side.overlap_backward = True   # its hooks again: none where hand_over gives it the gradients

    def detach(self) -> None:
        """Restore the engine, its wrapper, the params and the optimizer as they were before the wiring."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.patches.undo()
        self.optimizer.replace_params([(fp32, lp) for lp, fp32 in self.masters])
        self.masters = []

    def _wrap_skipped_steps(self) -> None:
        """Under fp16/bf16 the wrapper skips a step with a non-finite gradient without calling the optimizer
        (on every rank alike: AgreedOverflowCheck; under local steps agreed over the node only). Local steps
        count it all the same (skip_step); with overlap_backward the work begun in backward is finished and
        dropped (discard_backward_work)."""
        skip, optimizer, side, local_steps = self.wrapper._skip_invalid_grad_norm, self.optimizer, self.side, self.local_steps

        def skip_invalid_grad_norm(*args, **kwargs):
            result = skip(*args, **kwargs)
            side.discard_backward_work()
            if local_steps:
                optimizer.skip_step()
            return result

        self.patches.set(self.wrapper, "_skip_invalid_grad_norm", skip_invalid_grad_norm)

    def _wrap_checkpoints(self) -> None:
        """DeepSpeed (given stage 0) writes the weights and optimizer state of data-parallel rank 0 only. At
        ZeRO 1/2 that is one partition; under local steps the replicas differ between syncs (weights, inner
        state, error feedback). engine.save_checkpoint here also writes every rank's own optimizer state (its
        partition, momenta averaged over the replicas first; the outer state with the inner) as
        <dir>/<tag>/shardopt_zero_rank<rank>.safetensors, under local steps its params (the fp32 master
        copies under fp16/bf16) as shardopt_params_rank<rank>.safetensors, and engine.load_checkpoint reads
        them back, so a resumed run continues the saving run's trajectory, mid-round too. The same world
        size and mesh are needed to load (the files of each rank hold that rank's state)."""
        engine, optimizer = self.engine, self.optimizer
        params, fp32 = self.side._slots(), [master for _, master in self.masters]
        kinds = ("zero", *(("params",) if self.local_steps else ()), *(("masters",) if masters.applies(self) else ()))
        save, load = engine.save_checkpoint, engine.load_checkpoint
        save_signature = inspect.signature(internals.unwrapped(type(engine).save_checkpoint))

        def own_file(directory, what="zero") -> str:
            return os.path.join(directory, f"shardopt_{what}_rank{torch.distributed.get_rank()}.safetensors")

        def save_checkpoint(save_dir, *args, **kwargs):
            tag = save_signature.bind(engine, save_dir, *args, **kwargs).arguments.get("tag")
            tag = f"global_step{engine.global_steps}" if tag is None else tag   # DeepSpeed's default tag
            result = save(save_dir, *args, **kwargs)
            save_optimizer_state(optimizer, own_file(os.path.join(save_dir, str(tag))))   # each rank reads its own
            for what in kinds[1:]:   # params: local steps; masters: this rank's fp32 master copies (masters.py)
                with masters.all_present(self):   # (bf16: rebuilt whole for the file)
                    save_tensors(params if what == "params" else fp32, own_file(os.path.join(save_dir, str(tag)), what))
            return result

        def load_checkpoint(load_dir, *args, **kwargs):
            path, client_state = load(load_dir, *args, **kwargs)
            if path is not None:
                own = [own_file(os.path.dirname(path), what) for what in kinds]
                missing = [name for name in own if not os.path.exists(name)]
                if missing:
                    raise FileNotFoundError(f"{missing[0]} not found: the checkpoint was not written by shardopt "
                                            f"{'with local steps' if self.local_steps else 'at ZeRO stage 1/2'} "
                                            f"with this world size ({torch.distributed.get_world_size()} ranks)")
                load_optimizer_state(optimizer, own[0])
                if "masters" in kinds:
                    with masters.all_present(self):   # (bf16: packed again after, the model's weights ← RNE)
                        load_tensors(fp32, own[1])
                if self.local_steps:
                    load_tensors(params, own[1])
                    self.model_weights_from_masters()
            return path, client_state

        save_checkpoint.__doc__, load_checkpoint.__doc__ = save.__doc__, load.__doc__
        self.patches.set(engine, "save_checkpoint", save_checkpoint)
        self.patches.set(engine, "load_checkpoint", load_checkpoint)

    @torch.no_grad()
    def model_weights_from_masters(self) -> None:
        """The model's fp16/bf16 weights from the fp32 master copies, as the wrapper's step does (nothing in
        fp32: the optimizer's params are the model's)."""
        for low, master in self.masters:
            low.copy_(master)

    def _hand_over(self):
        """hand_over(param, g): with overlap_backward, a model param's final gradient g (its .grad, or at ZeRO 2
        the node mean) to the optimizer's round, as step() will read it: g itself in fp32; under fp16/bf16 the
        master copy's, made as the wrapper's step makes it (g.to(fp32) · (1 / loss scale); a loss scale that the
        step changes first gives other values, which step() finds, and it steps again)."""
        side, wrapper = self.side, self.wrapper
        master_of = {lp: fp32 for lp, fp32 in self.masters}

        def hand_over(param, grad):
            overlap = side.backward_overlap
            if overlap is None or not overlap.taking_gradients():
                return
            if wrapper is None:
                overlap.gradient_final(param, grad)
                return
            master = master_of[param]
            overlap.gradient_final(master, grad.to(master.dtype, copy=True).mul_(internals.unscale_factor(wrapper)))
        return hand_over

    def _wrap_backward(self, model_params: list[torch.Tensor]) -> None:
        """engine.backward, plus:
        - fp16: the loss scale. DeepSpeed 0.19 at stage 0 runs backward without it yet unscales in step
          (deepspeedai/DeepSpeed#8393): the gradient entering the loss is set to loss_scale /
          gradient_accumulation_steps (loss_scale without scale_wrt_gas), whatever the engine multiplies
          the loss by, as DeepSpeed's fp16 wrapper expects when it unscales in step.
        - ZeRO stage 2: during backward each fresh local gradient goes to its owner (zero.BackwardReducer);
          after it the owned node means are added to the owned gradients kept from earlier micro-batches (on
          the fp32 master copies under fp16/bf16: masters.gradient_holders).
          With overlap_backward, the boundary's owned gradients are handed to the optimizer as their reduces
          complete (`_hand_over`; the hooks on the params are the reducer's, the optimizer registers none).
        - fp16/bf16 at stage 0: hooks on the model params hand their gradients over (`_hand_over`) with
          overlap_backward; the optimizer's own would sit on the master copies, which backward never reaches.
        - A micro-batch before the accumulation boundary runs under `optimizer.accumulating()`, so that with
          overlap_backward the exchange starts in the boundary's backward only (without it: nothing). Unmanaged
          accumulation (managed_gradient_accumulation false) has no boundary in backward: step() exchanges."""
        engine, optimizer = self.engine, self.side
        fp16 = engine.fp16_enabled()
        reducer, hand_over = None, self._hand_over()
        holders = masters.gradient_holders(self) if self.wrapper is not None else self.side._slots()   # (ZeRO 3's row blocks)
        if optimizer.zero is not None and optimizer.zero.stage >= 2:
            reducer = BackwardReducer(optimizer.zero, model_params, optimizer.reduce_bucket_size, holders)
            self.hooks = reducer.hooks
        elif self.wrapper is not None:
            self.hooks = [param.register_post_accumulate_grad_hook(lambda param: hand_over(param, param.grad))
                          for param in model_params if param.requires_grad]
        original = engine.backward
        signature = inspect.signature(internals.unwrapped(type(engine).backward))

        def backward(loss, *args, **kwargs):
            handle = _fp16_loss_gradient(engine, signature, loss, args, kwargs) if fp16 else None
            boundary = engine.is_gradient_accumulation_boundary()
            if reducer is not None:
                reducer.begin([h.grad for h in holders], hand_over if optimizer.overlap_backward and boundary else None)
                for holder in holders:
                    holder.grad = None
            try:
                with contextlib.nullcontext() if boundary else optimizer.accumulating():
                    result = original(loss, *args, **kwargs)
            finally:
                if handle is not None:
                    handle.remove()
                if reducer is not None:
                    for holder, grad in zip(holders, reducer.end()):
                        holder.grad = grad
            return result

        backward.__doc__ = original.__doc__
        self.patches.set(engine, "backward", backward)


def _fp16_loss_gradient(engine, signature, loss, args, kwargs):
    """The hook that sets the gradient entering `loss` to loss_scale / gradient_accumulation_steps (loss_scale
    when engine.backward is called with scale_wrt_gas=False): DeepSpeed#8393, see EngineWiring._wrap_backward."""
    scale_wrt_gas = signature.bind(engine, loss, *args, **kwargs).arguments.get("scale_wrt_gas", True)
    factor = engine.optimizer.loss_scale / (engine.gradient_accumulation_steps() if scale_wrt_gas else 1)
    return loss.register_hook(lambda grad: torch.full_like(grad, factor))
