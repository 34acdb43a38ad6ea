"""The bucket-step pipeline: one bucket's collective on the wire while the next bucket computes.

A bucket step is a generator: it computes until it needs a collective, yields
the `Pending` collective, and is resumed with its result:

    P = yield replicate.all_reduce(P, "mean", async_op=True)

`pipeline` keeps up to `depth` bucket steps in flight: while one bucket's
collective is on the wire, the next bucket computes up to its own first
collective. The order in which collectives are issued depends only on the
bucket order, so it is the same on every rank.

`Schedule` is the same sequence of actions taken in pieces, for the exchange
during backward (docs/design.md §12): `run(ready)` takes the next actions as
long as none would block — a step starts once `ready` says its gradients are
final, a wait is taken once its collective has completed — and stops at the
first that would; `run()` takes the rest, blocking. When an action happens
differs from rank to rank; which action comes next never does, so every rank
issues the same collectives in the same order as `pipeline` would.
"""

from __future__ import annotations

from collections import deque

from ..wire.comm import complete  # noqa: F401  (one step run synchronously; here for the step loop's callers)


class Schedule:
    """`pipeline`'s actions over `steps` (an iterable of step generators, made lazily: the next one
    is drawn only when it starts), resumable."""

    def __init__(self, steps, depth: int = 2):
        self._steps = iter(steps)
        self._depth = depth
        self._in_flight: deque = deque()
        self.started = 0          # steps drawn and started so far
        self._exhausted = False

    def _advance(self, step, value) -> None:
        try:
            self._in_flight.append((step, step.send(value)))
        except StopIteration:
            pass

    def run(self, ready=None) -> bool:
        """Take the next actions in order. ready(i) → whether step i (0-based) may start now; None:
        block wherever needed and run to the end. Returns True once every step has finished."""
        while True:
            if self._in_flight and (len(self._in_flight) >= self._depth or self._exhausted):
                step, pending = self._in_flight[0]
                if ready is not None and not pending.done():
                    return False
                self._in_flight.popleft()
                self._advance(step, pending.wait())
            elif self._exhausted:
                return True
            else:
                if ready is not None and not ready(self.started):
                    return False
                step = next(self._steps, None)
                if step is None:
                    self._exhausted = True
                    continue
                self.started += 1
                self._advance(step, None)


def pipeline(steps, depth: int = 2) -> None:
    """Run bucket-step generators to completion, at most `depth` in flight."""
    Schedule(steps, depth).run()

