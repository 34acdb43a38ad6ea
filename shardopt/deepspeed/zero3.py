"""ZeRO stage 3 done by shardopt: the weights partitioned inside a node as well (docs/design.md §14).

At stages 1/2 (zero.py) each parameter is owned, whole, by one rank of its node, which alone keeps its
optimizer state (and, under fp16/bf16, its fp32 master copy: masters.py) and steps it. Stage 3 also keeps the
parameter itself on its owner only: on the node's other ranks its storage is released (0 bytes; the tensor
object, its shape and dtype stay, so autograd, the engine and the optimizer keep holding the same objects)
whenever no module that uses it runs. For a module m whose own parameters (recurse=False) are trained:

    forward pre-hook of m     gather m's params: broadcast from each one's owner over the node axis (exact copies)
    forward hook of m         release them; if an output needs a gradient, a hook gathers them again when the
                              first gradient of m's outputs arrives in backward (before m's backward runs)
    after p's gradient        stage 2's reduce of p's gradient to its owner (zero.BackwardReducer), then p released
    end of engine.backward    every param not owned here released (what no gradient reached, e.g. frozen paths)
    step                      each owner steps what it owns (the stage-2 math); nothing is gathered after it

so the optimizer step, the gradients (the node means reduced to their owners in the same order) and the
compressed exchange across nodes (the replicate axis) are those of stage 2, bitwise: the weights a module
computes with are the owner's, copied. A parameter's gathers are counted (a parameter shared by two modules is
released when the last one ends), the count is the same on every rank of the node, so every rank issues the same
broadcasts in the same order. Per rank: the params and the optimizer state of the owned slots, plus the params
of the modules running; bytes inside the node per micro-batch: each param broadcast twice (forward, backward)
on top of stage 2's reduces, and no all-gather after the step.

Dion's matrices and the element-wise groups' params are not owned whole: each is split by rows (dim 0) over the
node's S ranks (the "row slots" of ZeroPartition: the 2-D params of "dion" groups without a `split`, the params with
a dim 0 of the "adamw" and "lion" groups, whose update is per entry; optimizers.row_slots), the node being Dion's shard axis
as under FSDP2 (`split_rows`; the optimizer's shard axis is the node's group):

    rank i holds         rows [i·⌈m/S⌉, …) of the weight (a placement.RowBlock, in the model's dtype), of the fp32
                         master under fp16/bf16, of the momentum, and Q's rows (Dion works on B = Xᵀ)
    gather (forward,     all-gather of the row blocks (each zero-padded to ⌈m/S⌉ rows), in place of the broadcast;
      backward)          the whole weight is released on every rank after its use
    after p's gradient   reduce-scatter of its rows (the node sum; ZeroPartition.reduce_to_owner), in fp32
    step                 Dion's row-sharded power iteration: P = Σ_node B_i·Q_i, the distributed column norms, and
                         P's rows split over the node for the replicate mean (algorithms/dion.py, factors.py)

and an element-wise param's rows are stepped as FSDP2 HSDP steps its local shard (AdamW after the fp32 replicate
mean, Lion's vote with the coins of the entries' places in this rank's run of entries; 1-D params split along
their length, an empty block where rows < S). So every rank steps its rows of every row slot, the node sends
(a + b)·r per matrix across nodes as at stage 2
(plus ⌈a/S⌉·S − a padding rows of P when S does not divide a = n), and the held params + state are balanced
to 1/S whatever the matrices' sizes. Bitwise FSDP2 HSDP with the same config (tests/test_deepspeed_zero3.py); not
bitwise stage 2: Dion works on Xᵀ here (the row split must fall on
b), on X at stage 2 when m ≥ n; where both work on Xᵀ (m < n) they differ by the order of the row-block sums.

Parameters used outside the forward of a module holding them (e.g. `F.linear(x, self.wte.weight)` in a parent's
forward) are not gathered there: tie them as module attributes (`lm_head.weight = wte.weight`) so each module
holding them gathers them. The backward gather hooks the tensors of a module's output found in tensors, tuples,
lists and dicts (HF's ModelOutput is a dict), as DeepSpeed's own stage 3 does; a tensor inside another kind of
object is not seen. `engine.save_checkpoint` / `load_checkpoint` run with every weight gathered (DeepSpeed
writes data-parallel rank 0's whole model); `gathered_weights(engine)` does the same for code that reads the
model's weights (state_dict, evaluation without hooks). The engine's stage-3 save calls, which HF Trainer's
save_model and Accelerate's get_state_dict make (the engine itself runs stage 0), answer with the whole weights:
`_zero3_consolidated_16bit_state_dict` (WeightRelease.whole_state_dict), `save_16bit_model` (gathered) and
`zero_gather_16bit_weights_on_model_save` (true).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.distributed as dist

from ..layout.placement import mark_row_block, row_block
from ..wire.comm import Axis
from . import internals
from .optimizers import engine_side
from .zero import ZeroPartition


class WeightRelease:
    """The stage-3 weights of a model (module doc): `params` in the partition's slot order."""

    def __init__(self, partition: ZeroPartition, model: torch.nn.Module, params: list[torch.Tensor],
                 blocks: dict[int, torch.Tensor] | None = None):
        """blocks: each row slot's row block of the weight, in the param's dtype (`split_rows`)."""
        self.partition = partition
        self.params = list(params)
        self.owner = {id(p): partition.owners[slot] for slot, p in enumerate(self.params)}
        self.blocks = {id(self.params[slot]): block for slot, block in (blocks or {}).items()}
        self.gathers = {id(p): 0 for p in self.params}
        self.sizes = {id(p): p.untyped_storage().nbytes() for p in self.params}
        for slot, param in enumerate(self.params):
            if param.storage_offset() != 0 or not param.is_contiguous() or \
                    self.sizes[id(param)] != param.numel() * param.element_size():
                raise ValueError(f"ZeRO stage 3 releases each parameter's own storage, and parameter {slot} (shape "
                                 f"{tuple(param.shape)}) is a view into a larger one (e.g. a flat buffer): give every "
                                 f"parameter its own tensor, or use ZeRO stage 2")
        self.hooks = []
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in self.owner]
            if own:
                self.hooks.append(module.register_forward_pre_hook(functools.partial(self._before_forward, own)))
                self.hooks.append(module.register_forward_hook(functools.partial(self._after_forward, own)))
        for param in self.params:
            self.hooks.append(param.register_post_accumulate_grad_hook(lambda p: self.release([p])))
        self.release_all()

    def owns(self, param: torch.Tensor) -> bool:
        """This rank keeps the param whole (a row-split param is whole nowhere between its uses)."""
        return self.owner[id(param)] == self.partition.node.rank

    @torch.no_grad()
    def gather(self, params: list[torch.Tensor]) -> None:
        """Count a use of each param; the first use brings a released one back: broadcast from its owner, or
        all-gathered from the node's row blocks (each zero-padded to ⌈m/S⌉ rows, torch.chunk's split)."""
        for param in params:
            self.gathers[id(param)] += 1
            if self.gathers[id(param)] > 1:
                continue
            if not self.owns(param):
                param.untyped_storage().resize_(self.sizes[id(param)])
            block = self.blocks.get(id(param))
            if block is None:
                self.partition.node.broadcast(param.data, self.owner[id(param)])
                continue
            piece = block.new_zeros((-(-param.shape[0] // self.partition.node.size), *block.shape[1:]))
            piece[:block.shape[0]].copy_(block)
            param.data.copy_(self.partition.node.all_gather(piece).flatten(0, 1)[:param.shape[0]])

    @torch.no_grad()
    def blocks_from_params(self) -> None:
        """Each row block ← its rows of the param (gathered: after engine.load_checkpoint wrote the whole weights)."""
        for param in self.params:
            block = self.blocks.get(id(param))
            if block is not None:
                block.copy_(param[row_block(block).rows])

    def release(self, params: list[torch.Tensor]) -> None:
        """End a use of each param; a param not owned here and no longer used gives its storage back."""
        for param in params:
            self.gathers[id(param)] = max(self.gathers[id(param)] - 1, 0)
            if self.gathers[id(param)] == 0 and not self.owns(param):
                param.untyped_storage().resize_(0)

    def release_all(self) -> None:
        """Every param not owned here released, whatever its count (the end of a backward)."""
        for param in self.params:
            self.gathers[id(param)] = 1
        self.release(self.params)

    def _before_forward(self, params, module, args) -> None:
        self.gather(params)

    def _after_forward(self, params, module, args, output) -> None:
        self.release(params)
        needing = [t for t in _tensors(output) if t.requires_grad]
        if needing and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(needing, lambda grads: self.gather(params), mode="any")

    def whole_state_dict(self, model: torch.nn.Module, exclude_frozen_parameters: bool = False) -> dict:
        """model.state_dict() with every weight whole (gathered from the owners, copied, released again): on global
        rank 0 a dict of CPU copies (the names of a param shared by several modules on one tensor), as DeepSpeed's
        _zero3_consolidated_16bit_state_dict returns it; on the other ranks an empty dict, not DeepSpeed's None:
        given None, save_pretrained(..., is_main_process=False) reads model.state_dict(), whose weights are
        released here. Call it on every rank (the gathers are broadcasts); every rank holds the whole weights while
        it runs, as for engine.save_checkpoint."""
        frozen = {name for name, p in model.named_parameters() if not p.requires_grad} if exclude_frozen_parameters \
            else set()
        with self.all_gathered():
            if dist.get_rank() != 0:
                return {}
            copies = {}
            return {name: copies.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), t.shape),
                                            t.to("cpu", copy=True))
                    for name, t in model.state_dict().items() if name not in frozen}

    @contextlib.contextmanager
    def all_gathered(self):
        """Every param whole on every rank of the node inside the block, released again after it."""
        self.gather(self.params)
        try:
            yield
        finally:
            self.release(self.params)

    def detach(self) -> None:
        """The hooks removed and every param whole again on every rank (the model as it was before the wiring)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.gather(self.params)


def _tensors(output) -> list[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


@torch.no_grad()
def split_rows(wiring, model_params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Stage 3 on an EngineWiring, before its backward wrapper and masters.own_masters_only: each row slot's
    (ZeroPartition.rows) row block of the weight, cloned from the whole model param (marked placement.RowBlock), by
    slot. In fp32 the optimizer steps these blocks in place of the model's params; under fp16/bf16 the slot's fp32
    master becomes its row block and is paired with the weight's row block in `wiring.masters` (so masters.py
    writes the step's weights into the blocks, packs the master against them and refreshes it from them). Each
    change recorded in the wiring's Patches (undone: the optimizer's params, the masters and their pairs whole)."""
    side, zero, patches, wrapper = wiring.side, wiring.side.zero, wiring.patches, wiring.wrapper
    size, index = zero.node.size, zero.node.rank
    blocks = {}
    for slot, per_rank in zero.rows.items():
        param = model_params[slot]
        rows = slice(sum(per_rank[:index]), sum(per_rank[:index + 1]))
        blocks[slot] = mark_row_block(param.detach()[rows].clone(), tuple(param.shape), size, index)
    if wrapper is None:   # fp32: the optimizer's params are the model's; the row blocks step in their place
        slots, engine_zero_grad = side._slots(), wiring.engine.zero_grad
        replaced = {slots[slot]: block for slot, block in blocks.items()}
        _swap_params(side, replaced)
        patches.on_undo(lambda: _swap_params(side, {block: param for param, block in replaced.items()}, drop=True))

        def zero_grad():   # (the engine's clears the model's params only)
            engine_zero_grad()
            for block in blocks.values():
                block.grad = None

        zero_grad.__doc__ = engine_zero_grad.__doc__
        patches.set(wiring.engine, "zero_grad", zero_grad)
        return blocks
    for slot, block in blocks.items():   # (before masters.own_masters_only, which pairs each master with its weight)
        master = wiring.masters[slot][1]
        master.data = master.data[row_block(block).rows].clone()
        mark_row_block(master, block.shardopt_row_block.shape, size, index)
        wiring.masters[slot] = (block, master)

    def remake():   # (after the release's detach and masters.py's undo: every weight whole, every master unpacked)
        for slot in blocks:
            master = wiring.masters[slot][1]
            del master.shardopt_row_block
            master.data = model_params[slot].detach().to(torch.float32, copy=True)
            wiring.masters[slot] = (model_params[slot], master)

    patches.on_undo(remake)
    return blocks


