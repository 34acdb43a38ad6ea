"""The outer state of one param (docs/design.md §10): a typed record, read as its state-dict entry.

Every tensor is this rank's piece, placed like the param (a DTensor where the param is one), in the
state dtype on the state device unless said otherwise:

    params         θ_outer, the params at the last sync
    momentum       b, the outer SGD momentum               (outer_momentum > 0)
    error          e, the error feedback                   (lossy formats)
    start          θ_start, θ when the exchange in flight began                        (overlap)
    pending_mean   Δ̄ of the finished exchange, waiting to be applied, fp32             (overlap)
    pending_error  e of it                                                             (overlap, lossy)
    pending        0-d int64 on the CPU: 0 nothing pending, 1 apply it, 2 discard it   (overlap)
    rounds         0-d int64 on the CPU: the syncs of this param so far
    Q              "lowrank"'s warm start (b_j × r, fp32) of a low-rank matrix

As a Mapping the record is `optimizer.state[param]` and the outer part of its state-dict entry: the keys
`outer_` + field name of the fields it holds (outer_params, outer_momentum, outer_error, outer_start,
outer_pending_mean, outer_pending_error, outer_pending, outer_rounds, outer_Q), in that order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from ..layout.placement import local, placed_like

PREFIX = "outer_"
ERROR_KEY = PREFIX + "error"   # e, a replica's own residual: a heal from a peer (torchft/heal.py) zeroes it
STATE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(eq=False)
class OuterState(Mapping):
    """One param's outer state (module docstring); None: a field this configuration does not keep."""

    params: torch.Tensor
    momentum: torch.Tensor | None = None
    error: torch.Tensor | None = None
    start: torch.Tensor | None = None
    pending_mean: torch.Tensor | None = None
    pending_error: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    rounds: torch.Tensor | None = None
    Q: torch.Tensor | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        value = getattr(self, key[len(PREFIX):], None) if key.startswith(PREFIX) else None
        if not isinstance(value, torch.Tensor):
            raise KeyError(key)
        return value

    def __iter__(self):
        return (PREFIX + field.name for field in fields(self) if getattr(self, field.name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def state_like(param: torch.Tensor, dtype: torch.dtype, device, fill=None) -> torch.Tensor:
    """A copy of the param's local tensor (fill=0: zeros) in `dtype` on `device`, placed like the param."""
    piece = local(param).detach()
    piece = torch.zeros_like(piece, dtype=dtype, device=device) if fill == 0 else \
        piece.to(dtype=dtype, device=device, copy=True)
    return placed_like(param, piece)


def new_outer_state(param: torch.Tensor, *, dtype: torch.dtype, device, momentum: bool, lossy: bool,
                    overlap: bool, Q: torch.Tensor | None = None) -> OuterState:
    """θ_outer = θ, b = 0, e = 0, θ_start = θ, nothing pending, no rounds yet; device None: the param's."""
    device = device or local(param).device
    return OuterState(
        params=state_like(param, dtype, device),
        momentum=state_like(param, dtype, device, fill=0) if momentum else None,
        error=state_like(param, dtype, device, fill=0) if lossy else None,
        start=state_like(param, dtype, device) if overlap else None,
        pending_mean=state_like(param, torch.float32, device, fill=0) if overlap else None,
        pending_error=state_like(param, dtype, device, fill=0) if overlap and lossy else None,
        pending=torch.zeros((), dtype=torch.int64) if overlap else None,
        rounds=torch.zeros((), dtype=torch.int64), Q=Q)


# ---- the state-dict boundary ------------------------------------------------------------------------
def with_outer_state(inner: dict, params: list, states, steps: int) -> dict:
    """The inner optimizer's state dict `inner` (torch.optim's format) with each param's outer state added
    to its entry (the record's outer_* keys) and the step count `outer_steps` beside it (and beside param
    0, also where this rank keeps no outer state: ZeRO's owners). torch's entries are live state."""
    for index, param in enumerate(params):
        outer = dict(states.get(param, {}))
        if outer or index == 0:
            outer["outer_steps"] = torch.tensor(steps, dtype=torch.int64)
        inner["state"][index] = {**inner["state"].get(index, {}), **outer}
    return inner


def split_state_dict(state_dict: dict, synced: set[int]) -> tuple[dict, dict]:
    """(inner entries by the state's keys, outer_* entries by slot) of a `with_outer_state` dict; the outer
    keys of params outside `synced` (slots this rank keeps no outer state for) are left out, outer_steps
    kept. The state's keys are what the groups' "params" list (indices; DCP's set_state_dict gives FQNs),
    in param order, as torch.optim.Optimizer.load_state_dict maps them."""
    position = {key: i for i, key in enumerate(key for group in state_dict["param_groups"] for key in group["params"])}
    inner, outer = {}, {}
    for key, entry in state_dict["state"].items():
        inner[key] = {k: v for k, v in entry.items() if not k.startswith(PREFIX)}
        outer[position[key]] = {k: v for k, v in entry.items()
                                if k.startswith(PREFIX) and (k == "outer_steps" or position[key] in synced)}
    return inner, outer


def load_outer_state(params: list, states, outer: dict, settings: str) -> int | None:
    """Copy `split_state_dict`'s outer entries into the records of `states` (made already, in this
    optimizer's dtypes and devices); returns outer_steps (None if absent). ValueError for a key the record
    does not keep (`settings`: the optimizer's, for the message)."""
    steps = None
    for index, param in enumerate(params):
        for key, value in outer.get(index, {}).items():
            if key == "outer_steps":
                steps = int(value)
            elif key not in states[param]:
                raise ValueError(f"state_dict holds {key!r} for param #{index}, which this LocalSteps does not "
                                 f"keep ({settings}); build LocalSteps with the checkpoint's settings")
            else:
                local(states[param][key]).copy_(local(value))
    return steps
