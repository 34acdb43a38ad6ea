"""fp32 master copies only for the slots a rank owns (ZeRO 2 under fp16/bf16; issue 43, docs/design.md §9).

DeepSpeed's fp16/bf16 wrapper (FP16_UnfusedOptimizer, which DeepSpeed builds at the stage 0 it is given)
keeps an fp32 master copy of every param, makes an fp32 gradient for each in its step (zeros where the
param has none) and copies every master back into its param after the step. At ZeRO 2 a rank steps only
the params it owns, so `own_masters_only` changes, each recorded in the wiring's Patches:

| object | change |
|---|---|
| wrapper `fp32_groups` | the owned masters only: its step unscales their gradients, nothing for the others |
| wrapper `fp16_groups` | the owned masters too, in place of their model params: the node mean that backward reduces to this rank is the master's fp32 gradient itself (`gradient_holders`, zero.BackwardReducer), which the step's `fp16.grad.to(fp32)` leaves as it is (no bf16 copy beside it); its copy back into `fp16_groups` is a no-op |
| the masters of other ranks' slots | their storage dropped (0 elements; the optimizer keeps them as slots without gradient) |
| `ZeroPartition.weights` | the model's params: the all-gather after the step goes straight into them, in their dtype, and the owned slots' masters are copied into theirs (rounded as the wrapper's copy rounds them: bitwise the same weights; bf16: written by the packing instead, `owned_weights_written`) |
| wrapper `refresh_fp32_params` | the owned masters from their model params (DeepSpeed's would copy each master onto itself) |
| wrapper `load_state_dict` | the loss scale only: data-parallel rank 0's optimizer state and masters fit its own slots, not this rank's; each rank's own come from its files (wiring.py) |

Under bf16 (not fp16, whose weights are no prefix of the fp32 bits; not with overlap_backward, whose scratch
copies read the masters during backward) `PackedMasters` goes further: between steps an owned master is kept as its
low 16 bits and one bit per entry beside the model's bf16 weight (packing.py), and rebuilt exactly, bucket by bucket,
for the step (the optimizer's `param_residency`), for a checkpoint and for `refresh_fp32_params`:

| between steps, per owned entry | fp16, or bf16 with overlap_backward | bf16 |
|---|---|---|
| fp32 master | 4 B | 2 + 1/8 B (low 16 bits, rounding bit); the master a placeholder of its shape (one element) |
| fp32 gradient (node mean) | 4 B | 4 B |
| rebuilt during the step | – | the masters of the buckets in flight (pipeline_depth of them) |

Per rank: masters 4Φ → 4Φ/S (bf16: (2 + 1/8)Φ/S), the gradients held at the step (4 + 2)Φ (the fp32 copies and the
bf16 .grad) → 4Φ/S (the fp32 node means only), the gather buffer fp32 → the params' dtype.
Undone by the wiring's detach(): the lists and methods put back, the packed masters rebuilt, the dropped masters
remade from the model's params (widened to fp32: the exact fp32 values live on their owners only).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

from ..optim.plan import unit_params
from .packing import join_master, split_master


def applies(wiring) -> bool:
    """Under fp16/bf16 at ZeRO 2 and 3 (not under local steps, whose outer state and checkpoints hold every master)."""
    zero = wiring.side.zero
    return wiring.wrapper is not None and zero is not None and zero.stage >= 2 and not wiring.local_steps


def own_masters_only(wiring) -> None:
    """Apply the module doc's changes to `wiring` (an EngineWiring whose masters are paired already)."""
    wrapper, zero, patches = wiring.wrapper, wiring.side.zero, wiring.patches
    owned = {id(fp32) for slot, (_, fp32) in enumerate(wiring.masters) if zero.owns(slot)}
    if len(wiring.masters) != len(zero.sizes):
        raise RuntimeError(f"the fp16/bf16 wrapper holds {len(wiring.masters)} master copies and the ZeRO partition "
                           f"{len(zero.sizes)} slots: some params do not require gradients; train them all, or use "
                           f"ZeRO stage 0")
    for name in ("fp16_groups", "fp32_groups"):
        patches.set(wrapper, name, [[fp32 for fp32 in high if id(fp32) in owned] for high in wrapper.fp32_groups])
    patches.set(zero, "weights", [lp for lp, _ in wiring.masters])
    owned_pairs = [(lp, fp32) for lp, fp32 in wiring.masters if id(fp32) in owned]

    @torch.no_grad()
    def refresh_fp32_params():
        with all_present(wiring):
            for lp, fp32 in owned_pairs:
                fp32.copy_(lp)

    patches.set(wrapper, "refresh_fp32_params", refresh_fp32_params)
    load_state_dict = wrapper.load_state_dict

    def load_without_masters(state_dict, load_optimizer_states=True):   # (the engine passes it by keyword)
        return load_state_dict({**state_dict, "fp32_groups": []}, load_optimizer_states=False)

    load_without_masters.__doc__ = load_state_dict.__doc__
    patches.set(wrapper, "load_state_dict", load_without_masters)
    dropped = [(lp, fp32) for lp, fp32 in wiring.masters if id(fp32) not in owned]
    empty = torch.empty(0, dtype=torch.float32, device=wiring.masters[0][1].device if wiring.masters else "cpu")
    for _, fp32 in dropped:
        fp32.grad = None
        fp32.data = empty

    def remake():
        with torch.no_grad():
            for lp, fp32 in dropped:
                fp32.data = lp.detach().to(torch.float32, copy=True)

    patches.on_undo(remake)
    if all(lp.dtype == torch.bfloat16 for lp, _ in owned_pairs) and not wiring.side.overlap_backward:
        packed = PackedMasters(owned_pairs)
        patches.set(wiring.side, "param_residency", packed)
        patches.on_undo(packed.unpack_all)
        patches.set(zero, "owned_weights_written", True)   # packing writes them: PackedMasters.pack


