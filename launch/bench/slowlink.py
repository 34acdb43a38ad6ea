"""Slow-link time to quality: every method on two emulated nodes whose link is limited by tc tbf.

    sudo python launch/bench/slowlink.py                       # the full campaign → results/slowlink.csv + .png
    sudo python launch/bench/slowlink.py --rates 100mbit --procs-per-node 1 --steps 20 \\
        --methods ddp_adamw signmuon --csv results/slowlink_smoke.csv     # a reduced-scale check
    sudo python launch/bench/slowlink.py --procs-per-node 1 --rates 100mbit --methods ddp_adamw dion_1/4 \\
        --overlap-backward --ns-steps 3 --ns-coefficients polar_express   # + …_overlap, …_ns3_polar_express
    sudo python launch/bench/slowlink.py --procs-per-node 2 --rates 10mbit --methods ddp_adamw \\
        local_muon_H10_sign_mean_b128 --outer-lrs 0.7 --outer-momenta 0 --outer-overlap   # a local-steps config

Needs root (network namespaces), iproute2 and the prepared data (python integrations/data.py).
For each procs-per-node P: first `ddp_adamw` runs on this machine without a link limit (2·P ranks,
torchrun --standalone); its final val loss is the target. With --unlimited all (default) every
other method runs there too: its step_ms there is its compute, and the difference to its step_ms
at a rate is what the link adds (the communication/compute split); `--rates` with no rate runs only
these. A run whose folder under --work-dir holds a finished run of the same arguments made by the same
code (campaign.code_version(): shardopt/, integrations/, the DDP script and its modules, the launchers
with twonode.sh) is read back, not rerun (an interrupted campaign resumes; --rerun runs everything
again). Then for each rate, launch/netns/twonode.sh
makes two namespaces joined by a veth pair limited to the rate (tc tbf with a bucket of 4 ms of the
rate, at least 16 KiB: a larger one refills while a method computes and lets a small exchange leave
at memory speed), and each method runs as one torchrun per node (P processes each): shardopt's
methods on a (replicate 2, shard P) mesh, the DDP ones on 2·P ranks. Columns (results/slowlink.csv):

    method, rate_mbit (inf: no link limit, this machine), procs_per_node, lr (2-D weights),
    scalar_lr (embeddings, tied head and norms; empty for signsgd, one lr for everything), steps,
    step_ms                   median step time (compute + communication, from every step)
    replicate_bytes_per_step  bytes one rank sends per step between nodes, counted (shardopt's comm
                              layer; for DDP-based methods the all-reduces torch's hooks issue)
    wire_bytes_per_step       bytes node 1 sent on the veth per step, all P ranks of the node together:
                              its kernel counter (link_tx_bytes in metrics.csv) from the end of step 1
                              to the last step, so the start-up (DDP's model broadcast, rendezvous) is
                              not spread over the steps; evaluations between steps are in it
    time_to_target_s          training seconds (sum of step times, evaluations excluded) until val loss
                              ≤ the target; inf when not reached
    final_val_loss

--methods takes runs.methods' names and localsteps.py's local-steps configs (made into their variants by
--outer-lrs, --outer-momenta, --outer-overlap, --fragments as there). --overlap-backward adds each chosen
shardopt per-step method with the exchange started during backward, --ns-steps / --ns-coefficients each chosen
Sign-Muon method with that Newton–Schulz step, both at the method's lrs.

Vocabulary: --tokenizer bpe (default; BPE-4096 of integrations/data.py --tokenizer bpe) or byte (256);
the runs print it. Methods with "_lion" use shardopt's 1-bit Lion vote for the embeddings and norms
instead of AdamW with a full-precision mean. The namespaces are always deleted at the end (also on
an error or SIGTERM); NETNS_PREFIX picks their names (default bench). The CSV is updated, not
replaced: a campaign's rows replace those with the same (method, rate_mbit, procs_per_node), other rows
stay (so 1 and 2 procs per node can run as two campaigns), except, with --lr-from, a row measured at
another (lr, scalar lr) than its method's best there: it is dropped (and named). Every row's time_to_target_s is against
its procs-per-node's current target: it is recomputed from the run folder's curve, and a campaign whose
new target run changes the target refuses to start where a kept row has no run folder to recompute
from. The PNG plots every row whose run folder is still under --work-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import math
import os
import signal
import subprocess
from pathlib import Path

import campaign
import localsteps
import runs
from convergence import best_table

RATES = {"gbit": 1000, "mbit": 1, "kbit": 0.001}
SLOWLINK_KEY = ("method", "rate_mbit", "procs_per_node")     # a campaign replaces the rows of these values


def rate_mbit(rate: str) -> float:
    """tc rate string → Mbit/s ("100mbit" → 100, "1gbit" → 1000)."""
    for unit, scale in RATES.items():
        if rate.endswith(unit) and rate[:-len(unit)].replace(".", "", 1).isdigit():
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: give a number and one of {', '.join(RATES)} (e.g. 100mbit)")


@contextlib.contextmanager
def two_nodes(prefix: str, rate: str):
    """The two namespaces at `rate` for the duration; deleted on the way out, whatever happens."""
    env = {**os.environ, "NETNS_PREFIX": prefix}
    subprocess.run([str(campaign.TWONODE), "up", rate], check=True, env=env)
    try:
        yield
    finally:
        subprocess.run([str(campaign.TWONODE), "down"], env=env)


def best_settings(path: Path) -> dict[str, tuple[float, float | None]]:
    """method → its best (lr, scalar lr) (lowest mean final val loss over seeds) in a convergence CSV."""
    return {entry["method"]: (float(entry["lr"]), float(entry["scalar_lr"]) if entry["scalar_lr"] else None)
            for entry in best_table(campaign.read_csv(path))}


def run_dir(work_dir: Path, procs: int, rate: float, method: str) -> Path:
    return work_dir / f"p{procs}_{'unlimited' if math.isinf(rate) else f'{rate:g}mbit'}_{method.replace('/', '_')}"


def row(method: runs.Method, rate: float, procs: int, lr: float, scalar_lr: float | None, summary: runs.Summary,
        target: float) -> dict:
    """One CSV row; wire bytes only for a run over the emulated link (rate finite)."""
    wire = summary.wire_bytes_per_step
    if not math.isinf(rate) and wire is None:
        raise ValueError("a run over the link logged no link_tx_bytes: metrics.csv is from an older train script")
    return {"method": method.name, "rate_mbit": f"{rate:g}", "procs_per_node": procs, "lr": f"{lr:g}",
            "scalar_lr": method.scalar_lr_text(scalar_lr),
            "steps": summary.steps, "step_ms": f"{summary.step_ms:.1f}",
            "replicate_bytes_per_step": round(summary.replicate_bytes_per_step),
            "wire_bytes_per_step": "" if math.isinf(rate) else round(wire),
            "time_to_target_s": f"{runs.time_to_target(summary.curve, target):.1f}",
            "final_val_loss": f"{summary.final_val_loss:.4f}"}


def plot(curves: dict, targets: dict, path: Path) -> None:
    """Val loss against training seconds (log scale), one panel per (procs per node, rate); a method
    has one colour in every panel."""
    from integrations.plot import colour, panels, save   # matplotlib (the train extra): only to draw
    procs_list, rate_list = sorted({key[0] for key in curves}), sorted({key[1] for key in curves})
    colours = {name: colour(i) for i, name in enumerate(dict.fromkeys(key[2] for key in curves))}
    figure, axes = panels(len(procs_list), len(rate_list), figsize=(5 * len(rate_list), 4 * len(procs_list)),
                          squeeze=False, layout="constrained")
    for (i, procs), (j, rate) in itertools.product(enumerate(procs_list), enumerate(rate_list)):
        axis = axes[i][j]
        shown = [(name, curve) for (p, r, name), curve in curves.items() if (p, r) == (procs, rate)]
        if not shown:
            axis.set_visible(False)
            continue
        for name, curve in shown:
            axis.plot([c[1] for c in curve[1:]], [c[2] for c in curve[1:]], marker=".", label=name, color=colours[name])
        if procs in targets:
            axis.axhline(targets[procs], color="gray", linestyle="--", label="target")
        axis.set(xlabel="training seconds", ylabel="val loss", xscale="log",
                 title=f"{'no limit' if math.isinf(rate) else f'{rate:g} Mbit/s'}, {procs} proc/node")
        axis.legend(fontsize=7)
    save(figure, path)


def row_curve(r: dict, work_dir: Path) -> list | None:
    """The val-loss curve of a CSV row's run, from its folder under work_dir; None where the folder is
    gone or holds another run (its steps or final val loss differ from the row's)."""
    metrics = run_dir(work_dir, int(r["procs_per_node"]), float(r["rate_mbit"]), r["method"]) / "metrics.csv"
    if not metrics.exists():
        return None
    summary = runs.summarize(runs.read_metrics(metrics.parent))
    same = str(summary.steps) == str(r["steps"]) and f"{summary.final_val_loss:.4f}" == r["final_val_loss"]
    return summary.curve if same else None


def retargeted(rows: list[dict], targets: dict[int, float], work_dir: Path) -> list[dict]:
    """rows with time_to_target_s against targets[procs], recomputed from each row's run (row_curve;
    kept as it is where its procs has no target or its run is not under work_dir)."""
    result = []
    for r in rows:
        curve = row_curve(r, work_dir) if int(r["procs_per_node"]) in targets else None
        if curve is not None:
            r = {**r, "time_to_target_s": f"{runs.time_to_target(curve, targets[int(r['procs_per_node'])]):.1f}"}
        result.append(r)
    return result


def ordered(rows: list[dict], names: list[str]) -> list[dict]:
    """rows by procs per node, then method in the order of `names` (others after, by name), then rate
    from the fastest (no limit) down: the order the CSV and the README table show them in."""
    rank = {name: i for i, name in enumerate(names)}
    return sorted(rows, key=lambda r: (int(r["procs_per_node"]), rank.get(r["method"], len(rank)), r["method"],
                                       -float(r["rate_mbit"])))


def split_superseded(rows: list[dict], settings: dict[str, tuple[float, float | None]]) -> tuple[list[dict], list[dict]]:
    """(rows kept, rows superseded): a row is superseded where its method has a best setting (lr, scalar
    lr) in `settings` (--lr-from) and the row was measured at another one."""
    kept, superseded = [], []
    for r in rows:
        measured_at = (float(r["lr"]), float(r["scalar_lr"]) if r["scalar_lr"] else None)
        (superseded if r["method"] in settings and measured_at != settings[r["method"]] else kept).append(r)
    return kept, superseded


def at_settings(methods: list[runs.Method], settings: dict[str, tuple[float, float | None]]) -> list[runs.Method]:
    """Each method at its (lr, scalar lr) in `settings` where it has one."""
    return [dataclasses.replace(m, lr=settings[m.name][0], scalar_lr=settings[m.name][1]) if m.name in settings
            else m for m in methods]


def catalogue(args, settings: dict[str, tuple[float, float | None]]) -> list[runs.Method]:
    """The methods --methods names (default: every per-step one), each at its (lr, scalar lr) in `settings`
    where it has one: runs.methods' (and, at the same lrs, the Sign-Muon ones also as --ns-steps and
    --ns-coefficients make them, then with --overlap-backward shardopt's also overlapped), localsteps.py's
    configs as --outer-lrs, --outer-momenta, --outer-overlap and --fragments make them (localsteps.variants)."""
    per_step = at_settings(runs.methods(args.n_embd), settings)
    local = {c.method.name: c for c in localsteps.configs(args.n_embd) if c.H}
    names = args.methods or [m.name for m in per_step]
    unknown = [n for n in names if n not in local and n not in {m.name for m in per_step}]
    if unknown:
        raise SystemExit(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(m.name for m in per_step)}, "
                         f"and localsteps.py's configs ({', '.join(local)})")
    chosen = runs.select(per_step, [n for n in names if n not in local])
    chosen += runs.polar_variants([m for m in chosen if runs.newton_schulz_optimizer(m)], args)
    if args.overlap_backward:
        chosen += [runs.overlap_variant(m) for m in chosen if m.script == runs.FSDP_TRAIN]
    return chosen + [c.method for c in localsteps.variants([local[n] for n in names if n in local], args)]


