"""Overlap communication with compute across buckets.

A bucket step is a generator: it computes until it needs a collective, yields
the `Pending` collective, and is resumed with its result:

    P = yield replicate.all_reduce(P, "mean", async_op=True)

`overlap` keeps up to `depth` bucket steps in flight: while one bucket's
collective is on the wire, the next bucket computes up to its own first
collective. The order in which collectives are issued depends only on the
bucket order, so it is the same on every rank.
"""

from __future__ import annotations

from collections import deque


def overlap(steps, depth: int = 2) -> None:
    """Run bucket-step generators to completion, at most `depth` in flight."""
    in_flight: deque = deque()

    def advance(step, value) -> None:
        try:
            in_flight.append((step, step.send(value)))
        except StopIteration:
            pass

    for step in steps:
        advance(step, None)
        while len(in_flight) >= depth:
            waiting, pending = in_flight.popleft()
            advance(waiting, pending.wait())
    while in_flight:
        waiting, pending = in_flight.popleft()
        advance(waiting, pending.wait())


def complete(step):
    """Run one step generator synchronously and return its return value."""
    try:
        pending = next(step)
        while True:
            pending = step.send(pending.wait())
    except StopIteration as stop:
        return stop.value
