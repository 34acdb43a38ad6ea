"""The torch.optim surface of an optimizer around another one (LocalSteps around its inner optimizer).

`OptimizerAround` is a torch.optim.Optimizer (so `isinstance`, lr schedulers, DCP's get_state_dict /
set_state_dict and the step hooks take it) that holds no param groups of its own: `param_groups` is the
inner optimizer's list, read through at every access (a scheduler drives the inner lr; the inner
load_state_dict may replace the list), and `add_param_group`, `zero_grad` go to the inner one. Its
`state` is its own (LocalSteps: the outer state per param), a defaultdict(dict) as torch's.

torch.optim.Optimizer.__init__ would build param groups of its own from `params`; instead the base
class is set up through its pickle path, `Optimizer.__setstate__`, which (torch 2.6–2.13) creates the
step and state-dict hook registries that the public `register_step_pre_hook` / `register_step_post_hook`
/ `register_(load_)state_dict_*_hook` write to and wraps the class's `step` so the step hooks run
(`Optimizer._patch_step_function`). That is the one torch behaviour this relies on beyond the public API
(tests/test_local_steps.py and the lr-scheduler / DCP tests catch a change). The state-dict hooks are
registered but not run: the subclass's state_dict / load_state_dict are its own.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class OptimizerAround(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose param groups are `inner`'s (module docstring)."""

    def __init__(self, inner: torch.optim.Optimizer):
        torch.optim.Optimizer.__setstate__(self, {"defaults": dict(inner.defaults)})
        self.inner = inner
        self.defaults = inner.defaults   # the inner one's own dict (__setstate__ sets a default in its copy)
        self.state: defaultdict = defaultdict(dict)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups):   # torch.optim.Optimizer.__setstate__ and load paths assign it
        self.inner.param_groups = groups

    def params(self) -> list[torch.Tensor]:
        """The inner optimizer's params, in param order."""
        return [p for group in self.inner.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self.inner.add_param_group(param_group)

    @property
    def last_grad_norm(self):
        """The inner optimizer's agreed gradient norm of its last clipped step (None if it keeps none)."""
        return getattr(self.inner, "last_grad_norm", None)
