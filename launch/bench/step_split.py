"""Where the optimizer step's time goes, per method, on the benchmark GPT (issue 27: the split of the step).

    python launch/bench/step_split.py [--methods ddp_adamw signmuon_lion signmuon dion_1/4] [--ns-steps 3 …]

Each method (launch/bench/runs.py's, with --ns-steps/--ns-coefficients Sign-Muon variants as in
slowlink.py) runs once through torchrun on its training script, 2 replicas of one rank each (gloo, this
machine, no link limit), `--steps` steps; rank 0 profiles the optimizer step of the last `--profile`
steps (--profile-optimizer, integrations/step_profile.py) and the other steps give the unprofiled median
step and optimizer-step times (metrics.csv; the DDP script logs no optimizer time: its AdamW step is
measured only by the profile). The ops are summed into categories (`category`; a record_function scope's
own time, such as torch.optim's "Optimizer.step#SignMuon.step", is Python), and each category's share
is of the profiled optimizer step. Prints the table and writes results/step_split.csv:

    method, step_ms            median step (forward, backward, optimizer) of the unprofiled steps
    opt_step_ms                median optimizer step of the unprofiled steps (empty for the DDP script)
    category, ms_per_step      self CPU time of the category's ops per profiled step
    share                      of the profiled optimizer step's wall time
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from campaign import ROOT, print_table, run_local
from integrations.results import read_csv, read_metrics, write_csv
from integrations.step_profile import OUTSIDE, PROFILE_CSV
from runs import (add_model_arguments, add_polar_arguments, methods, model_args, newton_schulz_optimizer, polar_variants,
                  select)

FIELDS = ["method", "step_ms", "opt_step_ms", "category", "ms_per_step", "share"]
DEFAULT_METHODS = ["ddp_adamw", "signmuon_lion", "signmuon", "dion_1/4"]
MATMUL = {"aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmm", "aten::addbmm", "aten::matmul"}
# (the tie coins are an integer hash since issue 43: their shifts and xors count here, no longer as random numbers)
SIGN_BITS = {"aten::gt", "aten::lt", "aten::ge", "aten::le", "aten::eq", "aten::ne", "aten::bitwise_and",
             "aten::bitwise_and_", "aten::bitwise_or", "aten::bitwise_or_", "aten::bitwise_xor", "aten::bitwise_xor_",
             "aten::bitwise_not", "aten::__lshift__", "aten::__rshift__", "aten::bitwise_left_shift",
             "aten::bitwise_right_shift", "aten::index_select", "aten::masked_fill_", "aten::sign", "aten::any",
             "aten::all"}
MEMORY = {"aten::copy_", "aten::_to_copy", "aten::to", "aten::cat", "aten::stack", "aten::clone", "aten::zeros",
          "aten::zeros_like", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::fill_", "aten::zero_",
          "aten::new_zeros", "aten::new_empty", "aten::full", "aten::ones", "aten::arange", "aten::contiguous",
          "aten::resize_"}
VIEWS = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::select", "aten::slice", "aten::transpose",
         "aten::t", "aten::as_strided", "aten::expand", "aten::alias", "aten::unbind", "aten::detach",
         "aten::unsqueeze", "aten::squeeze", "aten::split", "aten::chunk", "aten::narrow", "aten::lift_fresh",
         "aten::permute", "aten::flatten", "aten::unflatten", "aten::view_as", "aten::result_type"}
CATEGORIES = ["matmul (Newton–Schulz, power iteration)", "QR, Cholesky, solves", "collectives (issuing them)",
              "coins (random numbers for ties, abstentions)", "signs: compare, pack, unpack, count",
              "copies, casts, allocation", "views (no data moved)", "element-wise math (momentum, update, norms)",
              "Python (outside any op), waiting for the other rank, the profiler"]


def category(op: str) -> str:
    """The category (CATEGORIES) of a torch.profiler op name, or of step_profile's OUTSIDE row."""
    if op == OUTSIDE or not op.startswith(("aten::", "c10d::", "gloo:", "nccl:")):
        return CATEGORIES[8]      # a record_function scope's own time (torch.optim's "Optimizer.step#…"): Python
    if op in MATMUL:
        return CATEGORIES[0]
    if op.startswith("aten::linalg_") or op in ("aten::cholesky", "aten::geqrf", "aten::orgqr", "aten::triangular_solve"):
        return CATEGORIES[1]
    if not op.startswith("aten::"):
        return CATEGORIES[2]
    if "rand" in op or op == "aten::bernoulli_":
        return CATEGORIES[3]
    if op in SIGN_BITS:
        return CATEGORIES[4]
    if op in MEMORY:
        return CATEGORIES[5]
    if op in VIEWS:
        return CATEGORIES[6]
    return CATEGORIES[7]


def split(profile: list[dict]) -> dict[str, float]:
    """ms per profiled step of each category, from an optimizer_profile.csv's rows."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for row in profile:
        totals[category(row["op"])] += float(row["ms_per_step"])
    return totals


def medians(metrics: list[dict], profiled_from: int) -> tuple[float, float | None]:
    """Median step_ms and opt_step_ms of the logged steps before the profiled ones, the first 5 left out."""
    rows = [r for r in metrics if r["step_ms"] and 5 < int(r["step"]) < profiled_from]
    opt = [float(r["opt_step_ms"]) for r in rows if r.get("opt_step_ms")]
    return statistics.median(float(r["step_ms"]) for r in rows), statistics.median(opt) if opt else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    parser.add_argument("--profile", type=int, default=20, help="profiled steps at the end of each run")
    parser.add_argument("--csv", type=Path, default=ROOT / "results" / "step_split.csv")
    add_model_arguments(parser)
    add_polar_arguments(parser)
    parser.set_defaults(steps=60, eval_every=1000)
    args = parser.parse_args()
    if not 0 < args.profile <= args.steps - 12:
        parser.error(f"--profile {args.profile}: leave at least 12 of the {args.steps} steps unprofiled")
    chosen = select(methods(args.n_embd), args.methods)
    chosen += polar_variants([m for m in chosen if newton_schulz_optimizer(m)], args)
    first = args.steps - args.profile + 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in chosen:
            out_dir = Path(tmp) / method.name.replace("/", "_")
            argv = [*method.command(method.lr, None, 0, out_dir, model_args(args), nodes=2, procs_per_node=1),
                    "--profile-optimizer", str(first), str(args.steps)]
            run_local(argv, 2, out_dir / "log.txt", timeout_s=1800)
            step_ms, opt_step_ms = medians(read_metrics(out_dir), first)
            profiled = split(read_csv(out_dir / PROFILE_CSV))
            wall = sum(profiled.values())
            for name, ms in profiled.items():
                rows.append({"method": method.name, "step_ms": f"{step_ms:.1f}",
                             "opt_step_ms": "" if opt_step_ms is None else f"{opt_step_ms:.1f}", "category": name,
                             "ms_per_step": f"{ms:.2f}", "share": f"{ms / wall:.3f}"})
    write_csv(args.csv, FIELDS, rows)
    print_table(rows)
    print(f"wrote {args.csv}; rerun: python launch/bench/step_split.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
