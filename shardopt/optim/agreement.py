"""What every rank must agree on, so that every rank takes the same branch and issues the same
collectives: at construction, that the ranks hold the same params and settings; before each step,
whether a gradient is non-finite anywhere (skip or raise), which params have a gradient somewhere,
and (at scheduled steps) that nobody averaged the gradients already (guard.py). Nothing here
changes optimizer state: a step that does not pass changes nothing.

Host syncs (reads of a device value; each waits for the device): one per step, the agreed flag
together with this rank's per-param non-finite bits (`agreed_flag`), since whether the step runs
decides which kernels and collectives are queued at all. A second only where a further decision
needs one: on a step where some rank lacks a gradient, which params step (`has_grad`, exchanged only
then); at the double-averaging check's scheduled steps, its verdict (guard.py: it must raise before
the step sends anything else).
"""

from __future__ import annotations

import logging
import zlib
from typing import NamedTuple

import torch

from .checks import check_gradients
from ..wire.comm import Axis
from .guard import check_not_double_averaged
from ..layout.placement import local

logger = logging.getLogger("shardopt")


def check_ranks_agree(labeled_params, groups: list[dict], settings: dict, axes, timeout_s: float) -> None:
    """Every rank of each axis must hold the same parameters (shapes, dtypes, placements) and
    settings (`settings`: name → int); otherwise the first collective of a step would hang. One
    small all-gather per axis, on the params' device; ValueError on every rank naming what differs
    (or, on NCCL, two ranks on one GPU: comm.Axis.agree)."""
    description = [f"{label}|{tuple(p.shape)}|{p.dtype}|{getattr(p, 'placements', None)}" for p, label in labeled_params]
    group_settings = [repr(sorted((k, v) for k, v in g.items() if k not in ("params", "lr"))) for g in groups]
    fields = {"number of params": len(description),
              "param shapes/dtypes/placements": zlib.crc32("\n".join(description).encode()),
              "group settings": zlib.crc32("\n".join(group_settings).encode()), **settings}
    shown_values = ("number of params", *settings)
    device = next((local(p).device for p, _ in labeled_params), None)   # where the exchange goes (NCCL: the GPU)
    for axis in axes:
        per_rank = axis.agree(list(fields.values()), timeout_s, device)
        for position, field in enumerate(fields):
            values = [row[position] for row in per_rank]
            if len(set(values)) > 1:
                shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)) if field in shown_values \
                    else ", ".join(f"rank {r}: {'same as rank 0' if v == values[0] else 'different'}"
                                   for r, v in enumerate(values))
                raise ValueError(f"ranks of the {axis.name} axis disagree on the {field} ({shown}); every rank "
                                 f"must build the optimizer from the same model and arguments")


def agreed_flag(grads: list[torch.Tensor], missing: bool, axes, device) -> tuple[int, list[bool]]:
    """(flag, this rank's non-finite grads): flag = max over all ranks of `axes` of 2 if the rank's
    `grads` hold a NaN/inf (or a norm that overflows its dtype), else 1 if `missing` (the rank lacks a
    gradient some param may have elsewhere), else 0; and per grad of `grads` whether its norm is
    non-finite here. One all-reduce of one float per axis; both read back in one device sync."""
    if grads:
        bad = ~torch.isfinite(torch.stack(torch._foreach_norm(grads)).float())
        flag = torch.where(bad.any(), 2.0, float(missing)).reshape(1)
    else:
        bad, flag = torch.zeros(0, dtype=torch.bool, device=device), torch.full((1,), float(missing), device=device)
    for axis in axes:
        axis.all_reduce(flag, "max")
    values = torch.cat([flag, bad.float()]).tolist()
    return int(values[0]), [value > 0 for value in values[1:]]


def gradient_flag(grads: list[torch.Tensor], missing: bool, axes, device) -> int:
    """The flag of `agreed_flag` alone (one all-reduce of one float per axis, one device sync)."""
    return agreed_flag(grads, missing, axes, device)[0]


def double_averaging_checked(step: int, every: int) -> bool:
    """Whether step `step` (1, 2, …) runs the double-averaging check: steps 1, 1+every, 1+2·every, …
    (never with every = 0)."""
    return every > 0 and (step - 1) % every == 0


class StepDecision(NamedTuple):
    """What every rank agreed before a step: `params`, the params that step (None: skipped for a
    non-finite gradient); `stale`, whether some rank's exchange during backward read gradients or
    settings that changed before step() (docs/design.md §12), so that work is not what this step
    computes."""

    params: set | None
    stale: bool = False


