"""Optimizer step time and memory per matrix, side by side in one interleaved run.

    python launch/bench/step_time.py                     # CPU fp32 → results/step_time.csv
    python launch/bench/step_time.py --device cuda       # rows tagged with the GPU's name
    bash launch/bench/step_time_gpu.sh                   # the prepared GPU run (skips without CUDA)

Matrices: one GPT-2-small layer's {attn.qkv 2304×768, attn.proj 768×768, mlp.fc 3072×768,
mlp.proj 768×3072} and a square 2048×2048, fp32 parameters, one process (no exchange: this measures
the compute and memory each optimizer adds). Every round runs one step of every (optimizer, matrix)
in turn, so machine noise hits all alike; the table gives the median over --rounds (≥ 20 by default)
and the ratio to fp32 Muon's median on the same matrix from the same run (Newton–Schulz in the
dtype named; on CPU bf16 matmuls are ~30× slower, so CPU rows use fp32).

Memory: `state_bytes` are the optimizer state tensors of that matrix (momentum, Dion's Q, Adam's
moments); `peak_step_bytes` is the step's transient peak above what was allocated before it
(torch.cuda.max_memory_allocated; CUDA only — the CPU allocator keeps no such statistic, so the
column is empty on CPU). Writes results/step_time.csv (--csv).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import shardopt
from integrations.results import device_name, write_csv

SHAPES = {"attn.qkv": (2304, 768), "attn.proj": (768, 768), "mlp.fc": (3072, 768), "mlp.proj": (768, 3072),
          "square": (2048, 2048)}
BASELINE = "muon (fp32 Newton–Schulz)"


def optimizers(device: torch.device) -> dict:
    """Label → builder of a one-matrix optimizer. Sign-Muon and Dion use their defaults for the device."""
    ns = "bf16" if device.type == "cuda" else "fp32"
    return {
        "adamw": lambda p: shardopt.Dion([{"params": [p], "algorithm": "adamw", "lr": 1e-3}]),
        BASELINE: lambda p: shardopt.Dion([{"params": [p], "algorithm": "muon", "lr": 0.02, "ns_dtype": "float32"}]),
        "dion rank 1/4": lambda p: shardopt.Dion([p], lr=0.01, rank_fraction=0.25),
        "dion rank 1/16": lambda p: shardopt.Dion([p], lr=0.01, rank_fraction=1 / 16),
        f"sign-muon ({ns} Newton–Schulz)": lambda p: shardopt.SignMuon([p], lr=1e-3),
    }


def state_bytes(optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for k, v in state.items()
               if isinstance(v, torch.Tensor) and k != "step")


def timed_step(optimizer, device: torch.device) -> tuple[float, int | None]:
    """(seconds, transient peak bytes above the allocation before the step, or None off CUDA)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    optimizer.step()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return seconds, (torch.cuda.max_memory_allocated(device) - before) if cuda else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds (the median is over these)")
    parser.add_argument("--matrices", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--csv", type=Path, default=Path(__file__).resolve().parents[2] / "results" / "step_time.csv")
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    setups = {}
    for matrix in args.matrices:
        for name, build in optimizers(device).items():
            param = torch.nn.Parameter(torch.randn(*SHAPES[matrix], generator=generator).to(device))
            param.grad = torch.randn(param.shape, generator=generator).to(device)
            setups[(name, matrix)] = build(param)
    times = {key: [] for key in setups}
    peaks = {key: [] for key in setups}
    for round_index in range(args.rounds + 1):           # round 0 warms up (state init, kernels)
        for key, optimizer in setups.items():
            seconds, peak = timed_step(optimizer, device)
            if round_index:
                times[key].append(seconds)
                peaks[key].append(peak)
    name = device_name(device)
    print(f"optimizer step time and memory per matrix, {name}, median of {args.rounds} interleaved rounds")
    print(f"{'optimizer':<32}{'matrix':<20}{'median ms':>10}{'vs muon':>9}{'state MB':>10}{'peak MB':>9}")
    rows = []
    for (label, matrix), samples in times.items():
        median = statistics.median(samples)
        baseline = statistics.median(times[(BASELINE, matrix)])
        state = state_bytes(setups[(label, matrix)])
        peak = None if peaks[(label, matrix)][0] is None else max(peaks[(label, matrix)])
        shape = "×".join(map(str, SHAPES[matrix]))
        rows.append({"optimizer": label, "matrix": matrix, "shape": shape, "device": name, "rounds": args.rounds,
                     "median_ms": round(median * 1e3, 3), "min_ms": round(min(samples) * 1e3, 3),
                     "vs_muon_fp32": round(median / baseline, 3),
                     "state_bytes": state, "state_vs_muon_fp32": round(state / state_bytes(setups[(BASELINE, matrix)]), 3),
                     "peak_step_bytes": "" if peak is None else peak})
        print(f"{label:<32}{matrix + ' ' + shape:<20}{median * 1e3:>10.1f}{median / baseline:>8.2f}×"
              f"{state / 1e6:>10.2f}{'' if peak is None else f'{peak / 1e6:.2f}':>9}")
    write_csv(args.csv, list(rows[0]), rows)
    print(f"wrote {args.csv}; rerun: python launch/bench/step_time.py --rounds {args.rounds} --device {args.device}")


if __name__ == "__main__":
    main()