def parse_arguments(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command line (argv None: sys.argv's) and its parser, for the errors found after parsing."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="*", default=["1gbit", "100mbit", "10mbit"],
                        help="tc rates of the link (none: only the runs without a limit)")
    parser.add_argument("--procs-per-node", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--methods", nargs="+", default=None,
                        help="labels (default: all per-step methods): runs.methods' and localsteps.py's configs")
    parser.add_argument("--overlap-backward", action="store_true",
                        help="shardopt's per-step methods chosen also with --overlap-backward on (…_overlap)")
    runs.add_polar_arguments(parser)
    localsteps.add_variant_arguments(parser)
    parser.add_argument("--lr-from", type=Path, default=None,
                        help="a convergence CSV: each method at its best (lr, scalar lr) there (default: its defaults)")
    runs.add_model_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unlimited", choices=("all", "baseline"), default="all",
                        help="which methods also run without a link limit (rate_mbit inf): all (their compute-only "
                             "step time, for the communication/compute split) or only the ddp_adamw target run")
    parser.add_argument("--rerun", action="store_true", help="run again where a finished run would be read back")
    parser.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one run may take")
    parser.add_argument("--work-dir", type=Path, default=campaign.ROOT / "runs" / "slowlink")
    parser.add_argument("--csv", type=Path, default=campaign.ROOT / "results" / "slowlink.csv")
    return parser, parser.parse_args(argv)


