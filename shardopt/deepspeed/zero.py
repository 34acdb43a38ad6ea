"""ZeRO stages 1 and 2 done by shardopt, with the compressed exchange across nodes (docs/design.md §9).

The data-parallel ranks form a (replicate R, shard S) mesh; by default one replica per node
(S = LOCAL_WORLD_SIZE). Each parameter is owned, whole, by one rank of its node (the node axis):
`placement.assign_owners` balances the optimizer state per owner (elements × state tensors per element). Whole tensors, not row blocks, so that
the owner runs exactly the stage-0 math (Newton–Schulz and the power iteration need whole matrices;
row blocks would change Sign-Muon's direction or add a shard-axis exchange per step), as
microsoft/dion gives each rank whole matrices to orthogonalize (at stage 3 Dion's matrices and the
element-wise groups' params are split by rows over the node instead, `row_slots`: zero3.py). One optimizer step:

    g_node = (1/S)·Σ_node g_local      reduce-scatter over the node axis, full precision (fp32):
                                       each rank gets the node mean of the params it owns
    the optimizer step on owned params the compressed exchange over the replicate axis (the same
                                       owned params on every node), state only for owned params
    X                                  all-gather over the node axis: every rank's weights again

Stage 1 reduce-scatters at the step and keeps the full local gradient during accumulation. Stage 2
(`BackwardReducer`) sends each gradient to its owner as soon as backward has accumulated it, drops
it on the other ranks, and keeps only the owned gradients: at most `reduce_bucket_size` elements
of others' gradients are in flight. Stage 0 with a mesh: an all-reduce over the node axis, every
rank keeps all state. Per-rank state ≈ 1/S of stage 0's
(plus the imbalance of whole tensors); per-rank replicate bytes ≈ 1/S of stage 0's.
"""

from __future__ import annotations

import functools
import os
from collections import deque

import torch

from ..wire.comm import Axis, Pending
from ..layout.placement import assign_owners, chunk_rows


