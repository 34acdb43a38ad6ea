"""fp16 AMP: torch's GradScaler over replicas whose gradients stay local (docs/design.md §7, §11).

A GradScaler judges the overflow of its own rank's gradients. With the replicas' gradients local
(shardopt exchanges them itself), an inf on one replica would make that replica's scaler skip
`optimizer.step()` while the others step: their collectives then pair across different steps (a hang
on NCCL) and their loss scales drift apart. So shardopt's optimizers set `_step_supports_amp_scaling`:
`GradScaler.step` then always calls `optimizer.step(grad_scaler=scaler)` (torch's contract for
optimizers with their own scale handling), and `agreed_to_step` below

1. unscales the gradients, unless the caller did already (`scaler.unscale_(optimizer)`, e.g. before
   clipping): the same kernel and factor as the scaler's own step, so the values are bitwise its;
2. all-reduces the scaler's found-inf (max) over the optimizer's agreement axes and writes the agreed
   value back into the scaler's per-device found-inf, so `scaler.update()` backs off or grows the scale
   alike on every rank and the scales stay equal;
3. skips the step on every rank when any rank overflowed (whatever `nonfinite` says: skipping is the
   scaler's contract), counting it in `skipped_steps`; with overlap_backward the work started during
   backward is run to its end and dropped (`discard_backward_work`), so every rank's collectives match.
   That work read the scaled gradients, and torch's unscaling kernel leaves their version counters as they
   were: the counters are bumped here, so the round counts as stale and the step runs again (docs §12).

Cost under a scaler: one all-reduce of one float per agreement axis and one device sync per step (the
scaler's own `_maybe_opt_step` reads its found-inf back too). torch warns once per call site that the
`grad_scaler` keyword is deprecated; its replacement (`optimizer.found_inf`, a sum made fresh per
step) cannot carry the agreed value back to `scaler.update()`. The scaler's per-optimizer state is a
torch private, read through shardopt/internals.py.
"""

from __future__ import annotations

import logging

import torch

from .. import internals
from ..layout.placement import local

logger = logging.getLogger("shardopt")


def agreed_to_step(optimizer, scaler) -> bool:
    """Unscale `optimizer`'s gradients if `scaler` has not, agree its found-inf over
    `optimizer.agreement_axes()` (written back into the scaler) and return whether every rank steps.
    True at once without a scaler; RuntimeError when a GradScaler stepped the optimizer through a wrapper
    whose signature hides step's `grad_scaler` keyword (torch then sets `optimizer.found_inf`, a fresh sum
    that cannot carry the agreed value back to `scaler.update()`)."""
    if scaler is None:
        if optimizer.__dict__.get("found_inf") is not None:
            raise RuntimeError(
                "shardopt: a GradScaler stepped this optimizer through a wrapper whose step() hides the grad_scaler "
                "keyword, so the replicas cannot agree on its overflow (their steps and loss scales would drift "
                "apart). Call scaler.step(optimizer) on the shardopt optimizer itself; under Accelerate call "
                "shardopt.accelerate.attach(accelerator, model, optimizer) after accelerator.prepare")
        return True
    state = internals.grad_scaler_state(scaler, optimizer)
    if internals.grad_scaler_ready(state):
        scaler.unscale_(optimizer)
    if optimizer.backward_overlap is not None:   # its round read the scaled gradients: stale, the step reruns
        torch.autograd.graph.increment_version([local(p.grad) for group in optimizer.param_groups
                                                for p in group["params"] if p.grad is not None])
    found = list(state["found_inf_per_device"].values())
    device = optimizer._device()
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    for found_inf in found:
        flag += found_inf.to(device=device, dtype=torch.float32).reshape(1)
    flag.clamp_(max=1.0)
    for axis in optimizer.agreement_axes():
        axis.all_reduce(flag, "max")
    for found_inf in found:
        found_inf.copy_(flag.reshape(found_inf.shape).to(found_inf.device))
    if not flag.item():   # the decision of which kernels and collectives run: one device sync
        return True
    optimizer.agreement.skipped_steps += 1
    logger.info("shardopt: GradScaler found an inf/NaN gradient on some rank: every rank skips this step "
                "(%d skipped so far)", optimizer.agreement.skipped_steps)
    optimizer.discard_backward_work()
    return False



def hand_over_scaler(accelerated, shardopt) -> None:
    """Under Accelerate's fp16 (an AcceleratedOptimizer `accelerated` with a GradScaler; Accelerate, HF Trainer):
    give its patched step, which GradScaler.step calls, the `grad_scaler` keyword in its signature, so the scaler
    hands itself to `shardopt`'s step; a step every rank skipped then reads as Accelerate's overflow
    (`step_was_skipped`, alike on every rank). Accelerate privates (accelerate 1.16): AcceleratedOptimizer.
    _optimizer_patched_step_method, ._accelerate_step_called. Nothing without a scaler."""
    if getattr(accelerated, "scaler", None) is None or not hasattr(accelerated, "_optimizer_patched_step_method"):
        return
    patched = accelerated._optimizer_patched_step_method

    def step(closure=None, grad_scaler=None):
        skipped = shardopt.skipped_steps
        result = patched(closure, grad_scaler=grad_scaler) if grad_scaler is not None else patched(closure)
        if shardopt.skipped_steps > skipped:
            accelerated._accelerate_step_called = False
        return result
    accelerated._optimizer_patched_step_method = step