class StepAgreement:
    """The pre-step agreement of one optimizer, with its counters.

    nonfinite: "skip" (the step is skipped on every rank, `skipped_steps` counts it, a warning is
    logged) or "raise" (FloatingPointError on every rank). double_averaging_check_every: the
    guard's schedule (steps 1, 1+N, …; 0 never); `steps_called` counts the steps it has seen."""

    def __init__(self, nonfinite: str, double_averaging_check_every: int):
        self.nonfinite = nonfinite
        self.double_averaging_check_every = double_averaging_check_every
        self.steps_called = 0   # steps the double-averaging schedule counted (not raises, not zero-gradient steps)
        self.skipped_steps = 0
        self.warned_no_gradients = False

    def stepping(self, params: list, labels: dict, replicate: Axis, param_axes, agreement_axes, device,
                 stale: bool | None = None) -> StepDecision:
        """Of `params` (in param-group order), those every rank steps now (a gradient on some rank of
        `param_axes`, the axes whose ranks hold the same params), or None when the step is skipped
        for a non-finite gradient. labels: param → its name. `agreement_axes`: where the branch is agreed.
        stale: with the exchange during backward, whether this rank's started work is stale (agreed as
        one more byte beside the params' has-gradient bytes, sent only when some rank lacks a gradient
        or is stale); None without it."""
        check_gradients(labels.items())
        if device.type == "meta":   # meta tensors hold no values: nothing to agree on, nothing to read back
            return StepDecision({p for p in params if p.grad is not None})
        self._check_not_double_averaged(params, replicate, agreement_axes, device)
        with_grad = [p for p in params if p.grad is not None]
        flag, bad = agreed_flag([local(p.grad) for p in with_grad], len(with_grad) < len(params) or bool(stale),
                                agreement_axes, device)
        if flag == 2:
            self._report_nonfinite([labels[p] for p, nonfinite in zip(with_grad, bad) if nonfinite])
            return StepDecision(None)
        if flag == 0:
            return StepDecision(set(params))
        extra = [bool(stale)] if stale is not None else []
        has_grad = torch.tensor([p.grad is not None for p in params] + extra, dtype=torch.uint8, device=device)
        for axis in param_axes:                     # (a further agreement axis, e.g. ZeRO's node, may own others)
            axis.all_reduce(has_grad, "max")
        anywhere = has_grad.tolist()
        stepping = {p for p, has in zip(params, anywhere) if has}
        if not stepping and not self.warned_no_gradients:
            self.warned_no_gradients = True
            logger.warning("shardopt: no parameter has a gradient on any rank, so this step changed nothing "
                           "(said once). Under FSDP2 HSDP, set_requires_all_reduce(False) on a 2-D mesh keeps the "
                           "gradients inside FSDP2: shard with fully_shard(model, mesh=mesh['shard']) and pass "
                           "replicate_mesh=mesh['replicate'] (docs/design.md §9)")
        return StepDecision(stepping, bool(extra and anywhere[-1]))

    def save_counters(self) -> dict:
        """The double-averaging schedule's count, which a healed replica copies (wire/rounds.HealCounters)."""
        return {"steps_called": self.steps_called}

    def load_counters(self, counters: dict) -> None:
        self.steps_called = int(counters["steps_called"])

    def _check_not_double_averaged(self, params, replicate: Axis, agreement_axes, device) -> None:
        """At the scheduled steps (with more than one replica), raise DoubleAveragingError on every
        rank alike when the replicas' local gradients are bitwise identical (guard.py). Raising, or
        finding zero/absent gradients everywhere (no evidence: e.g. torch.distributed.checkpoint's
        state initialization), leaves the count as it was, so the next step is checked again."""
        step = self.steps_called + 1
        if replicate.size > 1 and double_averaging_checked(step, self.double_averaging_check_every):
            grads = [local(p.grad) for p in params if p.grad is not None]
            others = [axis for axis in agreement_axes if axis is not replicate]
            if not check_not_double_averaged(grads, replicate, others, device, step):
                return
        self.steps_called = step

    def _report_nonfinite(self, local_bad: list[str]) -> None:
        """Raise (nonfinite="raise") or count and log a skipped step, naming this rank's bad params
        (`local_bad`, their labels: a NaN/inf or an overflowing norm; none: another rank's)."""
        where = f"this rank's params {', '.join(local_bad[:5])}" if local_bad else "another rank"
        if self.nonfinite == "raise":
            raise FloatingPointError(f"non-finite gradient (NaN/inf) in {where}; no state was changed "
                                     f"(nonfinite='raise'; use nonfinite='skip' to skip such steps)")
        self.skipped_steps += 1
        logger.warning("shardopt: skipped a step with a non-finite gradient in %s (%d skipped so far)", where,
                       self.skipped_steps)
