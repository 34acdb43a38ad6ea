"""Optimizer step time, side by side in one run, on one GPT-2-small layer's matrices.

    python launch/bench_step.py                  # CPU fp32 (or CUDA if available), 7 rounds
    python launch/bench_step.py --rounds 15 --layers 2 --device cuda

Matrices: {attn.qkv 2304×768, attn.proj 768×768, mlp.fc 3072×768, mlp.proj 768×3072} per layer,
fp32, one process (no exchange: this measures the compute each optimizer adds). Each round runs
one step of every optimizer in turn (so machine noise hits all alike); the table gives the median
over rounds and the ratio to AdamW's median from the same run. Writes results/step_time.csv.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import shardopt

from results_table import write_csv

SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072)]
OPTIMIZERS = {
    "adamw": lambda params: shardopt.Dion([{"params": params, "algorithm": "adamw", "lr": 1e-3}]),
    "muon (fp32 Newton–Schulz)": lambda params: shardopt.Dion([{"params": params, "algorithm": "muon", "lr": 0.02,
                                                               "ns_dtype": "float32"}]),
    "dion rank 1/4": lambda params: shardopt.Dion(params, lr=0.01, rank_fraction=0.25),
    "dion rank 1/16": lambda params: shardopt.Dion(params, lr=0.01, rank_fraction=1 / 16),
    "sign-muon": lambda params: shardopt.SignMuon(params, lr=1e-3, ns_dtype="float32"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--csv", default=str(Path(__file__).resolve().parents[1] / "results" / "step_time.csv"))
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    setups = {}
    for name, build in OPTIMIZERS.items():
        params = [torch.nn.Parameter(torch.randn(*shape, generator=generator).to(device))
                  for _ in range(args.layers) for shape in SHAPES]
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(device)
        setups[name] = build(params)
    times = {name: [] for name in setups}
    for round_index in range(args.rounds + 1):           # round 0 warms up (state init, kernels)
        for name, optimizer in setups.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if round_index:
                times[name].append(time.perf_counter() - start)
    adamw = statistics.median(times["adamw"])
    rows = []
    entries = sum(m * n for m, n in SHAPES) * args.layers
    print(f"optimizer step time, {args.layers} layer(s) of GPT-2-small matrices ({entries:,} entries), "
          f"{device}, threads={torch.get_num_threads()}, median of {args.rounds} rounds")
    print(f"{'optimizer':<28}{'median ms':>12}{'min ms':>10}{'vs adamw':>10}")
    for name, samples in times.items():
        median = statistics.median(samples)
        rows.append({"optimizer": name, "device": str(device), "layers": args.layers, "rounds": args.rounds,
                     "median_ms": round(median * 1e3, 3), "min_ms": round(min(samples) * 1e3, 3),
                     "vs_adamw": round(median / adamw, 2)})
        print(f"{name:<28}{median * 1e3:>12.1f}{min(samples) * 1e3:>10.1f}{median / adamw:>9.2f}×")
    write_csv(args.csv, rows)
    print(f"wrote {args.csv}; rerun: python launch/bench_step.py --rounds {args.rounds} --layers {args.layers}")


if __name__ == "__main__":
    main()