def gradient_holders(wiring) -> list[torch.Tensor]:
    """Each slot's tensor whose .grad holds its gradient from backward to the step: the fp32 master of a slot this
    rank owns where `own_masters_only` applies (the node mean in fp32, the wrapper's step reads it as it is),
    else the model's param."""
    if not applies(wiring):
        return [lp for lp, _ in wiring.masters]
    zero = wiring.side.zero
    return [fp32 if zero.owns(slot) else lp for slot, (lp, fp32) in enumerate(wiring.masters)]


def all_present(wiring):
    """`with all_present(wiring):` the owned fp32 masters whole inside (PackedMasters.unpacked), or nothing to do."""
    packed = wiring.side.param_residency
    return packed.unpacked() if packed is not None else contextlib.nullcontext()


class PackedMasters:
    """The owned slots' fp32 masters under bf16 (module doc), kept between steps as packing.split_master's
    (low, rounded_up) beside their model weights. A packed master's `.data` is a placeholder of its shape (one
    element, expanded: an in-place write to it raises) and its `.grad` stays what backward left.

    pairs: (model weight bf16, fp32 master) of every owned slot, whose weights are RNE(master): packed here."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        self.weight_of = {fp32: lp for lp, fp32 in pairs}
        self.packed: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        for _, fp32 in pairs:
            self.pack(fp32)

    @torch.no_grad()
    def pack(self, master: torch.Tensor) -> None:
        """weight ← RNE(master) (as the wrapper's copy rounds it: zero.ZeroPartition.owned_weights_written),
        (low, rounded_up) kept, the master's storage released."""
        self.packed[master] = split_master(master, self.weight_of[master])
        master.data = torch.zeros((), dtype=master.dtype, device=master.device).expand(master.shape)

    @torch.no_grad()
    def unpack(self, master: torch.Tensor) -> None:
        """The master rebuilt exactly from its weight and what `pack` kept (nothing to do where it is not packed)."""
        if master in self.packed:
            master.data = join_master(self.weight_of[master], *self.packed.pop(master))

    def unpack_all(self) -> None:
        for master in list(self.packed):
            self.unpack(master)

    @contextlib.contextmanager
    def unpacked(self):
        """Every master whole inside (a checkpoint, refresh_fp32_params), packed again after (its weight ← RNE)."""
        self.unpack_all()
        try:
            yield
        finally:
            for master in self.weight_of:
                self.pack(master)

    def around(self, units: list, steps):
        """`steps` (the step generators of `units`, steps.bucket_steps), each drawn after its unit's masters are
        rebuilt, each master packed again when the last unit reading it has finished: only the buckets in flight
        hold fp32 masters."""
        reading = [[p for p in unit_params(*unit[-2:]) if p in self.weight_of] for unit in units]
        readers = Counter(p for params in reading for p in params)
        steps = iter(steps)
        for params in reading:
            for master in params:
                self.unpack(master)
            yield self._packing_after(next(steps), params, readers)

    def _packing_after(self, step, params: list, readers: Counter):
        """`step` as it is, then the masters no later unit reads packed."""
        result = yield from step
        for master in params:
            readers[master] -= 1
            if not readers[master]:
                self.pack(master)
        return result