def mesh_shape(mesh: tuple[int, int] | None, stage: int, world: int) -> tuple[int, int] | None:
    """(R, S) from the config's mesh, or for stages 1/2 one replica per node (S = LOCAL_WORLD_SIZE);
    None at stage 0 without a mesh (every data-parallel rank is a replica)."""
    if mesh is None and stage == 0:
        return None
    if mesh is None:
        local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
        if not local:
            raise ValueError("ZeRO stage 1/2 with shardopt needs the ranks per node (LOCAL_WORLD_SIZE is not set by "
                             "this launcher); give \"shardopt\": {\"mesh\": {\"replicate\": R, \"shard\": S}}")
        shard = int(local)
        if world % shard:
            raise ValueError(f"LOCAL_WORLD_SIZE={shard} does not divide the world size {world}; give "
                             f"\"shardopt\": {{\"mesh\": {{\"replicate\": R, \"shard\": S}}}} with R·S = {world}")
        mesh = (world // shard, shard)
    return mesh


class ZeroPartition:
    """Which rank of the node owns each parameter (slot = position in the optimizer's param order),
    and the two node-axis collectives of a step. stage 0: every rank owns every slot."""

    def __init__(self, shapes: list[torch.Size], node: Axis, stage: int, costs: list[int] | None = None,
                 window_bytes: int | None = None, row_slots: tuple[int, ...] = ()):
        """costs: what each slot's optimizer state weighs (default: its element count), balanced over owners;
        window_bytes: the most bytes gather_weights receives per all-gather (None: all at once);
        row_slots: stage 3, the 2-D slots split by rows over the node (every rank owns its rows: owner None,
        `rows`: each one's rows per node rank, chunk_rows) instead of owned whole (zero3.py)."""
        self.node, self.stage, self.window_bytes = node, stage, window_bytes
        self.weights = None   # where gather_weights writes, when not the optimizer's params (masters.py)
        self.owned_weights_written = False   # the owned slots' `weights` written by the step (masters.PackedMasters)
        self.sizes = [int(torch.Size(shape).numel()) for shape in shapes]
        self.rows = {slot: chunk_rows(shapes[slot][0], node.size) for slot in row_slots}
        self.costs = costs or self.sizes
        whole = [0 if slot in self.rows else cost for slot, cost in enumerate(self.costs)]   # (rows: balanced already)
        self.owners = assign_owners(whole, node.size) if stage >= 1 else [node.rank] * len(shapes)
        for slot in self.rows:
            self.owners[slot] = None
        by_owner = [[i for i, owner in enumerate(self.owners) if owner == k] for k in range(node.size)]
        self.chunk = max(sum(self.sizes[i] for i in slots) for slots in by_owner) if stage >= 1 else sum(self.sizes)
        self.order = [i for slots in by_owner for i in slots] if stage >= 1 else list(range(len(shapes)))
        self.slots_of = by_owner   # stages 1/2: each owner's slots, in their order in its chunk
        self.offsets = {}
        for k, slots in enumerate(by_owner if stage >= 1 else [self.order]):
            offset = k * self.chunk
            for i in slots:
                self.offsets[i] = offset
                offset += self.sizes[i]

    def share(self, slot: int) -> float:
        """The part of the slot this rank steps: 1 or 0 (owned whole or not), its rows' part of a row slot."""
        return self.rows[slot][self.node.rank] / sum(self.rows[slot]) if slot in self.rows else float(self.owns(slot))

    def owns(self, slot: int) -> bool:
        """This rank steps the slot: it owns it whole, or its rows (row_slots)."""
        return slot in self.rows or self.owners[slot] == self.node.rank

    def reduce_to_owner(self, slot: int, gradient: torch.Tensor):
        """Start the node sum Σ_node of a slot's gradient towards what this rank steps (async): a reduce to its
        owner (wait() gives the sum on the owner), or for a row slot a reduce-scatter of its rows (wait() gives
        this rank's rows of the sum; the rows zero-padded to S·⌈m/S⌉, torch.chunk's split)."""
        if slot not in self.rows:
            return self.node.reduce(gradient, self.owners[slot], async_op=True)
        per_rank, size = self.rows[slot], self.node.size
        padded = gradient.new_zeros((size * per_rank[0], *gradient.shape[1:]))
        padded[:gradient.shape[0]].copy_(gradient)
        pending = self.node.reduce_scatter(padded, async_op=True)
        rows = per_rank[self.node.rank]
        return Pending(pending.work, lambda: pending.finish()[:rows])

    def _pack(self, tensors: list[torch.Tensor | None], slots, dtype, device) -> torch.Tensor:
        """A flat buffer (S·chunk at stages 1/2, all slots at stage 0); None tensors count as zeros."""
        flat = torch.zeros(self.chunk * (self.node.size if self.stage >= 1 else 1), dtype=dtype, device=device)
        for i in slots:
            if tensors[i] is not None:
                flat[self.offsets[i]:self.offsets[i] + self.sizes[i]].copy_(tensors[i].reshape(-1))
        return flat

    @torch.no_grad()
    def reduce_gradients(self, grads: list[torch.Tensor | None], params: list[torch.Tensor]) -> list:
        """The node mean (1/S)·Σ_node of each slot's local gradient (a None gradient counts as zeros),
        in fp32 (fp64 if a gradient is fp64), returned in each gradient's dtype for the slots this rank
        owns and as None for the others. Stage 0: an all-reduce; stages 1/2: a reduce-scatter."""
        present = [g for g in grads if g is not None]
        if not present:
            return [None] * len(grads)
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in present) else torch.float32
        flat = self._pack(grads, self.order, dtype, present[0].device)
        if self.stage >= 1:
            mine = self.node.reduce_scatter(flat.view(self.node.size, self.chunk))[0]
            base = self.node.rank * self.chunk
        else:
            mine, base = self.node.all_reduce(flat), 0
        mine.div_(self.node.size)
        out = []
        for i, (grad, param) in enumerate(zip(grads, params)):
            if not self.owns(i):
                out.append(None)
                continue
            start = self.offsets[i] - base
            out.append(mine[start:start + self.sizes[i]].view(param.shape).to((grad if grad is not None else param).dtype))
        return out

    @torch.no_grad()
    def gather_weights(self, params: list[torch.Tensor]) -> None:
        """Stages 1/2: every rank's params ← their owners' (all-gather over the node axis, in the
        params' widest dtype, so the copy is exact), `window_bytes` of the gathered rows at a time: the
        transient is ≤ (1 + 1/S)·window_bytes, not (1 + 1/S)·2Φ. With `weights` set (the model's params, whose
        masters this rank holds only where it owns them: masters.py) the other slots' gathered weights go there,
        in their dtype: the owners' params rounded to it as the fp16/bf16 wrapper's copy rounds them, and the
        owned slots' own params too (the wrapper's copy-back is a no-op there: masters.py), first, unless
        `owned_weights_written` (packed bf16 masters wrote them in the step); the all-gather sends those. Stage 3:
        only that copy of the owned slots (the others are gathered while their modules run: zero3.py)."""
        if self.stage == 0 or (self.node.size == 1 and self.weights is None):
            return
        targets = self.weights if self.weights is not None else params
        for i, param in enumerate(targets):
            if self.owns(i) and param is not params[i] and not self.owned_weights_written:
                param.copy_(params[i])
        if self.stage < 3:     # stage 3: the others are gathered while their modules run (zero3.py)
            self._all_gather_into(targets)

    def _all_gather_into(self, targets: list[torch.Tensor]) -> None:
        """targets' slots owned by the node's other ranks ← their owners' (gather_weights' all-gather,
        `window_bytes` of gathered rows at a time, in the widest dtype of targets)."""
        dtype = targets[0].dtype
        for param in targets:
            dtype = torch.promote_types(dtype, param.dtype)
        row_bytes = self.node.size * torch.empty((), dtype=dtype).element_size()
        window = self.chunk if self.window_bytes is None else max(1, self.window_bytes // row_bytes)
        for start in range(0, self.chunk, window):
            stop = min(self.chunk, start + window)
            piece = torch.zeros(stop - start, dtype=dtype, device=targets[0].device)
            for i, lo, hi, first in self._pieces(self.node.rank, start, stop):
                piece[lo - start:hi - start].copy_(targets[i].reshape(-1)[first:first + hi - lo])
            gathered = self.node.all_gather(piece)
            for owner in range(self.node.size):
                for i, lo, hi, first in self._pieces(owner, start, stop) if owner != self.node.rank else ():
                    targets[i].view(-1)[first:first + hi - lo].copy_(gathered[owner, lo - start:hi - start])

    def _pieces(self, owner: int, start: int, stop: int):
        """(slot, lo, hi, first) for each slot of `owner` within [start, stop) of its chunk: chunk positions
        [lo, hi) hold the slot's elements [first, first + hi − lo)."""
        for i in self.slots_of[owner]:
            begin = self.offsets[i] - owner * self.chunk
            lo, hi = max(begin, start), min(begin + self.sizes[i], stop)
            if lo < hi:
                yield i, lo, hi, lo - begin


class BackwardReducer:
    """ZeRO stage 2 during backward: when backward has accumulated a parameter's gradient (a
    post-accumulate-grad hook), the gradient (in fp32, fp64 if it is fp64) is reduced to its owner over
    the node axis (a row slot's reduce-scattered by rows: ZeroPartition.reduce_to_owner) and dropped on this
    rank unless it owns it (its rows); when more than `cap_elements` are in
    flight the oldest reduce is waited for, and every hook takes the reduces that have completed. Every
    rank runs the same backward graph, so the reduces are issued in the same order everywhere.

    One backward: `begin(kept, deliver)` (kept: each slot's gradient from earlier micro-batches, or None),
    then `end()` → each slot's gradient after it: g = kept + (1/S)·Σ_node g_local on the owned slots
    (kept alone, or None, on the others). deliver(param, g): with the exchange during backward, called
    as soon as an owned slot's reduce has completed, with the g `end()` will return for it (the same
    tensor, unless the slot is accumulated a second time in this backward, e.g. by reentrant checkpointing:
    then a new one, which the optimizer sees as changed).

    holders: the tensor each slot's g is for, in its dtype (default: the params); under fp16/bf16 the owned
    slots' fp32 master copies (masters.py): there the fp32 node mean is g itself, not a copy rounded to the param's."""

    def __init__(self, partition: ZeroPartition, params: list[torch.Tensor], cap_elements: int,
                 holders: list[torch.Tensor] | None = None):
        self.partition, self.params, self.cap = partition, params, int(cap_elements)
        self.holders = params if holders is None else holders
        self.active, self.pending, self.in_flight = False, deque(), 0
        self.kept, self.deliver, self.results, self.delivered, self.reduces = [], None, {}, {}, {}
        self.hooks = [param.register_post_accumulate_grad_hook(functools.partial(self._ready, slot))
                      for slot, param in enumerate(params)]   # handles: EngineWiring.detach removes them

    def begin(self, kept: list, deliver=None) -> None:
        self.active, self.kept, self.deliver = True, kept, deliver

    @torch.no_grad()
    def _ready(self, slot: int, param: torch.Tensor) -> None:
        if not self.active:
            return
        grad = param.grad
        buffer = grad.to(torch.float64 if grad.dtype == torch.float64 else torch.float32)
        param.grad = None
        self.pending.append((slot, buffer, self.partition.reduce_to_owner(slot, buffer)))
        self.in_flight += buffer.numel()
        while self.pending and (self.in_flight > self.cap or self.pending[0][2].done()):
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        slot, buffer, pending = self.pending.popleft()
        total = pending.wait()
        self.in_flight -= buffer.numel()
        if self.partition.owns(slot):   # a param may be accumulated twice (reentrant checkpointing): add
            mean = total.div_(self.partition.node.size)
            self.results[slot] = self.results[slot].add_(mean) if slot in self.results else mean
            self.reduces[slot] = self.reduces.get(slot, 0) + 1
            if self.deliver is not None and slot not in self.delivered:
                self.delivered[slot] = self._gradient(slot, in_place=False)   # kept stays as it is for end()
                self.deliver(self.params[slot], self.delivered[slot])

    def _gradient(self, slot: int, in_place: bool) -> torch.Tensor | None:
        """g of the class doc for `slot`, from what has completed so far (in_place: summed into kept)."""
        old, new = self.kept[slot], self.results.get(slot)
        holder = self.holders[slot]
        new = None if new is None else new.view(holder.shape).to(holder.dtype)
        if old is None or new is None:
            return new if old is None else old
        return old.add_(new) if in_place else old + new

    def end(self) -> list[torch.Tensor | None]:
        """Wait for the reduces in flight; each slot's gradient after this backward (the class doc)."""
        while self.pending:
            self._complete_oldest()
        grads = [self.delivered[slot] if self.reduces.get(slot) == 1 and slot in self.delivered
                 else self._gradient(slot, in_place=True) for slot in range(len(self.params))]
        self.active, self.kept, self.deliver, self.results, self.delivered, self.reduces = False, [], None, {}, {}, {}
        return grads
