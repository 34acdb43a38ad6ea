"""The replicate-axis bytes docs/trainers.md quotes for Lightning and torchtitan, from a run.

    python launch/bench/trainer_bytes.py                  # ~1 min on 2 cores; writes results/trainers.csv
    python launch/results_table.py --readme README.md     # redraws docs/trainers.md's byte tables from it

Runs tests/lightning_scenarios.py and tests/torchtitan_scenarios.py under torchrun (2 CPU processes, gloo),
as tests/test_lightning.py and tests/test_torchtitan.py do (a tiny GPT, Sign-Muon + Lion-vote,
max_grad_norm 1.0, 6 steps, a save after step 3), and writes one row per (framework, layout): the
bytes one rank sent on the replicate axis at an ordinary step, at step 1 (which adds the double-averaging
check) and at the step after the save (which carries the momentum average), beside an fp32 all-reduce
of every parameter. Those tests compare their own run with this file, so a change of the bytes fails
there until this is rerun.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from integrations.results import write_csv
from tests.two_processes import run_scenarios   # the checkout's tests/ (a namespace package beside integrations/)

ROOT = Path(__file__).resolve().parents[2]
CSV = ROOT / "results" / "trainers.csv"
# (framework, the scenarios script in tests/, its results' keys → the layouts named in the docs)
SCENARIOS = [("lightning", "lightning_scenarios", {"ddp": "DDP",
                                                   "hsdp": "ModelParallelStrategy, HSDP (2 replicas × 1 shard)"}),
             ("torchtitan", "torchtitan_scenarios", {"hsdp": "HSDP (2 replicas × 1 shard)"})]


def figures(framework: str, layout: str, result: dict) -> dict:
    """One CSV row (strings, as csv.DictReader gives them back) from a scenario's result: its per-step
    replicate bytes, the step it saved after, its params and the fp32 all-reduce of them."""
    per_step, saved_after = result["bytes_per_step"], result["saved_after"]
    ordinary = {sent for step, sent in enumerate(per_step, 1) if step not in (1, saved_after + 1)}
    if len(ordinary) != 1:
        raise ValueError(f"{framework} {layout}: the ordinary steps sent different bytes: {per_step}")
    row = {"framework": framework, "layout": layout, "params": result["params"], "steps": len(per_step),
           "fp32_all_reduce_bytes": result["fp32_all_reduce_bytes"], "step_bytes": ordinary.pop(),
           "first_step_bytes": per_step[0], "after_save_step": saved_after + 1,
           "after_save_bytes": per_step[saved_after]}
    return {key: str(value) for key, value in row.items()}


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for framework, scenarios, layouts in SCENARIOS:
            print(f"trainer_bytes: {scenarios} on 2 processes", flush=True)
            (Path(directory) / scenarios).mkdir()
            ranks = run_scenarios(scenarios, Path(directory) / scenarios)
            for key, layout in layouts.items():
                row, other = (figures(framework, layout, rank[key]) for rank in ranks)
                if row != other:
                    raise SystemExit(f"{framework} {layout}: the two ranks' bytes differ: {row} vs {other}")
                rows.append(row)
                print(", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    write_csv(CSV, list(rows[0]), rows)
    print(f"trainer_bytes: wrote {CSV.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
