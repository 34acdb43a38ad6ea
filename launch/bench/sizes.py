"""The local-steps benchmark across model sizes (issue 42): the same data (BPE-4096 Shakespeare), schedule and
methods as localsteps.py, on 4 replicas × 1 rank (four emulated nodes of one rank each), at the GPT sizes of
integrations/model.SIZES (S: width 128, 4 layers, today's; M: width 256; L: width 512, 6 layers).

    python launch/bench/sizes.py --sizes S M --configs ddp_adamw local_muon_H30_sign_mean_b128 muloco_H30 \\
        local_muon_H30_topk --steps 200                        # the first campaign → results/sizes.csv

A config is one of localsteps.configs() with H ∈ {5, 10, 30, 40, 50, 100} (muloco_H30: Muon inside, int4 outside;
local_defaults: LocalSteps' defaults but sync_every 30); each runs at its own lr × --lr-factors, and at each
--outer-lrs × --outer-momenta (…_olr1_m0, as in localsteps.py).

    python launch/bench/sizes.py --sizes S --steps 400 --configs local_muon_H5_sign_mean_b128 \
        local_muon_H10_sign_mean_b128 local_muon_H30_sign_mean_b128 --outer-lrs 0.7 --outer-momenta 0
                                                               # the curve of val loss against H

Resume: a row already in the CSV (same size, method, lr, seed, steps) is not rerun (--rerun
runs it again); a finished run folder of the same arguments and code is read back (campaign.py).

    results/sizes.csv   size, params, method, inner, exchange, H, replicas, outer_lr, outer_momentum, lr,
                        scalar_lr, seed, steps, tokens, final_model (the model evaluated: "synced", or in rows run
                        before train.py's final sync existed, where H does not divide the steps, "rank 0's, N
                        local steps after the last sync"), final_val_loss, replicate_bytes_total (one rank's),
                        link_bytes_total (one node's on the link: localsteps.link_factor),
                        bytes_per_token_vs_ddp_fp32 (link bytes / ddp_adamw's at the same size and steps, its
                        best lr) and x_fewer_bytes (its inverse; blank without that row), compute_s (the run's
                        own step times, measured while the machine was shared)
    results/sizes.png   per size: val loss against link bytes per token at 200 steps, and against H (no
                        --configs: only redraw it)
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import campaign
import localsteps
import runs
from integrations.model import SIZES, GPTConfig, parameter_count
from integrations.results import horizon_family, method_picks, rows_by_horizon

FIELDS = ["size", "params", "method", "inner", "exchange", "H", "replicas", "outer_lr", "outer_momentum", "lr",
          "scalar_lr", "seed", "steps", "tokens", "final_model", "final_val_loss", "replicate_bytes_total",
          "link_bytes_total", "bytes_per_token_vs_ddp_fp32", "x_fewer_bytes", "compute_s"]
KEY = ("size", "method", "lr", "seed", "steps")
REPLICAS = 4            # 4 nodes × 1 rank
VOCAB = {"bpe": 4096, "byte": 256}
STYLES = ("--", "-.", ":")          # ddp_adamw's line at each step count of a size (against H)
HORIZONS = (5, 10, 30, 40, 50, 100)    # the local-steps configs' H (40, 50: ≥ 1000× fewer bytes at 200 steps)


def arrange(rows: list[dict]) -> list[dict]:
    """Link bytes and the ratio to ddp_adamw's at the same size and steps (its lowest final val loss)."""
    baselines: dict[tuple, dict] = {}
    for row in rows:
        key = (row["size"], str(row["steps"]))
        if row["method"] == localsteps.BASELINE and (
                key not in baselines or float(row["final_val_loss"]) < float(baselines[key]["final_val_loss"])):
            baselines[key] = row
    for row in rows:
        row["link_bytes_total"] = int(row["replicate_bytes_total"]) * localsteps.link_factor(row["method"], REPLICAS)
        baseline = baselines.get((row["size"], str(row["steps"])))
        if baseline is None:
            row["bytes_per_token_vs_ddp_fp32"] = row["x_fewer_bytes"] = ""
            continue
        ratio = row["link_bytes_total"] / (int(baseline["replicate_bytes_total"])
                                           * localsteps.link_factor(localsteps.BASELINE, REPLICAS))
        row["bytes_per_token_vs_ddp_fp32"] = f"{ratio:.6f}"
        row["x_fewer_bytes"] = f"{1 / ratio:.1f}" if ratio else "inf"
    order = {size: index for index, size in enumerate(SIZES)}
    rows = sorted(rows, key=lambda r: (order.get(r["size"], len(order)), int(r["steps"]), r["method"]))
    return [{field: row.get(field, "") for field in FIELDS} for row in rows]


