"""The GPU check, one script: single-process tests on CUDA, then step time and peak memory.

    python launch/gpu_check.py                # on a machine with a CUDA device (a few minutes)
    python launch/gpu_check.py --rounds 3     # quicker

1. tests/test_cuda.py on the device (bf16 Newton–Schulz vs the float64 reference, Dion with
   Householder and randomized Cholesky-QR vs the reference, state dtype, compiled NS).
2. One optimizer step, fp32 params on the device, on GPT-2-small's and Llama-3.2-1B's matrix
   shapes: torch.optim.Muon beside shardopt's Muon, Sign-Muon (bf16 Newton–Schulz, the CUDA
   default) and Dion 1/4. Median step time over `--rounds` after two warm-up steps; peak memory
   of a step above the memory held before it (torch.cuda.max_memory_allocated), and the state.
3. Newton–Schulz eager vs torch.compile in bf16 (launch/bench/polar_compile.py).
Every row carries the device name. Writes results/gpu_check.csv and results/compile_cuda.csv.
Without CUDA it prints why and exits 0 having run nothing (SKIP, not a pass).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # a bare GPU machine may not have the package installed: use this checkout's
sys.path.insert(1, str(ROOT / "launch" / "bench"))   # the benchmarks whose shapes and timing this reuses

import shardopt  # noqa: E402

from polar_compile import SHAPES as COMPILE_SHAPES, measure as measure_compile  # noqa: E402
from step_memory import LLAMA_1B_LAYER, LLAMA_1B_LAYERS  # noqa: E402
from step_time import SHAPES as GPT2_LAYER  # noqa: E402
from results_table import write_csv  # noqa: E402

MODELS = {"gpt2-small": GPT2_LAYER * 12, "llama-3.2-1b": LLAMA_1B_LAYER * LLAMA_1B_LAYERS}
OPTIMIZERS = {
    "torch.optim.Muon": lambda params: torch.optim.Muon(params, lr=0.02),
    "shardopt muon (bf16 NS)": lambda params: shardopt.Dion([{"params": params, "algorithm": "muon", "lr": 0.02}]),
    "shardopt sign-muon (bf16 NS)": lambda params: shardopt.SignMuon(params, lr=1e-3),
    "shardopt dion 1/4": lambda params: shardopt.Dion(params, lr=0.01, rank_fraction=0.25),
}


def step_rows(device: torch.device, rounds: int) -> list[dict]:
    rows = []
    for model, shapes in MODELS.items():
        for name, build in OPTIMIZERS.items():
            generator = torch.Generator(device=device).manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(shape, device=device, generator=generator)) for shape in shapes]
            for p in params:
                p.grad = torch.randn(p.shape, device=device, generator=generator)
            optimizer = build(params)
            for _ in range(2):
                optimizer.step()
            torch.cuda.synchronize(device)
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                optimizer.step()
                torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            held = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            optimizer.step()
            torch.cuda.synchronize(device)
            transient = torch.cuda.max_memory_allocated(device) - held
            state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                        if isinstance(v, torch.Tensor))
            params_bytes = sum(p.numel() * p.element_size() for p in params)
            rows.append({"device": torch.cuda.get_device_name(device), "model": model, "optimizer": name,
                         "params_mib": round(params_bytes / 2**20, 1), "state_mib": round(state / 2**20, 1),
                         "step_peak_mib": round(transient / 2**20, 1), "median_ms": round(statistics.median(times) * 1e3, 2)})
            print(f"{model:<14}{name:<30}{rows[-1]['median_ms']:>10.2f} ms{rows[-1]['step_peak_mib']:>10.1f} MiB peak"
                  f"{rows[-1]['state_mib']:>10.1f} MiB state", flush=True)
            del optimizer, params
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
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
    rows = step_rows(device, args.rounds)
    write_csv(ROOT / "results" / "gpu_check.csv", rows)
    compile_rows = measure_compile(COMPILE_SHAPES, device, torch.bfloat16, args.rounds)
    for row in compile_rows:
        print(f"compile {row['matrices']:<14}eager {row['eager_ms']} ms, compiled {row['compiled_ms']} ms "
              f"({row['speedup']}×, compile {row['compile_s']} s)")
    write_csv(ROOT / "results" / "compile_cuda.csv", compile_rows)
    print("wrote results/gpu_check.csv and results/compile_cuda.csv")
    return status


if __name__ == "__main__":
    sys.exit(main())