def _swap_params(optimizer, replaced: dict, drop: bool = False) -> None:
    """Each param `old` of the optimizer's groups replaced by `replaced[old]`, which takes its seed index, label and
    state (drop: its state dropped instead, a row block's not fitting a whole param)."""
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(param, param) for param in group["params"]]
    optimizer.replace_params(replaced.items())
    for new in replaced.values() if drop else ():
        optimizer.state.pop(new, None)


def release_weights(wiring, model_params: list[torch.Tensor], blocks: dict[int, torch.Tensor]) -> WeightRelease:
    """Stage 3 on an EngineWiring (after its stage-2 backward and checkpoint wrappers): the weights released
    (module doc); engine.backward ends with every param not owned here released; engine.save_checkpoint and
    load_checkpoint run with every weight gathered (after a load the row blocks are taken from the loaded weights).
    Each change recorded in the wiring's Patches."""
    engine = wiring.engine
    release = WeightRelease(wiring.side.zero, engine.module, model_params, blocks)
    wiring.patches.on_undo(release.detach)
    backward, save, load = engine.backward, engine.save_checkpoint, engine.load_checkpoint
    save_16bit = engine.save_16bit_model

    def backward_releasing(*args, **kwargs):
        try:
            return backward(*args, **kwargs)
        finally:
            release.release_all()

    def gathered(original, then=lambda: None):
        """`original` run with every weight gathered (and `then` after it, still gathered)."""
        def call(*args, **kwargs):
            with release.all_gathered():
                result = original(*args, **kwargs)
                then()
                return result
        return call

    def whole_state_dict(exclude_frozen_parameters=False):
        return release.whole_state_dict(engine.module, exclude_frozen_parameters)

    rows_load = _own_optimizer_state_only(engine, load) if blocks else load
    for name, function, original in (("backward", backward_releasing, backward),
                                     ("save_checkpoint", gathered(save), save),
                                     ("load_checkpoint", gathered(rows_load, release.blocks_from_params), load),
                                     ("save_16bit_model", gathered(save_16bit), save_16bit),
                                     ("_zero3_consolidated_16bit_state_dict", whole_state_dict,
                                      engine._zero3_consolidated_16bit_state_dict)):
        function.__doc__ = original.__doc__
        wiring.patches.set(engine, name, function)
    # the frameworks' stage-3 saves (HF Trainer's save_model, Accelerate's get_state_dict) ask the engine whether it
    # gathers whole weights for a save: always, here (the engine runs stage 0, whose config says no)
    wiring.patches.set(engine, "zero_gather_16bit_weights_on_model_save", lambda: True)
    wiring.patches.set(wiring, "release", release)
    return release


