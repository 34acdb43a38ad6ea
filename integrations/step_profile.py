"""Where an optimizer step's time goes: torch.profiler around `opt.step()` of chosen steps, summed per op.

    add_argument(parser)                                   # --profile-optimizer FIRST LAST
    profile = StepProfile(*args.profile_optimizer) if args.profile_optimizer and rank == 0 else None
    with profile.step(step) if profile else contextlib.nullcontext():   # profiles only steps FIRST..LAST
        opt.step()
    profile.write(out_dir / PROFILE_CSV)

Columns: op (an aten/c10d op, or a record_function scope such as torch.optim's "Optimizer.step#SignMuon.step",
as torch.profiler's key_averages names them), ms_per_step (its self CPU time, the time inside it but not
inside the ops it calls, over the profiled steps: for a scope, its Python), calls_per_step. One more row,
"(outside any op)", is the profiled steps' wall time less every op's self time: Python, and waiting for
another rank's part of a collective (gloo's wait is not an op), and the profiler's own overhead. CPU ops
only: on a GPU the times are launch costs, not kernels (use torch.profiler's trace there). A profiled
step runs slower than an unprofiled one, so read shares from this file, step times from metrics.csv.
"""

from __future__ import annotations

import collections
import contextlib
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from integrations.results import write_csv

OUTSIDE = "(outside any op)"
PROFILE_CSV = "optimizer_profile.csv"
FIELDS = ["op", "ms_per_step", "calls_per_step"]


def add_argument(parser) -> None:
    """--profile-optimizer FIRST LAST, as both training scripts of the small GPT take it."""
    parser.add_argument("--profile-optimizer", type=int, nargs=2, metavar=("FIRST", "LAST"), help="profile the "
                        f"optimizer step of steps FIRST..LAST on rank 0 (torch.profiler, CPU ops) into "
                        f"<out-dir>/{PROFILE_CSV}: each op's self time per step (integrations/step_profile.py)")


class StepProfile:
    """Per-op self CPU time of the profiled steps first..last (inclusive), summed."""

    def __init__(self, first: int, last: int):
        if not 1 <= first <= last:
            raise ValueError(f"profile steps must be 1 ≤ FIRST ≤ LAST, got {first} {last}")
        self.first, self.last = first, last
        self.self_us: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.wall_s, self.steps = 0.0, 0

    @contextlib.contextmanager
    def step(self, step: int):
        """Profile what runs inside when `step` is one of the profiled ones; otherwise nothing."""
        if not self.first <= step <= self.last:
            yield
            return
        tick = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as recorded:
            yield
        self.wall_s += time.perf_counter() - tick
        self.steps += 1
        for event in recorded.key_averages():
            self.self_us[event.key] += event.self_cpu_time_total
            self.calls[event.key] += event.count

    def rows(self) -> list[dict]:
        """One row per op, the most time first, then the time outside any op (module doc)."""
        if not self.steps:
            return []
        per_step = [(op, us / 1000 / self.steps, self.calls[op] / self.steps) for op, us in self.self_us.most_common()]
        outside = 1000 * self.wall_s / self.steps - sum(ms for _, ms, _ in per_step)
        return [{"op": op, "ms_per_step": f"{ms:.3f}", "calls_per_step": f"{calls:g}"}
                for op, ms, calls in [*per_step, (OUTSIDE, outside, 0)]]

    def write(self, path: Path) -> None:
        write_csv(path, FIELDS, self.rows())