def main() -> None:
    parser, args = parse_arguments()
    if os.geteuid() != 0:
        parser.error("network namespaces need root; run with sudo (or as root)")
    rates = {rate: rate_mbit(rate) for rate in args.rates}
    settings = best_settings(args.lr_from) if args.lr_from else {}
    chosen = catalogue(args, settings)
    if settings:
        settings |= {m.name: (m.lr, m.scalar_lr) for m in chosen}
    baseline = at_settings(runs.select(runs.methods(args.n_embd), ["ddp_adamw"]), settings)[0]
    names = list(dict.fromkeys([m.name for m in runs.methods(args.n_embd)] + [m.name for m in chosen]))
    model = runs.model_args(args)
    prefix = os.environ.get("NETNS_PREFIX", "bench")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))   # so `finally` tears down
    ports = itertools.count(29650)
    targets: dict[int, float] = {}
    table = campaign.Campaign(args.csv, runs.SLOWLINK_FIELDS, SLOWLINK_KEY,
                              arrange=lambda rows: ordered(retargeted(rows, targets, args.work_dir), names))
    table.kept, superseded = split_superseded(table.kept, settings)
    if superseded:
        print(f"dropped {len(superseded)} rows of {args.csv.name} measured at another (lr, scalar lr) than the best in "
              f"{args.lr_from}: " + ", ".join(f"{r['method']} at {r['rate_mbit']} Mbit/s, {r['procs_per_node']} proc/node "
                                               f"({r['lr']}, {r['scalar_lr'] or '-'})" for r in superseded), flush=True)
    print(f"slowlink: vocabulary {args.tokenizer}; {args.steps} steps; methods {', '.join(m.name for m in chosen)}", flush=True)

    def measure(method: runs.Method, procs: int, rate: str | None) -> runs.Summary | None:
        """One run (rate None: on this machine, no link limit) → its row; None where it failed."""
        mbit = rates[rate] if rate else math.inf
        out = run_dir(args.work_dir, procs, mbit, method.name)
        lr, scalar_lr = method.lr, method.scalar_lr
        argv = method.command(lr, scalar_lr, args.seed, out, model, 2, procs)

        def start() -> None:
            if rate:
                campaign.run_two_nodes(argv, procs, prefix, next(ports), out / "log.txt", args.run_timeout, not args.rerun)
            else:
                campaign.run_local(argv, 2 * procs, out / "log.txt", args.run_timeout, not args.rerun)
        if not table.attempt(f"{method.name} at {rate or 'no limit'}, {procs} proc/node", start):
            return None
        summary = runs.summarize(runs.read_metrics(out))
        targets.setdefault(procs, summary.final_val_loss)    # the first run of each P is ddp_adamw's unlimited one
        table.add(row(method, mbit, procs, lr, scalar_lr, summary, targets[procs]))
        return summary

    def refuse_stale_rows(procs: int) -> None:
        """Stop before a campaign whose new target would leave a kept row measured against the old one."""
        old = [float(r["final_val_loss"]) for r in table.kept if (r["method"], r["rate_mbit"], int(r["procs_per_node"])) ==
               (baseline.name, "inf", procs)]
        planned = {(m.name, f"{rates[rate]:g}") for m in chosen for rate in rates} | \
            {(m.name, "inf") for m in (chosen if args.unlimited == "all" else [baseline])}
        stale = [f"{r['method']} at {r['rate_mbit']} Mbit/s" for r in table.kept if int(r["procs_per_node"]) == procs
                 and (r["method"], r["rate_mbit"]) not in planned and row_curve(r, args.work_dir) is None]
        if old and f"{old[0]:.4f}" != f"{targets[procs]:.4f}" and stale:
            raise SystemExit(f"the target at {procs} proc/node changed ({old[0]:.4f} → {targets[procs]:.4f}) and these "
                             f"rows of {args.csv} have no run folder under {args.work_dir} to recompute their time to "
                             f"target from: {', '.join(stale)}. Include them in this campaign (--methods, --rates) "
                             f"or delete them from the CSV.")

    for procs in args.procs_per_node:
        if measure(baseline, procs, None) is None:
            raise SystemExit(f"the target run (ddp_adamw without a link limit, {procs} proc/node) failed:\n{table.failed[-1]}")
        print(f"target ({procs} proc/node): ddp_adamw unlimited final val loss {targets[procs]:.4f}", flush=True)
        refuse_stale_rows(procs)
        for method in chosen if args.unlimited == "all" else []:
            if method.name != baseline.name:
                measure(method, procs, None)
        for rate in rates:
            with two_nodes(prefix, rate):
                for method in chosen:
                    measure(method, procs, rate)
    campaign.print_table(table.rows)
    everything = table.everything()
    targets = {int(r["procs_per_node"]): float(r["final_val_loss"]) for r in everything
               if r["method"] == baseline.name and math.isinf(float(r["rate_mbit"]))}
    curves = {}
    for r in everything:
        out = run_dir(args.work_dir, int(r["procs_per_node"]), float(r["rate_mbit"]), r["method"])
        if (out / "metrics.csv").exists():
            curves[(int(r["procs_per_node"]), float(r["rate_mbit"]), r["method"])] = runs.summarize(runs.read_metrics(out)).curve
    png = args.csv.with_suffix(".png")
    plot(curves, targets, png)
    print(f"wrote {args.csv} ({len(table.rows)} rows of this campaign, {len(everything) - len(table.rows)} kept) and {png}")
    table.finish("--work-dir")


if __name__ == "__main__":
    main()
