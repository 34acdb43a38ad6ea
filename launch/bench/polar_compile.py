"""Newton–Schulz eager vs torch.compile, on the CPU or a GPU: does compiling help?

    python launch/bench/polar_compile.py                             # CPU fp32, 1 thread
    python launch/bench/polar_compile.py --device cuda --dtype bfloat16 --csv results/compile_cuda.csv

For each stack of matrices: the time to compile (first call), the median of `--rounds` calls
eager and compiled, and the largest difference between the two results. shardopt's `compile`
option (SignMuon(..., compile=True)) is off by default because on the CPU it does not help.
Writes results/compile.csv (rows tagged with the device name).

If compiling fails, shardopt's compile=True runs eager (it warns once and stays eager in that
process): that is no compiled time, so `measure` raises CompileFailed instead of timing it, and this
script exits 1 without writing the CSV.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

from integrations.results import device_name, write_csv
from shardopt.algorithms.polar import polar

SHAPES = [(8, 256, 256), (4, 768, 768), (4, 768, 3072)]


def _timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


class CompileFailed(RuntimeError):
    """torch.compile of Newton–Schulz failed, so compile=True ran eager: there is no compiled time to report."""


def compile_failure() -> str | None:
    """The error of shardopt's compile=True in this process, or None: polar.py keeps the first failure in its
    `_compiled` cache and runs eager from then on (tests/test_cuda.py reads the same cache)."""
    error = importlib.import_module("shardopt.algorithms.polar")._compiled.get("failed")
    return None if error is None else f"{type(error).__name__}: {error}"


def measure(shapes, device: torch.device, dtype: torch.dtype, rounds: int, steps: int = 5) -> list[dict]:
    """One row per stack shape; raises CompileFailed if compiling failed (before or during these calls)."""
    rows = []
    for shape in shapes:
        X = torch.randn(*shape, device=device)
        compile_s = _timed(lambda: polar(X, steps, dtype, compile=True), device)   # first call compiles
        eager = [_timed(lambda: polar(X, steps, dtype), device) for _ in range(rounds)]
        fast = [_timed(lambda: polar(X, steps, dtype, compile=True), device) for _ in range(rounds)]
        difference = (polar(X, steps, dtype) - polar(X, steps, dtype, compile=True)).abs().max().item()
        failure = compile_failure()
        if failure:
            raise CompileFailed(f"torch.compile of Newton–Schulz on {'×'.join(map(str, shape))} {dtype} "
                                f"({device_name(device)}) failed, so compile=True ran eager: {failure}")
        rows.append({"device": device_name(device), "dtype": str(dtype).removeprefix("torch."),
                     "matrices": "×".join(map(str, shape)), "compile_s": round(compile_s, 1),
                     "eager_ms": round(statistics.median(eager) * 1e3, 2),
                     "compiled_ms": round(statistics.median(fast) * 1e3, 2),
                     "speedup": round(statistics.median(eager) / statistics.median(fast), 2),
                     "max_abs_difference": f"{difference:.1e}"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--csv", default=str(Path(__file__).resolve().parents[2] / "results" / "compile.csv"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        rows = measure(SHAPES, torch.device(args.device), getattr(torch, args.dtype), args.rounds)
    except CompileFailed as error:
        sys.exit(f"polar_compile: FAILED: {error}; nothing written")
    print(f"{'device':<28}{'matrices':<14}{'compile s':>10}{'eager ms':>10}{'compiled ms':>13}{'speedup':>9}")
    for r in rows:
        print(f"{r['device']:<28}{r['matrices']:<14}{r['compile_s']:>10}{r['eager_ms']:>10}{r['compiled_ms']:>13}"
              f"{r['speedup']:>8}×")
    write_csv(args.csv, list(rows[0]), rows)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
