"""What a checkpoint's momenta cost: quality and replicate-axis bytes of each --checkpoint-momenta choice,
side by side in one run (issue 39.1; docs/design.md §6).

    python launch/bench/checkpoint_momenta.py --data-dir .cache/data/shakespeare    # ~15 min on 2 busy cores

Runs integrations/fsdp/train.py under torchrun (2 CPU processes, gloo: 2 replicas × 1 shard), Sign-Muon with
Lion's vote on the non-matrix params, the byte-level GPT of integrations/gpt.json, --steps 200, seed 0, once
without checkpoints and once per way a checkpoint treats the replicas' decoupled momenta, saving every
--checkpoint-every 20 steps: "mean" (the exact fp32 mean), "sign_vote", "sign_mean" (1-bit agreements) and
"own" (each replica saves its own; nothing is sent and the training is not changed). Each row: the final val
loss, the bytes one rank sent per step and for all checkpoints (counted by shardopt's comm layer), and the
bytes of one checkpoint over those of one step. Writes results/checkpoint_momenta.csv (and prints it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from integrations.results import write_csv

ROOT = Path(__file__).resolve().parents[2]
CSV = ROOT / "results" / "checkpoint_momenta.csv"
MODES = ("none", "mean", "sign_vote", "sign_mean", "own")


def run(mode: str, args, out_dir: Path) -> dict:
    """One train.py run; its summary.json."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "integrations" / "fsdp" / "train.py"), "--data-dir", str(args.data_dir), "--replicate", "2",
               "--optimizer", "signmuon", "--nonmatrix-algorithm", "lion", "--steps", str(args.steps),
               "--out-dir", str(out_dir), "--checkpoint-every", "0" if mode == "none" else str(args.checkpoint_every),
               *(() if mode == "none" else ("--checkpoint-momenta", mode))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{mode}: train.py failed\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads((out_dir / "summary.json").read_text())


def row(mode: str, summary: dict, checkpoint_every: int) -> dict:
    saves = 0 if mode == "none" else summary["steps"] // checkpoint_every
    total = summary.get("checkpoint_bytes", 0)
    return {"checkpoint_momenta": mode, "steps": summary["steps"], "checkpoint_every": checkpoint_every if saves else "",
            "final_val_loss": f"{summary['final_val_loss']:.4f}",
            "step_bytes": summary["replicate_bytes_per_step"], "checkpoint_bytes_total": total,
            "bytes_per_checkpoint": total // saves if saves else "",
            "checkpoint_over_step": f"{total / saves / summary['replicate_bytes_per_step']:.3f}" if saves else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True, help="the prepared bytes (integrations/data.py)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for mode in args.modes:
            rows.append(row(mode, run(mode, args, Path(scratch) / mode), args.checkpoint_every))
            print(rows[-1], flush=True)
    write_csv(CSV, list(rows[0]), rows)
    print(f"wrote {CSV}; rerun: python launch/bench/checkpoint_momenta.py --data-dir {args.data_dir}")


if __name__ == "__main__":
    main()