def size_args(args, size: str) -> argparse.Namespace:
    """args with the model of `size` (n_embd, n_layer)."""
    return argparse.Namespace(**{**vars(args), **SIZES[size]})


def run_one(finals: campaign.Campaign, config: localsteps.Config, size: str, lr: float, seed: int, args) -> None:
    """One run (4 nodes × 1 rank) of config at size, lr and seed; its row into finals."""
    method, model = config.method, size_args(args, size)
    out = runs.local_run_dir(args.runs_dir / size / f"s{args.steps}", method, lr, None, seed, 1)
    command = method.command(lr, None, seed, out, runs.model_args(model), REPLICAS, 1)
    if not finals.attempt(f"{size} {method.name} lr {lr:g} seed {seed}", lambda: campaign.run_local(
            command, localsteps.RANKS, out / "log.txt", args.run_timeout, reuse=True)):
        return
    summary = runs.summarize(runs.read_metrics(out))
    params = parameter_count(GPTConfig(vocab_size=VOCAB[args.tokenizer], block_size=args.block_size,
                                       **SIZES[size]))
    finals.add({"size": size, "params": params, "method": method.name, "inner": config.inner,
                "exchange": config.exchange, "H": config.H, "replicas": REPLICAS,
                "outer_lr": "" if config.outer_lr is None else f"{config.outer_lr:g}",
                "outer_momentum": "" if config.outer_momentum is None else f"{config.outer_momentum:g}",
                "lr": f"{lr:g}", "scalar_lr": method.scalar_lr_text(None), "seed": seed, "steps": summary.steps,
                "tokens": summary.steps * args.batch_size * args.block_size * localsteps.RANKS,
                "final_model": "synced",       # train.py ends local steps with LocalSteps.sync_now (its bytes counted)
                "final_val_loss": f"{summary.final_val_loss:.4f}",
                "replicate_bytes_total": summary.replicate_bytes_total, "compute_s": f"{summary.curve[-1][1]:.1f}"})


def plot(rows: list[dict], path: Path, steps: int = 200) -> None:
    """A column per size: above, val loss against link bytes per token (/ DDP fp32's) at `steps` (the size's
    fewest steps where it has no run of `steps`), issue 42's methods a marker each (integrations.results.
    method_picks, the rows of docs/benchmarks.md's gap table; squares: every step), ddp_adamw's loss a dashed
    line; below, val loss against H at every step count of the size, a line per family of local-steps rows
    (horizon_family, and its steps), ddp_adamw's loss at each step count a line."""
    from integrations.plot import panels, save   # matplotlib (the train extra): only to draw
    measured = [r for r in rows if r["bytes_per_token_vs_ddp_fp32"]]
    sizes = list(dict.fromkeys(r["size"] for r in measured))
    if not sizes:
        return
    figure, axes = panels(2, len(sizes), figsize=(7 * len(sizes), 14), squeeze=False, layout="constrained")
    columns = []   # per size: its rows, the steps of its bytes panel, that panel's picks
    for size in sizes:
        mine = [r for r in measured if r["size"] == size]
        shown = steps if any(int(r["steps"]) == steps for r in mine) else min(int(r["steps"]) for r in mine)
        columns.append((mine, shown, method_picks([r for r in mine if int(r["steps"]) == shown])))
    palette = label_palette([picks for _, _, picks in columns])
    for column, (size, (mine, shown, picks)) in enumerate(zip(sizes, columns)):
        title = f"{size} ({int(mine[0]['params']) / 1e6:.2f} M params)"
        draw_bytes(axes[0, column], picks, palette, f"{title}, {shown} steps")
        draw_horizons(axes[1, column], localsteps.best_rows(mine), title)
    save(figure, path)


def label_palette(panels_labels: list) -> dict[str, int]:
    """A colour index per label, in order of first appearance over the panels: a label has one colour in every
    panel, whichever labels the others lack."""
    palette: dict[str, int] = {}
    for labels in panels_labels:
        for label in labels:
            palette.setdefault(label, len(palette))
    return palette


def draw_bytes(axis, picks: dict[str, dict], palette: dict[str, int], title: str) -> None:
    """Val loss against link bytes per token, a marker per row of `picks` (label → row; a row picked under
    several labels once, with all of them, in its first label's colour: `palette`), ddp_adamw a dashed line."""
    from integrations.plot import colour
    top = ceiling(list(picks.values()))
    shown: dict[int, tuple[dict, list[str]]] = {}   # each row once, with every label it was picked under
    for label, row in picks.items():
        shown.setdefault(id(row), (row, []))[1].append(label)
    for row, labels in shown.values():
        loss, names = float(row["final_val_loss"]), ", ".join(labels)
        if row["method"] == localsteps.BASELINE:
            axis.axhline(loss, color="black", linestyle="--", label=row["method"])
            continue
        name = names if names == row["method"] else f"{names}: {row['method']}"
        axis.scatter(float(row["bytes_per_token_vs_ddp_fp32"]), min(loss, top),
                     color=colour(2 * palette[labels[0]]),   # tab20's strong shades
                     marker="^" if loss > top else "s" if row["H"] == "0" else "o",
                     label=name + (f" ({loss:.2f}, off the scale)" if loss > top else ""))
    axis.set(xscale="log", xlabel="link bytes per token / DDP fp32's", ylabel="final val loss", title=title)
    axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)   # below: hides no marker


