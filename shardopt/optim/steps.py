"""The bucket steps of a ShardOptimizer's step, on the optimizer's param groups, plans and state.

`bucket_steps` gives the units of the groups' plans for the params that step, in backward order
(plan.Plans.stepping_units), and one step generator per unit, made lazily (plan.unit_steps), reading and
writing where the caller says: `run_in_place` runs them pipelined (schedule.pipeline) on the params and
their state, after making the state of a param that steps the first time (`new_state`) and counting the
step; the exchange during backward (overlap/backward.py) runs the same generators into scratch.
"""

from __future__ import annotations

import functools

import torch

from ..algorithms import registry
from ..layout.placement import local
from ..wire.seeds import mix_seed
from .plan import unit_steps
from .schedule import pipeline


def param_seed(optimizer, param) -> int:
    """The param's seed: the optimizer's seed mixed with the param's index (equal on every rank)."""
    return mix_seed(optimizer.seed, optimizer._param_index[param])


def new_state(optimizer, param) -> dict:
    """A param's initial state (its record's, and a float32 step counter at 0, whatever the default dtype)."""
    index, group = next((i, g) for i, g in enumerate(optimizer.param_groups) if any(p is param for p in g["params"]))
    state = registry.algorithm(group["algorithm"], index).init_state(param, group, param_seed(optimizer, param))
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    return state


def bucket_steps(optimizer, stepping: set, read_param, read_state, delivered: dict | None = None) -> tuple:
    """(units, their step generators) of the params in `stepping`: read_param / read_state: where a param's
    tensor and state are read and written; delivered: gradients handed over before they are `.grad`
    (round.Round.arrive); the collectives go on the optimizer's `bucket_step_axes`."""
    units = optimizer._plans.stepping_units(optimizer.param_groups, stepping, optimizer.replicate.size,
                                            optimizer.bucket_bytes, functools.partial(param_seed, optimizer),
                                            optimizer._param_index.__getitem__)
    return units, unit_steps(optimizer.param_groups, units, read_param, read_state, optimizer.bucket_step_axes,
                             delivered)


def run_in_place(optimizer, stepping: set) -> None:
    """The step of the params in `stepping`, each unit writing its params and state in place. An optimizer whose
    params live elsewhere between steps has a `param_residency` (not None: DeepSpeed's packed bf16 masters,
    deepspeed/masters.py): its `around(units, steps)` makes each unit's params present while it steps."""
    for param in [p for group in optimizer.param_groups for p in group["params"] if p in stepping]:
        state = optimizer.state[param]     # every param gets state, also one with no local matrix
        if not state:
            state.update(new_state(optimizer, param))
        state["step"] += 1
    units, steps = bucket_steps(optimizer, stepping, local,
                                lambda p: {key: local(value) for key, value in optimizer.state[p].items()})
    residency = getattr(optimizer, "param_residency", None)
    if residency is not None:
        steps = residency.around(units, steps)
    pipeline(steps, depth=optimizer.pipeline_depth)
