"""Per-step optimizers over a torchft manager (FT-HSDP, docs/design.md §13): one round per step.

A step's round opens in a step pre-hook (the quorum) and closes in a post-hook (agreed should_commit).
Rollback by snapshot: before the step, a copy of the local pieces of every param and every state tensor
(and which params had no state yet); a step that is not committed, or one in which some replica heals
(its gradient was taken on the params it had before healing, so the round is skipped everywhere), is
undone by copying the snapshot back. Memory: one copy of the params and of the optimizer state while a
step runs (Sign-Muon fp32: 8 B per param element, Dion: 4 B + Q), freed after the step.
"""

from __future__ import annotations

import torch

from ..layout.placement import local


class RoundKeeper:
    """The step hooks of one per-step optimizer, a ShardOptimizer (module docstring): its params, its state and
    its StepAgreement's counters are what a discarded round puts back."""

    def __init__(self, axis, optimizer):
        self.axis, self.optimizer, self.snapshot = axis, optimizer, None
        self.committed = self.discarded = 0
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)

    def _params(self) -> list:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @torch.no_grad()
    def _before(self, optimizer, args, kwargs) -> None:
        self.axis.begin_round()
        self.snapshot = ({p: local(p).clone() for p in self._params()},
                         {p: {key: local(value).clone() if isinstance(value, torch.Tensor) else value
                              for key, value in optimizer.state[p].items()} for p in list(optimizer.state)},
                         (optimizer.agreement.steps_called, optimizer.agreement.skipped_steps))

    @torch.no_grad()
    def _after(self, optimizer, args, kwargs) -> None:
        if self.axis.end_round(not self.axis.heal_round):
            self.committed += 1
        else:
            self.discarded += 1
            self._restore()
        self.snapshot = None

    def _restore(self) -> None:
        params, states, counters = self.snapshot
        for param, saved in params.items():
            local(param).copy_(saved)
        for param in list(self.optimizer.state):
            if param not in states:
                del self.optimizer.state[param]
        for param, saved in states.items():
            state = self.optimizer.state[param]
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and key in state:
                    local(state[key]).copy_(value)
                else:
                    state[key] = value
        self.optimizer.agreement.steps_called, self.optimizer.agreement.skipped_steps = counters