def _own_optimizer_state_only(engine, load):
    """engine.load_checkpoint `load` without data-parallel rank 0's optimizer state (load_optimizer_states=False,
    and its 'optimizer' entry kept out of the client state returned): with row blocks the ranks' state shapes
    differ (uneven rows), and each rank's own file, read after it (wiring._wrap_checkpoints), holds its state."""
    signature = inspect.signature(internals.unwrapped(type(engine).load_checkpoint))

    def load_checkpoint(*args, **kwargs):
        bound = signature.bind(engine, *args, **kwargs)
        bound.arguments["load_optimizer_states"] = False
        path, client_state = load(*bound.args[1:], **bound.kwargs)
        return path, {key: value for key, value in client_state.items() if key != "optimizer"}
    return load_checkpoint


@contextlib.contextmanager
def gathered_weights(engine):
    """Inside the block every weight of a stage-3 engine's model is whole on every rank (for reading them:
    `engine.module.state_dict()` copies, evaluation code); released again after it. Call it on every rank.
    At stages 0-2 the weights are whole already: nothing to do."""
    release = getattr(engine_wiring(engine), "release", None)
    with release.all_gathered() if release is not None else contextlib.nullcontext():
        yield


def engine_wiring(engine):
    """The EngineWiring of a shardopt engine (None when it is not wired)."""
    optimizer = getattr(engine, "basic_optimizer", None)
    return engine_side(optimizer).wiring if optimizer is not None and hasattr(optimizer, "param_groups") else None


