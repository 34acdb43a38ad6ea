"""Quality of the non-matrix optimizer with a real vocabulary: AdamW (full-precision gradient mean)
vs Lion (1-bit majority vote) for the embeddings, norms and tied head, under Dion and Sign-Muon.

    python integrations/data.py --tokenizer bpe      # once
    python launch/bench/nonmatrix_quality.py         # ~20 torchrun runs of 4 CPU processes (~1 h on 2 cores)

The GPT of integrations/fsdp/train.py on BPE-4096 Shakespeare (the tied embedding/head is 40 % of
its 1.3 M parameters), 2 replicas × 2 FSDP2 shards, equal steps and tokens for every run. Protocol:
four non-matrix learning rates (half-decades) per (matrix optimizer, non-matrix algorithm) at seed 0;
the best of them (lowest final val loss) is run again at seed 1; results/scalar_quality.csv reports
per (matrix optimizer, non-matrix algorithm) every lr's seed-0 loss, the best lr's two seeds, their
mean and the ratio to AdamW's mean. A finished run in runs/scalar_quality/ is reused (an interrupted sweep resumes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from integrations.results import write_csv

ROOT = Path(__file__).resolve().parents[2]
SCALAR_LRS = {"adamw": (3e-3, 1e-2, 3e-2, 1e-1), "lion": (1e-3, 3e-3, 1e-2, 3e-2)}
MATRIX = ("signmuon", "dion")


def run(args, optimizer: str, scalar: str, lr: float, seed: int) -> dict:
    """One training run's summary (train.py's summary.json); a finished run of the same settings in
    --out is reused, so an interrupted sweep resumes."""
    betas = args.lion_betas if scalar == "lion" else (0.9, 0.95)
    out = args.out / f"{optimizer}-{scalar}-{lr:g}-s{seed}-{args.steps}x{args.batch_size}" \
        f"{'' if tuple(betas) == (0.9, 0.95) else '-b' + '-'.join(map(str, betas))}"
    if (out / "summary.json").exists():
        return json.loads((out / "summary.json").read_text())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               str(ROOT / "integrations/fsdp/train.py"), "--replicate", "2", "--shard", "2", "--optimizer", optimizer,
               "--nonmatrix-algorithm", scalar, "--nonmatrix-lr", str(lr), "--seed", str(seed), "--tokenizer", "bpe",
               "--rank-fraction", "0.25", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--eval-every", str(args.steps), "--eval-batches", "16", "--log-every", str(args.steps),
               "--check-replicas-every", str(args.steps), "--nonmatrix-betas", *map(str, betas), "--out-dir", str(out)]
    print(f"== {optimizer} + {scalar} (lr {lr:g}), seed {seed}", flush=True)
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/scalar_quality")
    parser.add_argument("--csv", type=Path, default=ROOT / "results/scalar_quality.csv")
    parser.add_argument("--lion-betas", type=float, nargs=2, default=(0.9, 0.95), help="Lion's (β₁, β₂); AdamW "
                        "keeps (0.9, 0.95)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = []
    for optimizer in MATRIX:
        best = {}
        for scalar, lrs in SCALAR_LRS.items():
            runs = {lr: run(args, optimizer, scalar, lr, 0) for lr in lrs}
            lr = min(runs, key=lambda lr: runs[lr]["final_val_loss"])
            first, second = runs[lr]["final_val_loss"], run(args, optimizer, scalar, lr, 1)["final_val_loss"]
            best[scalar] = {"matrix_optimizer": optimizer, "scalar_algorithm": scalar,
                            "scalar_betas": " ".join(map(str, args.lion_betas if scalar == "lion" else (0.9, 0.95))),
                            "best_scalar_lr": lr,
                            "val_loss_seed0": round(first, 4), "val_loss_seed1": round(second, 4),
                            "mean_val_loss": round((first + second) / 2, 4), "steps": runs[lr]["steps"],
                            "tokens": runs[lr]["tokens"], "replicate_bytes_per_step": runs[lr]["replicate_bytes_per_step"],
                            "lrs_tried": " ".join(f"{lr:g}:{r['final_val_loss']:.4f}" for lr, r in runs.items())}
        for row in best.values():
            summary.append(row | {"vs_adamw": round(row["mean_val_loss"] / best["adamw"]["mean_val_loss"], 4)})
    write_csv(args.csv, list(summary[0]), summary)
    print(args.csv.read_text())
    print(f"runs in {args.out}; rerun: python launch/bench/nonmatrix_quality.py --steps {args.steps}")


if __name__ == "__main__":
    main()