def draw_horizons(axis, best: list[dict], title: str) -> None:
    """Val loss against H: a line per family of local-steps rows that differ only in H (horizon_family) at one
    step count, with two or more H; ddp_adamw's loss at each step count a line of its own style."""
    from integrations.plot import colour
    families: dict[str, list[dict]] = {}
    styles: list[str] = []
    for row in sorted(best, key=lambda r: int(r["steps"])):
        label = f"{row['steps']} steps"
        if row["method"] == localsteps.BASELINE:
            axis.axhline(float(row["final_val_loss"]), linestyle=STYLES[len(styles) % len(STYLES)], color="black",
                         label=f"ddp_adamw, {label}")
            styles.append(label)
        elif row["H"] != "0":
            families.setdefault(f"{horizon_family(row)}, {label}", []).append(row)
    curves = {family: lowest_at_each_h(members) for family, members in families.items()}
    top = ceiling(best)
    for index, (family, points) in enumerate((f, p) for f, p in curves.items() if len(p) > 1):
        off = [f"H {H}: {loss:.2f}" for H, loss in points if loss > top]
        axis.plot([H for H, _ in points], [min(loss, top) for _, loss in points], marker="o", color=colour(index),
                  label=family + (f" (off the scale: {', '.join(off)})" if off else ""))
    axis.set(xscale="log", xlabel="H (inner steps between syncs)", ylabel="final val loss",
             title=f"{title}: against H")
    axis.legend(fontsize=7, loc="upper left")


def ceiling(rows: list[dict], above: float = 1.5) -> float:
    """The top of a panel's loss axis: ddp_adamw's highest best loss among `rows` + `above` (a diverged run would
    squash the others; it is drawn at the top, its loss in the legend)."""
    baselines = [float(r["final_val_loss"]) for r in rows if r["method"] == localsteps.BASELINE]
    return max(baselines) + above if baselines else float("inf")


def lowest_at_each_h(rows: list[dict]) -> list[tuple[int, float]]:
    """(H, the lowest final val loss of the rows at that H), by H."""
    return [(H, min(float(r["final_val_loss"]) for r in runs)) for H, runs in rows_by_horizon(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=tuple(SIZES), default=list(SIZES))
    parser.add_argument("--configs", nargs="*", default=[], help="localsteps.configs() names (none: redraw the figure)")
    parser.add_argument("--lr-factors", nargs="+", type=float, default=[1.0], help="× each config's lr")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--rerun", action="store_true", help="run again the rows already in the CSV")
    localsteps.add_variant_arguments(parser, replicas=False)
    runs.add_model_arguments(parser)
    parser.add_argument("--run-timeout", type=float, default=7200.0)
    parser.add_argument("--runs-dir", type=Path, default=runs.LOCAL_RUNS / "sizes")
    parser.add_argument("--csv", type=Path, default=campaign.ROOT / "results" / "sizes.csv")
    args = parser.parse_args()
    every = {c.method.name: c for c in localsteps.configs(args.n_embd, HORIZONS, REPLICAS)}
    unknown = [name for name in args.configs if name not in every]
    if unknown:
        raise SystemExit(f"--configs: unknown {', '.join(unknown)}; known: {', '.join(every)}")
    chosen = [dataclasses.replace(c, replicas=REPLICAS)
              for c in localsteps.variants([every[name] for name in args.configs], args)]
    finals = campaign.Campaign(args.csv, FIELDS, KEY, arrange=arrange)
    done = {tuple(str(row[k]) for k in KEY) for row in finals.kept}
    for size in args.sizes:
        for config in chosen:
            name = config.method.name
            for lr in (config.method.lr * factor for factor in args.lr_factors):
                for seed in args.seeds:
                    if not args.rerun and (size, name, f"{lr:g}", str(seed), str(args.steps)) in done:
                        print(f"sizes: {size} {name} lr {lr:g} seed {seed} already in {args.csv.name}", flush=True)
                        continue
                    run_one(finals, config, size, lr, seed, args)
    campaign.print_table(finals.everything())
    plot(arrange(finals.everything()), args.csv.with_suffix(".png"))
    print(f"wrote {args.csv} and {args.csv.with_suffix('.png').name}")
    finals.finish("--runs-dir")


if __name__ == "__main__":
    main()
