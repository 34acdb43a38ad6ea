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
| `ZeroPartition.weights` | the model's params: the all-gather after the step goes straight into them, in their dtype, and the owned slots' masters are copied into theirs (rounded as the wrapper's copy rounds them: bitwise the same weights) |
| wrapper `refresh_fp32_params` | the owned masters from their model params (DeepSpeed's would copy each master onto itself) |
| wrapper `load_state_dict` | the loss scale only: data-parallel rank 0's optimizer state and masters fit its own slots, not this rank's; each rank's own come from its files (wiring.py) |

Per rank: masters 4Φ → 4Φ/S, the gradients held at the step (4 + 2)Φ (the fp32 copies and the bf16 .grad) → 4Φ/S
(the fp32 node means only), the gather buffer fp32 → the params' dtype.
Undone by the wiring's detach(): the lists and methods put back, the dropped masters remade from the model's
params (widened to fp32: the exact fp32 values live on their owners only).
"""

from __future__ import annotations

import torch


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


def gradient_holders(wiring) -> list[torch.Tensor]:
    """Each slot's tensor whose .grad holds its gradient from backward to the step: the fp32 master of a slot this
    rank owns where `own_masters_only` applies (the node mean in fp32, the wrapper's step reads it as it is),
    else the model's param."""
    if not applies(wiring):
        return [lp for lp, _ in wiring.masters]
    zero = wiring.side.zero
    return [fp32 if zero.owns(slot) else lp for slot, (lp, fp32) in enumerate(wiring.masters)]
