"""overlap_backward off and on, side by side (issue 27 item 1; docs/design.md §12): the step time of
dion_1/4 and signmuon_lion (launch/bench/runs.py's methods and benchmark model) on 2 replicas, no
link limit, and `opt_step_ms`, the time from the end of backward to the end of step() (the part of
the exchange that is not hidden behind backward).

    python launch/bench/overlap_backward.py [--rounds 3] [--steps 30] [--tokenizer byte]

Each round runs every (method, overlap) pair once, in an interleaved order, through torchrun on
integrations/fsdp/train.py (--replicate 2, one rank per replica, gloo on the CPU); a row is the median
over rounds of each run's mean step (train.py's summary.json). Prints the table and writes
results/overlap_backward.csv.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from campaign import ROOT
from integrations.results import write_csv
from runs import add_model_arguments, methods, model_args

FIELDS = ["method", "overlap_backward", "ranks", "rounds", "step_ms", "opt_step_ms", "step_ratio_on_off"]


def run(method, overlap: str, args, out_dir: Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               *method.command(method.lr, None, 0, out_dir, model_args(args), nodes=2, procs_per_node=1),
               "--overlap-backward", overlap]
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return json.loads((out_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--csv", type=Path, default=ROOT / "results" / "overlap_backward.csv")
    add_model_arguments(parser)
    parser.set_defaults(steps=30, eval_every=1000, warmup=5)
    args = parser.parse_args()
    chosen = [m for m in methods(args.n_embd) if m.name in ("dion_1/4", "signmuon_lion")]
    times: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            pairs = [(m, o) for m in chosen for o in ("off", "on")]
            for method, overlap in pairs if round_ % 2 == 0 else pairs[::-1]:
                summary = run(method, overlap, args, Path(tmp) / f"{round_}-{method.name.replace('/', '_')}-{overlap}")
                times.setdefault((method.name, overlap), []).append((summary["step_ms"], summary["opt_step_ms"]))
    rows = []
    for method in chosen:
        off_step = statistics.median(step for step, _ in times[(method.name, "off")])
        for overlap in ("off", "on"):
            step_ms = statistics.median(step for step, _ in times[(method.name, overlap)])
            rows.append({"method": method.name, "overlap_backward": overlap, "ranks": 2, "rounds": args.rounds,
                         "step_ms": round(step_ms, 1),
                         "opt_step_ms": round(statistics.median(opt for _, opt in times[(method.name, overlap)]), 1),
                         "step_ratio_on_off": round(step_ms / off_step, 3)})
    write_csv(args.csv, FIELDS, rows)
    print(" | ".join(FIELDS))
    for row in rows:
        print(" | ".join(str(row[field]) for field in FIELDS))


if __name__ == "__main__":
    main()
