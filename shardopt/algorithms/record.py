"""The record an optimizer algorithm is: everything the optimizer needs to run it, looked up by
name in registry.py (optax's (init, update) pair; torch.optim's functional core).

A record holds pure functions and data, no state: the optimizer owns the params, groups and state;
the plan (plan.py) chooses each bucket's exchange once; the step function does the math and the
collectives of one bucket (a generator, schedule.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Hyperparameter:
    """A param-group key: its default and its check(group, key, index), which raises ValueError
    naming the key, the group, the value and what is allowed (hyperparams.py has the checks)."""

    default: Any
    check: Callable[[dict, str, int], None]


@dataclass(frozen=True)
class Algorithm:
    """One algorithm of a param group's "algorithm" key.

    name: the key's value. matrix: True if it steps buckets of matrices (matrices.py), False if
        element-wise, on buckets of the group's entries (layout/buckets.py: `flat_buckets`).
    cuts_tensors: an element-wise algorithm whose buckets may end inside a tensor (every entry's math is
        its own: AdamW, Lion); False: buckets of whole tensors (1-bit Adam: its scales are per tensor).
    hyperparameters: key → Hyperparameter, the group keys it reads (besides "maximize").
    plan_keys: the keys whose values shape its plan (buckets, exchanges); a change re-plans.
    state_keys: the tensors of a param's state besides "step" (load_state_dict checks against them).
    init_state(param, group, seed) → dict of those tensors.
    state_shapes(param, group) → {key: (global shape, local shape)} of those tensors (checks.py).
    b_side_state: state keys whose rows are each matrix's b side (Dion's Q), not the param's.
    momentum: the hyperparameter that is its momentum (torch's `momentum` / AdamW's betas[0]) for the
        momentum-cycling lr schedulers (hyperparams.follow_momentum_schedule); "betas": betas[0].
    decoupled_momentum: the state key each replica keeps for itself (averaged by
        synchronize_for_checkpoint), or None when the replicas' state agrees already.
    work_ranks(layout, group, replicas) → how many ranks share a bucket's work (a bucket holds a
        multiple of it: buckets.py).
    exchange(group, layout, numel, replicas) → the exchange of a bucket (exchange.py) of `numel`
        local entries (layout None for an element-wise group: per dtype, for all its entries; each bucket
        takes it `starting_at` its first entry).
    describe_exchange(group) → a few words for describe().
    phases(group) → ((label, step), …): where the exchange changes with the step count (1-bit Adam's
        warm-up, then its 1-bit momentum), a step of each phase, whose bytes describe() reports;
        None: one phase.
    options(group) → the step's typed keyword arguments, read from the group at each step.
    step(params, grads, states, *, layout, exchange, axes, seed, **options): the bucket step, a
        generator of collectives (for an element-wise bucket: `exchanges`, its dtype → its exchange, no
        layout; its params are whole tensors or flat runs of their entries).
    """

    name: str
    matrix: bool
    hyperparameters: dict
    state_keys: tuple
    init_state: Callable
    state_shapes: Callable
    step: Callable
    options: Callable
    exchange: Callable
    describe_exchange: Callable
    plan_keys: tuple = ()
    b_side_state: tuple = ()
    decoupled_momentum: str | None = None
    momentum: str = "betas"
    cuts_tensors: bool = True
    work_ranks: Callable = field(default=lambda layout, group, replicas: 1)
    phases: Callable | None = None
