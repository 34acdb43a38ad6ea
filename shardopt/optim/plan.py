"""The plan of a param group: its buckets and the exchange of each, chosen once, not every step.

A matrix group's params are cut into buckets of same-layout matrices (buckets.py) and each bucket
gets its exchange from its algorithm's record (`Algorithm.exchange`: Dion's factor mean or
fallback, a vote format, a mean) for its size at this replica count. An element-wise group gets one
exchange per dtype. The plan depends on the group's params, its `plan_keys` values and the replica
count; `Plans` keeps one per group and makes a new one when any of them changes (a scheduler that
cycles momentum does not re-plan; a new `vote` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layout.buckets import capped_buckets
from ..wire.exchange import by_dtype
from ..layout.matrices import ParamMatrix, matrix_seed
from ..layout.placement import MatrixLayout, local


@dataclass(frozen=True)
class Bucket:
    """Same-layout matrices stepped together: entry i is matrix `matrices[i]` of `params[i]` (a
    param repeats for each of its matrices in the bucket). `seed`: the bucket's base seed (its
    first matrix's, matrices.matrix_seed); the step's coins use it with the step count."""

    params: tuple[torch.Tensor, ...]
    matrices: tuple[ParamMatrix, ...]
    layout: MatrixLayout
    exchange: object
    seed: int


@dataclass(frozen=True)
class GroupPlan:
    """A matrix group's buckets, or an element-wise group's exchange per dtype (`exchanges`) and
    base seed."""

    key: tuple
    params: tuple = ()
    buckets: tuple[Bucket, ...] = ()
    exchanges: dict = field(default_factory=dict)
    seed: int = 0


def plan_group(record, group: dict, params: list, replicas: int, bucket_bytes: int, param_seed) -> GroupPlan:
    """The plan of `params` (those of `group` that step) for `record` at `replicas` replicas;
    param_seed(param) is the param's seed (equal on every rank)."""
    key = plan_key(record, group, params, replicas)
    if not record.matrix:
        numel = {dtype: sum(local(params[i]).numel() for i in indices) for dtype, indices in by_dtype(params).items()}
        return GroupPlan(key, tuple(params), exchanges={dtype: record.exchange(group, None, n, replicas) for dtype, n in numel.items()},
                         seed=matrix_seed(param_seed(params[0]), 0))
    buckets = []
    for layout, _, members in capped_buckets(params, group, bucket_bytes,
                                             lambda layout: record.work_ranks(layout, group, replicas)):
        numel = len(members) * layout.rows * layout.cols
        first_param, first_matrix = members[0]
        buckets.append(Bucket(tuple(p for p, _ in members), tuple(m for _, m in members), layout,
                              record.exchange(group, layout, numel, replicas),
                              matrix_seed(param_seed(first_param), first_matrix.index)))
    return GroupPlan(key, tuple(params), buckets=tuple(buckets))


def plan_key(record, group: dict, params: list, replicas: int) -> tuple:
    """What a plan depends on: the params (by identity), the group's plan keys, the replica count."""
    return (tuple(id(p) for p in params), tuple(repr(group[k]) for k in record.plan_keys), replicas)


def units(plan: GroupPlan) -> tuple:
    """What a planned group steps one at a time: a matrix group's buckets (none where this rank holds
    no matrix of the group), or (None,) for an element-wise group (one step over all its params; its
    plan has an exchange per dtype)."""
    return (None,) if plan.exchanges else plan.buckets


def unit_params(plan: GroupPlan, unit) -> tuple:
    """The params a unit reads (a bucket's, each once; an element-wise group's)."""
    return tuple(dict.fromkeys(unit.params)) if unit is not None else plan.params


def unit_step(record, group: dict, plan: GroupPlan, unit, local_param, local_grad, local_state, axes, step_seed):
    """The step generator of one unit (`units`) of a planned group. local_param(p), local_grad(p),
    local_state(p): a param's local tensor, the gradient the step reads, its local state (dict of
    tensors; the step writes into the tensors local_param and local_state give); step_seed(base
    seed, first param) → the seed of this step's coins."""
    options = record.options(group)
    if unit is None:
        params = plan.params
        return record.step([local_param(p) for p in params], [local_grad(p) for p in params],
                           [local_state(p) for p in params], exchanges=plan.exchanges, axes=axes,
                           seed=step_seed(plan.seed, params[0]), **options)
    pairs = list(zip(unit.params, unit.matrices))
    states = [{key: (matrix.of_state if key in record.b_side_state else matrix.of)(value)
               for key, value in local_state(param).items() if key != "step"} for param, matrix in pairs]
    return record.step([matrix.of(local_param(param)) for param, matrix in pairs],
                       [matrix.of(local_grad(param)) for param, matrix in pairs], states, layout=unit.layout,
                       exchange=unit.exchange, axes=axes, seed=step_seed(unit.seed, unit.params[0]), **options)


def group_steps(record, group: dict, plan: GroupPlan, local_param, local_grad, local_state, axes, step_seed):
    """The step generators of a planned group (`unit_step` of each unit, in plan order), made lazily
    so only the buckets in flight hold working copies."""
    for unit in units(plan):
        yield unit_step(record, group, plan, unit, local_param, local_grad, local_state, axes, step_seed)


class Plans:
    """One plan per param group (by index), kept while its key holds."""

    def __init__(self):
        self._plans: dict[int, GroupPlan] = {}

    def get(self, index: int, record, group: dict, params: list, replicas: int, bucket_bytes: int,
            param_seed) -> GroupPlan:
        plan = self._plans.get(index)
        if plan is None or plan.key != plan_key(record, group, params, replicas):
            plan = self._plans[index] = plan_group(record, group, params, replicas, bucket_bytes, param_seed)
        return plan

    def clear(self) -> None:
        self._plans.clear()
