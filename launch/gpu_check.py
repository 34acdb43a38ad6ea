"""The GPU check, one script: single-process tests on CUDA, then step time and peak memory.

    python launch/gpu_check.py                # on a machine with a CUDA device (a few minutes)
    python launch/gpu_check.py --rounds 3     # quicker
    python launch/gpu_check.py --dry-run      # on the CPU, seconds: every step row on two small matrices

1. tests/test_cuda.py on the device (bf16 Newton–Schulz vs the float64 reference, Dion with
   Householder and randomized Cholesky-QR vs the reference, state dtype, compiled NS).
2. One optimizer step, fp32 params on the device, on GPT-2-small's and Llama-3.2-1B's matrix
   shapes: torch.optim.Muon beside shardopt's Muon, Sign-Muon (bf16 Newton–Schulz, the CUDA
   default) and Dion 1/4. Median step time over `--rounds` after two warm-up steps; peak memory
   of a step above the memory held before it (torch.cuda.max_memory_allocated), and the state.
   torch.optim.Muon exists from torch 2.9 (shardopt needs ≥ 2.6): with an older torch its rows print
   "skipped: <reason>" and the others run.
3. Newton–Schulz eager vs torch.compile in bf16 (launch/bench/polar_compile.py). If compiling fails,
   compile=True runs eager: that is reported as FAILED (exit 1), not timed.
Every row carries the device name. Writes results/gpu_check.csv and results/compile_cuda.csv.
Without CUDA it prints why and exits 0 having run nothing (SKIP, not a pass). --dry-run checks the
script itself on the CPU: part 2 on two small matrices, one round, no memory column; no tests, no
compile, nothing written.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import shardopt   # a bare GPU machine: `PYTHONPATH=. python launch/gpu_check.py` imports this checkout's
from integrations.results import write_csv

from bench.polar_compile import SHAPES as COMPILE_SHAPES, CompileFailed, measure as measure_compile   # launch/bench/
from bench.step_memory import LLAMA_1B_LAYER, LLAMA_1B_LAYERS
from bench.step_time import SHAPES as GPT2_LAYER

ROOT = Path(__file__).resolve().parents[1]

# (step_time.SHAPES is a dict of one GPT-2-small layer's matrices plus a 2048² "square" that is no part of it)
GPT2_SMALL_LAYER = [shape for name, shape in GPT2_LAYER.items() if name != "square"]
MODELS = {"gpt2-small": GPT2_SMALL_LAYER * 12, "llama-3.2-1b": LLAMA_1B_LAYER * LLAMA_1B_LAYERS}
DRY_RUN_MODELS = {"dry-run": [(96, 64), (64, 96)]}
OPTIMIZERS = {
    "torch.optim.Muon": lambda params: torch.optim.Muon(params, lr=0.02),
    "shardopt muon (bf16 NS)": lambda params: shardopt.Dion([{"params": params, "algorithm": "muon", "lr": 0.02}]),
    "shardopt sign-muon (bf16 NS)": lambda params: shardopt.SignMuon(params, lr=1e-3),
    "shardopt dion 1/4": lambda params: shardopt.Dion(params, lr=0.01, rank_fraction=0.25),
}


def unavailable(name: str) -> str | None:
    """Why optimizer `name` cannot run with this torch, or None."""
    if name == "torch.optim.Muon" and not hasattr(torch.optim, "Muon"):
        return f"torch.optim.Muon is absent in torch {torch.__version__} (added in torch 2.9); no baseline row"
    return None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_rows(device: torch.device, rounds: int, models: dict) -> list[dict]:
    """One row per (model, optimizer) that can run: step time, and on CUDA the step's peak memory."""
    cuda = device.type == "cuda"
    rows = []
    for model, shapes in models.items():
        for name, build in OPTIMIZERS.items():
            reason = unavailable(name)
            if reason:
                print(f"{model:<14}{name:<30}skipped: {reason}", flush=True)
                continue
            generator = torch.Generator(device=device).manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(shape, device=device, generator=generator)) for shape in shapes]
            for p in params:
                p.grad = torch.randn(p.shape, device=device, generator=generator)
            optimizer = build(params)
            for _ in range(2):
                optimizer.step()
            synchronize(device)
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                optimizer.step()
                synchronize(device)
                times.append(time.perf_counter() - start)
            transient = None
            if cuda:
                held = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                optimizer.step()
                synchronize(device)
                transient = torch.cuda.max_memory_allocated(device) - held
            state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                        if isinstance(v, torch.Tensor))
            params_bytes = sum(p.numel() * p.element_size() for p in params)
            rows.append({"device": torch.cuda.get_device_name(device) if cuda else "cpu", "model": model,
                         "optimizer": name, "params_mib": round(params_bytes / 2**20, 1),
                         "state_mib": round(state / 2**20, 1),
                         "step_peak_mib": None if transient is None else round(transient / 2**20, 1),
                         "median_ms": round(statistics.median(times) * 1e3, 2)})
            peak = "n/a (CPU)" if transient is None else f"{rows[-1]['step_peak_mib']:.1f} MiB"
            print(f"{model:<14}{name:<30}{rows[-1]['median_ms']:>10.2f} ms{peak:>14} peak"
                  f"{rows[-1]['state_mib']:>10.1f} MiB state", flush=True)
            del optimizer, params
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU: the step rows on two small matrices, "
                                                               "one round; no tests, no compile, nothing written")
    args = parser.parse_args()
    if args.dry_run:
        print(f"dry run on the CPU: torch {torch.__version__}; step rows only, nothing written")
        step_rows(torch.device("cpu"), 1, DRY_RUN_MODELS)
        return 0
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device (torch.cuda.is_available() is False); nothing was run")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    status = 0
    if not args.skip_tests:
        status = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_cuda.py"), "-q", "-rs"],
                                cwd=ROOT, check=False).returncode
        print(f"tests/test_cuda.py: {'passed' if status == 0 else f'FAILED (exit {status})'}")
    rows = step_rows(device, args.rounds, MODELS)
    write_csv(ROOT / "results" / "gpu_check.csv", list(rows[0]), rows)
    try:
        compile_rows = measure_compile(COMPILE_SHAPES, device, torch.bfloat16, args.rounds)
    except CompileFailed as error:
        print(f"compile: FAILED: {error}; results/compile_cuda.csv not written")
        print("wrote results/gpu_check.csv")
        return 1
    for row in compile_rows:
        print(f"compile {row['matrices']:<14}eager {row['eager_ms']} ms, compiled {row['compiled_ms']} ms "
              f"({row['speedup']}×, compile {row['compile_s']} s)")
    write_csv(ROOT / "results" / "compile_cuda.csv", list(compile_rows[0]), compile_rows)
    print("wrote results/gpu_check.csv and results/compile_cuda.csv")
    return status


if __name__ == "__main__":
    sys.exit(main())
