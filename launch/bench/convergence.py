"""Convergence at equal steps and tokens: every method, several learning rates and seeds, no link limit.

    python launch/bench/convergence.py                   # → results/convergence.csv, _best.csv, .png
    python launch/bench/convergence.py --steps 20 --lr-factors 1 --seeds 0 \\
        --csv results/convergence_smoke.csv              # a reduced-scale check

    python launch/bench/convergence.py --seeds 0 --best-seeds 1   # 3 lrs at seed 0, the best lr also at seed 1
    python launch/bench/convergence.py --methods ddp_adamw --lr-factors 1 --nonmatrix-lrs 0.01 0.03   # scalar lrs
    python launch/bench/convergence.py --methods signmuon_lion --lr-factors 0.5 --ns-steps 1 2 3 5 \
        --ns-coefficients quintic polar_express --csv results/polar_convergence.csv   # Newton–Schulz variants

Each run: torchrun --standalone with 2 × 2 ranks (two "nodes" of two ranks on this machine):
shardopt's methods on a (replicate 2, shard 2) mesh, the DDP ones on 4 ranks with 2 ranks per node
(so their bytes between the two groups of ranks count as replicate bytes). Learning rates: each
method's default × --lr-factors for the 2-D weights, and --nonmatrix-lrs (default: the method's own) for
the embeddings, tied head and norms (signsgd has one lr for everything: no scalar lr). Every method
sees the same batches (same seed → same data). --ns-steps / --ns-coefficients run each chosen Sign-Muon
method once per (steps, schedule), labelled e.g. signmuon_lion_ns2_polar_express (runs.polar_variant).
A run whose folder under --runs-dir holds a finished run of the same command is read back, not rerun
(slowlink.py keeps its own runs: its step times come from a machine doing nothing else).

    results/convergence.csv       method, lr, scalar_lr, seed, steps, final_val_loss, replicate_bytes_total
                                  (bytes one rank sent between nodes over the whole run)
    results/convergence_best.csv  per method the (lr, scalar_lr) with the lowest mean final val loss over seeds
    results/convergence_curves.csv  method, lr, scalar_lr, seed, step, val_loss, replicate_bytes: the
                                  anytime curve of every run, from which the PNG is drawn
    results/convergence.png       val loss vs step and vs replicate bytes, each method at its best lr

The CSVs are updated, not replaced: a campaign's runs replace the rows of the same (method, lr, scalar_lr, seed)
and the others stay, so a grid can be widened later (e.g. --methods ddp_adamw --lr-factors 0.25) and
the best lr is chosen over everything in the file. A best lr whose curve is not in the curves file
(a row from before it existed) is left out of the PNG, or with --rerun-for-curves run once more for its
curve (the runs are deterministic).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import campaign
import runs
from integrations import training   # (the renamed option)

BEST_FIELDS = ["method", "lr", "scalar_lr", "seeds", "final_val_loss_mean", "final_val_loss_min", "final_val_loss_max",
               "replicate_bytes_total"]
CURVE_FIELDS = ["method", "lr", "scalar_lr", "seed", "step", "val_loss", "replicate_bytes"]
CURVE_KEY = (*runs.RUN_KEY, "step")


def best_table(rows: list[dict]) -> list[dict]:
    """Per method (in first-seen order), the (lr, scalar_lr) with the lowest mean final val loss over the
    seeds every setting of that method ran (so a seed run only at the best, --best-seeds, does not change
    the choice); its statistics are over all its seeds."""
    by: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        by.setdefault((row["method"], row["lr"], row["scalar_lr"]), []).append(row)
    common: dict[str, set] = {}
    for (method, *_), group in by.items():
        seeds = {str(r["seed"]) for r in group}       # (read back from a CSV, a seed is a string)
        common[method] = common[method] & seeds if method in common else seeds

    def score(method: str, group: list[dict]) -> float:
        return statistics.mean(float(r["final_val_loss"]) for r in group if str(r["seed"]) in common[method])

    best: dict[str, list[dict]] = {}
    for (method, *_), group in by.items():
        if method not in best or score(method, group) < score(method, best[method]):
            best[method] = group
    table = []
    for method, group in best.items():
        losses = [float(r["final_val_loss"]) for r in group]
        table.append({"method": method, "lr": group[0]["lr"], "scalar_lr": group[0]["scalar_lr"], "seeds": len(group),
                      "final_val_loss_mean": f"{statistics.mean(losses):.4f}", "final_val_loss_min": f"{min(losses):.4f}",
                      "final_val_loss_max": f"{max(losses):.4f}", "replicate_bytes_total": group[0]["replicate_bytes_total"]})
    return table


def setting(entry: dict) -> tuple[str, str, str]:
    """A row's (method, lr, scalar_lr): one point of a method's grid."""
    return entry["method"], entry["lr"], entry["scalar_lr"]


def plot(curves: dict, best: list[dict], path: Path) -> None:
    """curves: (method, lr, scalar_lr, seed) → [(step, val loss, bytes so far)]; each best entry at its first seed."""
    from integrations.plot import colour, panels, save   # matplotlib (the train extra): only to draw
    figure, (by_step, by_bytes) = panels(1, 2, figsize=(11, 4))
    for index, entry in enumerate(best):
        color = colour(index)
        curve = curves[(*setting(entry), min(key[-1] for key in curves if key[:-1] == setting(entry)))]
        label = f"{entry['method']} (lr {entry['lr']}" + (f", scalar {entry['scalar_lr']})" if entry["scalar_lr"] else ")")
        by_step.plot([c[0] for c in curve], [c[1] for c in curve], marker=".", label=label, color=color)
        trained = [c for c in curve if c[0] > 0]                    # (step 0 sent nothing: no place on a log axis)
        by_bytes.plot([c[2] for c in trained], [c[1] for c in trained], marker=".", label=label, color=color)
    by_step.set(xlabel="step", ylabel="val loss", title="val loss vs step (best lr, first seed)")
    by_bytes.set(xlabel="replicate bytes sent by one rank", ylabel="val loss", xscale="log", title="val loss vs bytes")
    by_step.legend(fontsize=7)
    save(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=None, help="labels (default: all)")
    parser.add_argument("--lr-factors", nargs="+", type=float, default=[0.5, 1.0, 2.0])
    training.add_renamed(parser, "--nonmatrix-lrs", "--scalar-lrs", nargs="+", type=float, default=None,
                         help="lrs of the embeddings, head and norms (default: each method's own; not for signsgd)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--best-seeds", nargs="*", type=int, default=[],
                        help="more seeds, run only at each method's best setting over --seeds (a cheaper second seed)")
    parser.add_argument("--rerun-for-curves", action="store_true",
                        help="run a best setting whose curve is not in the curves CSV again, for the PNG")
    runs.add_polar_arguments(parser)
    runs.add_model_arguments(parser)
    parser.add_argument("--run-timeout", type=float, default=3600.0)
    parser.add_argument("--runs-dir", type=Path, default=runs.LOCAL_RUNS, help="one folder per run (reused when finished)")
    parser.add_argument("--csv", type=Path, default=campaign.ROOT / "results" / "convergence.csv")
    args = parser.parse_args()
    chosen = runs.select(runs.methods(args.n_embd), args.methods)
    chosen = runs.polar_variants(chosen, args) or chosen
    model = runs.model_args(args)
    print(f"convergence: vocabulary {args.tokenizer}; 2 × 2 ranks; {args.steps} steps; "
          f"{len(chosen)} methods × {len(args.lr_factors)} lrs × {len(args.nonmatrix_lrs or [None])} scalar lrs × "
          f"seeds {args.seeds}" + (f", seeds {args.best_seeds} at the best setting" if args.best_seeds else ""), flush=True)
    finals = campaign.Campaign(args.csv, runs.CONVERGENCE_FIELDS, runs.RUN_KEY)
    curves = campaign.Campaign(args.csv.with_name(args.csv.stem + "_curves.csv"), CURVE_FIELDS, CURVE_KEY)

    def train(method: runs.Method, lr: str, scalar_lr: str, seed: int) -> None:
        """One run of the grid (read back if finished) → its row and its curve's rows."""
        scalar = float(scalar_lr) if scalar_lr else None
        out = runs.local_run_dir(args.runs_dir, method, float(lr), scalar, seed, 2)
        command = method.command(float(lr), scalar, seed, out, model, 2, 2)
        if not finals.attempt(f"{method.name} lr {lr} scalar lr {scalar_lr} seed {seed}", lambda: campaign.run_local(
                command, 4, out / "log.txt", args.run_timeout, reuse=True)):
            return
        summary = runs.summarize(runs.read_metrics(out))
        finals.add({"method": method.name, "lr": lr, "scalar_lr": scalar_lr, "seed": seed, "steps": summary.steps,
                    "final_val_loss": f"{summary.final_val_loss:.4f}",
                    "replicate_bytes_total": summary.replicate_bytes_total})
        curves.add(*({"method": method.name, "lr": lr, "scalar_lr": scalar_lr, "seed": seed, "step": step,
                      "val_loss": f"{loss:.6f}", "replicate_bytes": sent} for step, _, loss, sent in summary.curve),
                   show=False)

    for method in chosen:
        scalar_lrs = dict.fromkeys(method.scalar_lr_text(s) for s in args.nonmatrix_lrs or [None])
        for factor in args.lr_factors:
            for scalar_lr in scalar_lrs:
                for seed in args.seeds:
                    train(method, f"{method.lr * factor:g}", scalar_lr, seed)
        best = [e for e in best_table(finals.everything()) if e["method"] == method.name] if args.best_seeds else []
        for seed in args.best_seeds if best else []:
            train(method, best[0]["lr"], best[0]["scalar_lr"], seed)
    everything = finals.everything()
    best = best_table(everything)

    def curves_by_run() -> dict:
        found: dict = {}
        for r in curves.everything():
            found.setdefault((*setting(r), int(r["seed"])), []).append(
                (int(r["step"]), float(r["val_loss"]), int(r["replicate_bytes"])))
        return found

    by_name = {m.name: m for m in [*runs.methods(args.n_embd), *chosen]}
    with_curve = {key[:-1] for key in curves_by_run()}
    for entry in best:
        if setting(entry) not in with_curve:
            seed = min(int(r["seed"]) for r in everything if setting(r) == setting(entry))
            if not args.rerun_for_curves:
                print(f"{entry['method']} lr {entry['lr']} scalar lr {entry['scalar_lr']}: no curve in {curves.path.name}, "
                      f"not in the PNG (--rerun-for-curves runs seed {seed} again for it)", flush=True)
                continue
            print(f"{entry['method']} lr {entry['lr']} scalar lr {entry['scalar_lr']}: no curve in {curves.path.name}; "
                  f"running seed {seed} again for it",
                  flush=True)
            train(by_name[entry["method"]], entry["lr"], entry["scalar_lr"], seed)
    best_csv = args.csv.with_name(args.csv.stem + "_best.csv")
    campaign.write_csv(best_csv, BEST_FIELDS, best)
    campaign.print_table(best)
    png = args.csv.with_suffix(".png")
    drawn = {key: curve for key, curve in curves_by_run().items() if any(setting(e) == key[:-1] for e in best)}
    plot(drawn, [e for e in best if any(setting(e) == key[:-1] for key in drawn)], png)
    print(f"wrote {args.csv} ({len(finals.rows)} runs of this campaign, {len(everything) - len(finals.rows)} kept), "
          f"{best_csv}, {curves.path.name} and {png}")
    finals.finish("--runs-dir")


if __name__ == "__main__":
    main()
