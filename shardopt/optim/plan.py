"""The plan of a param group: its buckets and the exchange of each, chosen once, not every step.

A matrix group's params are cut into buckets of same-layout matrices (buckets.py) and each bucket
gets its exchange from its algorithm's record (`Algorithm.exchange`: Dion's factor mean or
fallback, a vote format, a mean) for its size at this replica count. An element-wise group's entries,
per dtype taken as one run, are cut into buckets of at most bucket_bytes of compute-dtype entries
(buckets.flat_buckets: O(bucket_bytes) transient memory, not O(group)); its exchange is chosen once per dtype
for the whole run, and each bucket's is that one from the bucket's first entry on (`starting_at`: a vote's
coins), so the numbers are those of one bucket per dtype. The plan depends on the group's params, its `plan_keys` values and the replica
count; `Plans` keeps one per group and makes a new one when any of them changes (a scheduler that
cycles momentum does not re-plan; a new `vote` does).

A step runs the *units* of the plans (a group's buckets) for the params
that step, in backward order (`Plans.stepping_units`), each unit a step generator (`unit_steps`) that reads
its params' gradients through `gradient_reader`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..algorithms import registry
from ..algorithms.hyperparams import follow_momentum_schedule
from ..layout.buckets import capped_buckets, compute_dtype, flat_buckets, flat_piece
from ..wire.exchange import by_dtype
from ..wire.seeds import mix_seed
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
class Entries:
    """An element-wise bucket: of each of `params` (one dtype) its local flat entries ranges[i] = (start, stop)
    (buckets.flat_piece); `exchange`: the dtype's, from the bucket's first entry on."""

    params: tuple[torch.Tensor, ...]
    ranges: tuple[tuple[int, int], ...]
    dtype: torch.dtype
    exchange: object


@dataclass(frozen=True)
class GroupPlan:
    """A group's buckets (matrix `Bucket`s or element-wise `Entries`); `seed`: an element-wise group's base
    seed (every bucket's coins are numbered within the group's, per dtype)."""

    key: tuple
    params: tuple = ()
    buckets: tuple = ()
    seed: int = 0


def entry_buckets(record, group: dict, params: list, replicas: int, bucket_bytes: int) -> list[Entries]:
    """An element-wise group's buckets: per dtype, its params' local entries in order, cut by
    buckets.flat_buckets at bucket_bytes of compute-dtype entries (whole tensors where the record does not
    cut them, or a tensor is not contiguous); the exchange chosen for the dtype's whole run."""
    found = []
    for dtype, indices in by_dtype(params).items():
        tensors = [local(params[i]) for i in indices]
        sizes = [tensor.numel() for tensor in tensors]
        exchange = record.exchange(group, None, sum(sizes), replicas)
        whole = [not (record.cuts_tensors and tensor.is_contiguous()) for tensor in tensors]
        first = 0
        for bucket in flat_buckets(sizes, whole, max(1, bucket_bytes // compute_dtype(dtype).itemsize)):
            found.append(Entries(tuple(params[indices[k]] for k, _, _ in bucket),
                                 tuple((start, stop) for _, start, stop in bucket), dtype, exchange.starting_at(first)))
            first += sum(stop - start for _, start, stop in bucket)
    return found


def plan_group(record, group: dict, params: list, replicas: int, bucket_bytes: int, param_seed) -> GroupPlan:
    """The plan of `params` (those of `group` that step) for `record` at `replicas` replicas;
    param_seed(param) is the param's seed (equal on every rank)."""
    key = plan_key(record, group, params, replicas)
    if not record.matrix:
        return GroupPlan(key, tuple(params), tuple(entry_buckets(record, group, params, replicas, bucket_bytes)),
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
    """What a planned group steps one at a time: its buckets (a matrix group has none where this rank holds
    no matrix of it)."""
    return plan.buckets


def unit_params(plan: GroupPlan, unit) -> tuple:
    """The params a unit (a bucket) reads, each once."""
    return tuple(dict.fromkeys(unit.params))


def backward_order(units_: list, position) -> list:
    """`units_` (tuples ending in (group plan, unit)) sorted for backward: the unit whose earliest param
    comes last in the optimizer's param list first (position(param) → its index there), as DDP fills
    its buckets in reverse parameter order; ties keep plan order."""
    return sorted(units_, key=lambda item: -min(position(p) for p in unit_params(*item[-2:])))


def gradient_reader(maximize: bool, delivered: dict | None = None):
    """param → the local gradient a step reads (`delivered[param]` where there is one, else `.grad`): g,
    or −g (a new tensor) when the group maximizes; zeros where this rank has none (another rank has one,
    so this rank still joins the bucket's collectives). Each param's is made once per step (a 3-D
    stack's matrices share it)."""
    read: dict = {}

    def gradient(param):
        if param not in read:
            grad = delivered.get(param, param.grad) if delivered else param.grad
            grad = local(grad) if grad is not None else torch.zeros_like(local(param))
            read[param] = -grad if maximize else grad
        return read[param]
    return gradient


def unit_step(record, group: dict, plan: GroupPlan, unit, local_param, local_grad, local_state, axes, step_seed):
    """The step generator of one unit (`units`) of a planned group. local_param(p), local_grad(p),
    local_state(p): a param's local tensor, the gradient the step reads, its local state (dict of
    tensors; the step writes into the tensors local_param and local_state give); step_seed(base
    seed, first param) → the seed of this step's coins."""
    options = record.options(group)
    if not record.matrix:
        pieces = list(zip(unit.params, unit.ranges))
        states = [{key: value if key == "step" else flat_piece(value, *entries) for key, value in local_state(p).items()}
                  for p, entries in pieces]
        return record.step([flat_piece(local_param(p), *entries) for p, entries in pieces],
                           [flat_piece(local_grad(p).contiguous(), *entries) for p, entries in pieces], states,
                           exchanges={unit.dtype: unit.exchange}, axes=axes, seed=step_seed(plan.seed, plan.params[0]),
                           **options)
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


def unit_steps(groups: list[dict], units_: list, read_param, read_state, axes, delivered: dict | None = None):
    """The step generator of each of `units_` (`Plans.stepping_units` of `groups`), made lazily. read_param /
    read_state: where a param's tensor and state are read and written (in place, or scratch); the gradients:
    `gradient_reader`'s, one per group (delivered: gradients handed over before they are `.grad`,
    round.Round.arrive); axes: where the collectives go; the coins' seed: the unit's base seed mixed with
    its first param's step count."""
    readers = {}
    for index, record, plan, unit in units_:
        group = groups[index]
        gradient = readers.setdefault(index, gradient_reader(group["maximize"], delivered))
        yield unit_step(record, group, plan, unit, read_param, gradient, read_state, axes,
                        lambda base, first: mix_seed(base, read_state(first)["step"]))


class Plans:
    """One plan per param group (by index), kept while its key holds, and a step's units from them."""

    def __init__(self):
        self._plans: dict[int, GroupPlan] = {}

    def get(self, index: int, record, group: dict, params: list, replicas: int, bucket_bytes: int,
            param_seed) -> GroupPlan:
        plan = self._plans.get(index)
        if plan is None or plan.key != plan_key(record, group, params, replicas):
            plan = self._plans[index] = plan_group(record, group, params, replicas, bucket_bytes, param_seed)
        return plan

    def stepping_units(self, groups: list[dict], stepping: set, replicas: int, bucket_bytes: int, param_seed,
                       position) -> list:
        """(group index, record, plan, unit) of every unit (`units`) of the groups' plans for the params in
        `stepping`, in backward order (`backward_order`; position(param): its index in the optimizer's
        params), the same on every rank; a group under a momentum schedule follows it first
        (hyperparams.follow_momentum_schedule)."""
        found = []
        for index, group in enumerate(groups):
            params = [p for p in group["params"] if p in stepping]
            if not params:
                continue
            record = registry.algorithm(group["algorithm"], index)
            follow_momentum_schedule(group, record.momentum)
            plan = self.get(index, record, group, params, replicas, bucket_bytes, param_seed)
            found += [(index, record, plan, unit) for unit in units(plan)]
        return backward_order(found, position)
