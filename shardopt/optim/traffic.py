"""Bytes per step on the replicate axis: the step's own code, run against counting axes on meta tensors.

`group_bytes` plans a param group as the optimizer does (plan.py: the buckets, each bucket's
exchange at that replica count) and runs each bucket's step (or the element-wise group's) on meta
copies of the local params, gradients and state, with `comm.CountingAxis` for the replicate, shard
and tensor axes: every collective is counted exactly as `comm.Axis` counts it and nothing moves or
computes. So `describe()`, `replicate_bytes_per_step()` and `param_groups(verbose=True)` are the
bytes that the step sends, by construction: a new branch in a step cannot disagree with them (the
tests keep one independent formula, tests/reference.py, and compare it with measured comm_stats()).

What a rank did send is counted by its axes (`comm_stats`); with overlap_backward the bucket steps use
process groups of their own (`bucket_step_axes`), counted in with the axis they stand for.

The step's other collectives have their formulas beside the code that issues them: once per step
the non-finite check, AR(4); at step 1 and every N = `double_averaging_check_every` steps after,
the double-averaging check, AR(24) (3 int64), and AR(2) on each other agreement axis; per checkpoint the
agreement on the decoupled momenta (checkpoint_momenta.checkpoint_bytes, `checkpoint_cost`). AR(x) =
2·x·(M−1)/M (comm.collective_bytes).
"""

from __future__ import annotations

import torch

from ..layout.buckets import default_bucket_bytes
from ..wire.comm import Axes, Axis, CountingAxis, collective_bytes
from ..algorithms.hyperparams import state_dtype
from ..layout.placement import derive_meshes, local
from .plan import group_steps, plan_group
from ..localsteps.formats import resolve
from .checkpoint_momenta import CHECKPOINT_EXCHANGE, checkpoint_bytes, checkpoint_exchange
from ..algorithms.registry import algorithm
from .schedule import pipeline


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def nonfinite_check_bytes(replicas: int) -> int:
    """The step's agreed NaN/inf flag: one all-reduce of one float32."""
    return collective_bytes("all_reduce", 4, replicas)


DOUBLE_AVERAGING_CHECK_EVERY = 1000   # the optimizers' default double_averaging_check_every


def double_averaging_check_bytes(replicas: int, axis_size: int | None = None) -> int:
    """One double-averaging check, on the replicate axis (`axis_size` None): one all-reduce of
    (h, −h, nonzero) as 3 int64; on another agreement axis of `axis_size` ranks: the verdict, one
    all-reduce of 2 bytes. Nothing with one replica (no check)."""
    if replicas <= 1:
        return 0
    if axis_size is None:
        return collective_bytes("all_reduce", 24, replicas)
    return collective_bytes("all_reduce", 2, axis_size)


def allreduce_bytes(numel: int, dtype: torch.dtype, replicas: int) -> int:
    """A plain ring all-reduce of `numel` gradients in `dtype` (what DDP sends per step)."""
    return collective_bytes("all_reduce", numel * _itemsize(dtype), replicas)


def model_axes(groups: list[dict]) -> tuple[Axis, Axis]:
    """The shard and tensor axes the params' placements imply (placement.derive_meshes)."""
    labeled = [(p, f"#{i}") for i, p in enumerate(p for group in groups for p in group["params"])]
    _, shard_mesh, tensor_mesh = derive_meshes(labeled, None, None, None)
    return Axis("shard", shard_mesh), Axis("tensor", tensor_mesh)


