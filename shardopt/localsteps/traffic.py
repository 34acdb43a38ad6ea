"""Local steps' bytes: what a sync sends on the replicate axis, counted by running the fragment's own
exchange on a meta x against counting axes (wire/comm.CountingAxis: every collective counted as `Axis`
counts it, nothing moves), as optim/traffic.py does for the optimizers' steps; and the description and
per-axis statistics built from it. tests/reference.py keeps the independent formulas (formats.py's table).
"""

from __future__ import annotations

import torch

from ..layout.placement import local
from ..optim.schedule import complete
from ..optim.traffic import allreduce_bytes, double_averaging_check_bytes
from ..wire.comm import Axes, Axis, CountingAxis
from .formats import OuterFormat


def counting_axes(replicas: int, shard: Axis, tensor: Axis) -> Axes:
    """Counting axes: `replicas` replicas, and the sizes and ranks of this rank's shard and tensor axes."""
    return Axes(CountingAxis("replicate", replicas), CountingAxis("shard", shard.size, shard.rank),
                CountingAxis("tensor", tensor.size, tensor.rank))


def sync_bytes(fmt: OuterFormat, numel: int, replicate: CountingAxis) -> int:
    """Bytes one replica sends on `replicate` in one sync of `numel` local entries with `fmt` (0 without
    entries: such a sync sends nothing). `fmt` must count its other axes too (a counting LowRank)."""
    if not numel:
        return 0
    sent = replicate.bytes_sent
    complete(fmt.exchange(torch.empty(numel, device="meta"), replicate, 0))
    return replicate.bytes_sent - sent


def describe(local_steps, replicas: int) -> str:
    """A LocalSteps' settings, its replicate-axis bytes per round and per step against an fp32 all-reduce
    every step of the local entries it syncs (the DDP baseline), what ending a run between two syncs costs
    (sync_now: at most one round, finish.py), and its inner optimizer's own description."""
    numel = sum(local(param).numel() for part in local_steps._partition() for param in part)
    total = sum(local_steps.sync_bytes(replicas))
    ddp = allreduce_bytes(numel, torch.float32, replicas)
    H = local_steps.sync_every
    ratio = f", {ddp * H / total:.0f}× fewer than an fp32 all-reduce every step" if total else ""
    check = double_averaging_check_bytes(replicas) if local_steps.double_averaging_check else 0
    check = f" (step 1: + {check} B, the double-averaging check)" if check else ""
    fmt = local_steps.format
    named = f"{fmt.name!r}" + (f" ({fmt.at(replicas).name!r} at {replicas} replicas)" if fmt.name == "auto" else "")
    lines = [f"LocalSteps: sync every {H} steps, exchange {named}, outer lr "
             f"{local_steps.outer_lr:g}, momentum {local_steps.outer_momentum:g}"
             f"{' Nesterov' if local_steps.nesterov else ''}, {local_steps.fragments} fragment(s)"
             f"{', overlapped' if local_steps.overlap else ''}",
             f"  replicate axis ({replicas} replicas): {total:,} B per round of {H} steps "
             f"({total / H:,.0f} B/step){ratio}; inner steps send 0 B{check}; ending between two syncs "
             f"(sync_now) sends at most one round + {allreduce_bytes(local_steps.fragments, torch.float32, replicas)} B"]
    if hasattr(local_steps.inner, "describe"):
        lines.append("inner optimizer (its replicate axis unused):\n" + local_steps.inner.describe())
    return "\n".join(lines)


def comm_stats(replicate: Axis, other_axes: list[Axis], inner) -> dict:
    """Bytes sent/received and calls per axis: the outer exchange on "replicate", the inner optimizer's
    own axes (shard, tensor) as it counts them."""
    stats = inner.comm_stats() if hasattr(inner, "comm_stats") else {}
    axes = {axis.name: axis.stats() for axis in other_axes}
    return {**axes, **{name: value for name, value in stats.items() if name != "replicate"},
            "replicate": replicate.stats()}


def reset_comm_stats(replicate: Axis, other_axes: list[Axis], inner) -> None:
    replicate.reset_stats()
    for axis in other_axes:
        axis.reset_stats()
    if hasattr(inner, "reset_comm_stats"):
        inner.reset_comm_stats()
