"""Quality of the non-matrix optimizer with a real vocabulary: AdamW (full-precision gradient mean)
vs Lion (1-bit majority vote) for the embeddings, norms and tied head, under Dion and Sign-Muon.

    python integrations/data.py --tokenizer bpe      # once
    python launch/bench_scalar_quality.py            # ~16 torchrun runs of 4 CPU processes

The GPT of integrations/fsdp/train.py on BPE-4096 Shakespeare (the tied embedding/head is 40 % of
its 1.3 M parameters), 2 replicas × 2 FSDP2 shards, equal steps and tokens for every run. Protocol:
three scalar learning rates per (matrix optimizer, scalar algorithm) at seed 0; the best of them
(lowest final val loss) is run again at seed 1; the table reports the best lr's mean over the two
seeds and Lion's ratio to AdamW. Every run's row goes to results/scalar_quality.csv (all lrs,
seeds), the summary to stdout. Rerun a smaller version with --steps 50.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCALAR_LRS = {"adamw": (1e-3, 3e-3, 1e-2), "lion": (1e-4, 3e-4, 1e-3)}
MATRIX = ("signmuon", "dion")


def run(args, optimizer: str, scalar: str, lr: float, seed: int, rows_csv: Path) -> dict:
    out = args.out / f"{optimizer}-{scalar}-{lr:g}-s{seed}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               str(ROOT / "integrations/fsdp/train.py"), "--replicate", "2", "--shard", "2", "--optimizer", optimizer,
               "--scalar-algorithm", scalar, "--scalar-lr", str(lr), "--seed", str(seed), "--tokenizer", "bpe",
               "--rank-fraction", "0.25", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--eval-every", str(args.steps), "--eval-batches", "16", "--log-every", str(args.steps),
               "--check-replicas-every", str(args.steps), "--out-dir", str(out), "--summary-csv", str(rows_csv)]
    print(f"== {optimizer} + {scalar} (lr {lr:g}), seed {seed}", flush=True)
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    with rows_csv.open() as f:
        return list(csv.DictReader(f))[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/scalar_quality")
    parser.add_argument("--csv", type=Path, default=ROOT / "results/scalar_quality.csv")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows_csv = args.out / "runs.csv"
    rows_csv.unlink(missing_ok=True)
    summary = []
    for optimizer in MATRIX:
        best = {}
        for scalar, lrs in SCALAR_LRS.items():
            losses = {lr: float(run(args, optimizer, scalar, lr, 0, rows_csv)["final_val_loss"]) for lr in lrs}
            lr = min(losses, key=losses.get)
            second = float(run(args, optimizer, scalar, lr, 1, rows_csv)["final_val_loss"])
            best[scalar] = (lr, (losses[lr] + second) / 2, losses[lr], second)
        for scalar, (lr, mean, first, second) in best.items():
            summary.append({"matrix_optimizer": optimizer, "scalar_algorithm": scalar, "best_scalar_lr": lr,
                            "val_loss_seed0": round(first, 4), "val_loss_seed1": round(second, 4),
                            "mean_val_loss": round(mean, 4),
                            "vs_adamw": round(mean / best["adamw"][1], 4)})
    with rows_csv.open() as f:
        rows = list(csv.DictReader(f))
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, list(summary[0]) + ["steps", "tokens", "replicate_bytes_per_step", "lrs_tried"])
        writer.writeheader()
        for row in summary:
            runs = [r for r in rows if r["optimizer"] == row["matrix_optimizer"] and r["scalar_algorithm"] == row["scalar_algorithm"]]
            writer.writerow(row | {"steps": runs[0]["steps"], "tokens": runs[0]["tokens"],
                                   "replicate_bytes_per_step": runs[0]["replicate_bytes_per_step"],
                                   "lrs_tried": " ".join(f"{float(r['scalar_lr']):g}:{float(r['final_val_loss']):.4f}"
                                                         for r in runs if r["seed"] == "0")})
    print(args.csv.read_text())
    print(f"all runs: {rows_csv}; rerun: python launch/bench_scalar_quality.py --steps {args.steps}")


if __name__ == "__main__":
    main()