def _meta(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty_like(local(tensor), dtype=dtype, device="meta")


def group_bytes(group: dict, replicas: int, bucket_bytes: int | None = None, shard: Axis | None = None,
                tensor: Axis | None = None, step: int = 1) -> int:
    """Replicate-axis bytes one rank sends per step for a param group (with every key of the
    registry's defaults), every param with a gradient, at `replicas` replicas; shard, tensor: this
    rank's axes (default: those the params' placements imply); step: the params' step count (1-bit
    Adam's exchange changes after its warm-up: `Algorithm.phases`); bucket_bytes None: the params' device's
    default (buckets.default_bucket_bytes)."""
    record = algorithm(group["algorithm"])
    params = group["params"]
    if not params:
        return 0
    bucket_bytes = bucket_bytes or default_bucket_bytes(local(params[0]).device.type)
    if shard is None or tensor is None:
        shard, tensor = model_axes([group])
    axes = Axes(CountingAxis("replicate", replicas), CountingAxis("shard", shard.size, shard.rank),
                CountingAxis("tensor", tensor.size, tensor.rank))
    plan = plan_group(record, group, params, replicas, bucket_bytes, lambda param: 0)
    copies = {param: _meta(param) for param in params}
    states = {param: {**{key: torch.empty(local_shape, dtype=state_dtype(group, param), device="meta")
                         for key, (_, local_shape) in record.state_shapes(param, group).items()},
                      "step": torch.tensor(float(step))} for param in params}
    pipeline(group_steps(record, group, plan, copies.__getitem__, lambda param: _meta(param), states.__getitem__, axes,
                        lambda seed, param: seed))
    return axes.replicate.bytes_sent


def _phase_bytes(group: dict, replicas: int, bucket_bytes: int, shard: Axis, tensor: Axis) -> list[tuple[str, int]]:
    """(label, bytes per step) of each phase of the group's algorithm (`Algorithm.phases`; one, unlabeled,
    for most)."""
    phases = algorithm(group["algorithm"]).phases
    return [(label, group_bytes(group, replicas, bucket_bytes, shard, tensor, step))
            for label, step in (phases(group) if phases else (("", 1),))]


def replicate_bytes(optimizer, replicas: int | None = None) -> list[int]:
    """A ShardOptimizer's replicate-axis bytes one rank sends per step, per param group (`group_bytes` on its
    shard and tensor axes), at `replicas` replicas (default: its replicate axis's size). The non-finite check
    comes on top once per step, the double-averaging check at its steps."""
    replicas = optimizer.replicate.size if replicas is None else replicas
    return [group_bytes(group, replicas, optimizer.bucket_bytes, optimizer.shard, optimizer.tensor)
            for group in optimizer.param_groups]


def describe_optimizer(optimizer, replicas: int | None = None) -> str:
    """`describe` of a ShardOptimizer's groups, with its settings and axes, at `replicas` replicas (default:
    its replicate axis's size)."""
    replicas = optimizer.replicate.size if replicas is None else replicas
    return describe(optimizer.param_groups, replicas, optimizer.bucket_bytes, clipping=optimizer.max_norm > 0,
                    double_averaging_check_every=optimizer.double_averaging_check_every, shard=optimizer.shard,
                    tensor=optimizer.tensor, checkpoint=checkpoint_exchange(optimizer))


def checkpoint_cost(groups: list[dict], replicas: int, exchange: str) -> str:
    """What a checkpoint costs on the replicate axis (checkpoint_momenta.py), said after the whole model's bytes ("" with
    nothing to agree on)."""
    agreed, exact = (checkpoint_bytes(groups, replicas, name) for name in (exchange, "mean"))
    named = f"{resolve(exchange, replicas)!r}{' (auto)' if exchange == 'auto' else ''}"
    return f"; a checkpoint: +{agreed:,} B on the replicate axis per save, the decoupled momenta agreed through " \
           f"{named} ({exact:,} B with \"mean\": docs/design.md §6)" if exact else ""


def describe(groups: list[dict], replicas: int, bucket_bytes: int | None = None, clipping: bool = False,
             double_averaging_check_every: int = DOUBLE_AVERAGING_CHECK_EVERY, shard: Axis | None = None,
             tensor: Axis | None = None, checkpoint: str = CHECKPOINT_EXCHANGE) -> str:
    """One line per group (algorithm, tensors, elements, replicate-axis bytes per step on this rank),
    a group whose algorithm has phases (1-bit Adam: warm-up, then 1-bit) shows each phase's bytes and counts
    its last in the whole model; then the whole model (the non-finite check and, with `clipping`, the agreed clip norm — one float
    all-reduced each — included) against a float32 all-reduce of every parameter, then (with more than
    one replica and the check on) the double-averaging check's bytes at the steps it runs. `checkpoint`: the
    exchange a checkpoint agrees the momenta through (the framework adapters' `checkpoint_exchange`)."""
    lines, numel_total = [], 0
    total = nonfinite_check_bytes(replicas) * (2 if clipping else 1)
    if shard is None or tensor is None:
        shard, tensor = model_axes(groups)   # once for the model, not once per group
    for group in groups:
        phases = _phase_bytes(group, replicas, bucket_bytes, shard, tensor)
        sent = phases[-1][1]    # the whole-model total: each group's last phase (after any warm-up)
        numel = sum(local(p).numel() for p in group["params"])
        total, numel_total = total + sent, numel_total + numel
        shown = ", ".join(f"{value:,} B/step{f' {label}' if label else ''}" for label, value in phases)
        lines.append(f"shardopt: {group['algorithm']:>8}: {len(group['params'])} tensors, {numel:,} elements, "
                     f"{shown} ({algorithm(group['algorithm']).describe_exchange(group)})")
    baseline = allreduce_bytes(numel_total, torch.float32, replicas)
    ratio = f"1/{baseline / total:.1f} of" if total else "vs"
    lines.append(f"shardopt: whole model, {replicas} replicas: {total:,} B/step on the replicate axis per rank, "
                 f"{ratio} a float32 all-reduce of every parameter ({baseline:,} B)"
                 f"{checkpoint_cost(groups, replicas, checkpoint)}")
    check = double_averaging_check_bytes(replicas)
    if check and double_averaging_check_every:
        lines.append(f"shardopt: double-averaging check: +{check:,} B on the replicate axis at step 1 and every "
                     f"{double_averaging_check_every:,} steps after (double_averaging_check_every)")
    return "\n".join(lines)


def distinct_axes(axes: Axes, bucket_step_axes: Axes) -> list[Axis]:
    """The Axis objects of `axes` and `bucket_step_axes`, each once."""
    return list({id(axis): axis for axis in (*axes, *bucket_step_axes)}.values())


def comm_stats(axes: Axes, bucket_step_axes: Axes) -> dict:
    """Per axis name: bytes sent/received and calls issued since the last reset, summed over the axis and
    its counterpart in `bucket_step_axes` where that is another Axis object."""
    stats = {axis.name: dict.fromkeys(axis.stats(), 0) for axis in axes}
    for axis in distinct_axes(axes, bucket_step_axes):
        stats[axis.name] = {key: value + axis.stats()[key] for key, value in stats[axis.name].items()}
    return stats


def reset_comm_stats(axes: Axes, bucket_step_axes: Axes) -> None:
    """Zero the counts of every Axis object of `axes` and `bucket_step_axes`."""
    for axis in distinct_axes(axes, bucket_step_axes):
        axis.reset_stats()