def whole_params(model: torch.nn.Module, model_parameters=None):
    """A model built under deepspeed.zero.Init made whole, before the optimizer's param groups read its shapes: each
    param that is one of zero.Init's partitions (`ds_id`; its `ds_tensor` is this rank's piece of the flattened
    weight, rank r holding elements [r·k, (r+1)·k), the last padded) is all-gathered over its `ds_process_group`
    (through the comm layer) and replaced in every module holding it by an ordinary Parameter of shape `ds_shape`,
    so a matrix is never read as zero.Init's 1-D placeholder. Returns `model_parameters` (tensors or param-group
    dicts) with the same replacements. Every rank holds the whole model until the engine is wired (then only what
    it owns: WeightRelease)."""
    replaced = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if hasattr(param, "ds_id"):
                replaced.setdefault(id(param), _gathered(param))
                setattr(module, name, replaced[id(param)])
    if model_parameters is None or not replaced:
        return model_parameters

    def swap(param):
        return replaced.get(id(param), param)
    return [{**item, "params": [swap(p) for p in item["params"]]} if isinstance(item, dict) else swap(item)
            for item in model_parameters]


@torch.no_grad()
def _gathered(param) -> torch.nn.Parameter:
    """The whole weight of one zero.Init partition (whole_params), as a new Parameter."""
    axis = Axis("node", getattr(param, "ds_process_group", None) or dist.group.WORLD)
    pieces = axis.all_gather(param.ds_tensor.reshape(-1))
    whole = pieces.reshape(-1)[:param.ds_numel].view(param.ds_shape).clone()
    return torch.nn.Parameter(whole, requires_grad=param.requires_grad)
