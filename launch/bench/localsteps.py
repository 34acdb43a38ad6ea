"""Local steps (shardopt.LocalSteps, docs/design.md §10) against the per-step methods and the DiLoCo and
MuLoCo-style peers, at equal steps and tokens: final val loss and replicate bytes per token.

    python launch/bench/localsteps.py                                  # the 200-step grid → results/localsteps.csv
    python launch/bench/localsteps.py --configs ddp_adamw local_muon_H30_sign_vote --steps 1000 \\
        --lr-factors 1 --eval-every 100                                # the long horizon, same CSV (steps column)
    python launch/bench/localsteps.py --configs local_muon_H30_int8 --outer-lrs 1 0.7 --outer-momenta 0 0.6 \\
        --lr-factors 1                                                 # outer SGD variants (…_olr1_m0)
    python launch/bench/localsteps.py --configs local_muon_H30_sign_vote --replicas 4 --lr-factors 1
                                                                       # 4 nodes × 1 rank (…_M4 rows)
    python launch/bench/localsteps.py --configs local_muon_H30_int8 --steps 20 --lr-factors 1 \\
        --csv results/localsteps_smoke.csv                             # a reduced-scale check

Each run: torchrun --standalone with 2 × 2 ranks on this machine (two "nodes" of two ranks; --replicas 4: four
"nodes" of one rank, the replicas column; --replicas 3 or 8: that many nodes of one rank, and the per-step
peers on as many ranks, …_M8: a rank's batch stays, so the tokens per step change), the same model, data and
schedule as convergence.py
(runs.model_args). A config is a runs.Method:
- the per-step peers of runs.methods(): ddp_adamw, ddp_muon (DDP, fp32 gradient all-reduce), signmuon_lion
  (1 bit per entry every step);
- local_<inner>_H<H>_<exchange>: integrations/fsdp/train.py --optimizer <inner> --local-steps H
  --outer-exchange <exchange> (inner steps on the shard axis only; every H steps the pseudo-gradient
  through the outer exchange on the replicate axis; outer Nesterov SGD lr 0.7, momentum 0.6);
- diloco_m<μ>_H<H>: AdamW inside, the fp32 mean outside, outer momentum μ (DiLoCo's 0.9, and 0.6);
- muloco_H<H>: Muon inside (shardopt's Muon: torch.optim.Muon's update, tests/test_muon.py), int4 outside
  with error feedback (MuLoCo's recipe).
The inner non-matrix group is AdamW (its lr 0.1 as in convergence_best.csv): with local steps it sends
nothing per step, the whole model's Δ goes through the outer exchange.

    results/localsteps.csv   method, inner, H, exchange, outer_momentum, lr, scalar_lr, seed, steps, tokens,
                             final_val_loss, replicate_bytes_total (one rank's), link_bytes_total (one node's
                             on the link between the nodes), bytes_per_token_vs_ddp_fp32 (link bytes /
                             ddp_adamw's at the same steps and tokens), x_fewer_bytes (its inverse), compute_s,
                             and time to target (ddp_adamw's final val loss at the same steps) at 10 and 1 Mbit/s
    results/localsteps.png   val loss vs replicate bytes per token, each config at its best lr, one panel
                             per horizon

Bytes: what one rank sent on the replicate axis over the whole run, counted by the communication layer
(train.py) or by counting.py's hooks (train_ddp.py). Time to target is computed here, for every config of
the grid (which ran several runs at once on the machine): the compute seconds up to the first evaluation at or below the
target, plus the link bytes until then × 8 / the link rate (no overlap of exchange and compute, no
latency). Compute seconds: steps × the method's median step time from the quiet pass (--step-times:
each method alone on the machine, one after another, results/localsteps_step_ms.csv) where it ran;
else the run's own step times (compute_s: measured while other runs shared the 2 cores). Link bytes: one rank's counted bytes × 2 for shardopt (each of a node's two ranks exchanges its
shard with its peer on the other node) and × 1 for DDP (its ring over the 4 ranks crosses each way once),
the ratios slowlink.py measured on the emulated link. "not reached": the run never got there. The chosen
configs' measured times on the emulated link: slowlink.py --methods <config> (localsteps' configs are among its
methods; --outer-lrs, --outer-momenta, --outer-overlap and --fragments as here).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import re
from pathlib import Path

import campaign
import runs
import shardopt
from shardopt.localsteps.formats import DEFAULT_BLOCK, EXCHANGES, outer_format, resolve

FIELDS = ["method", "inner", "H", "replicas", "exchange", "outer_lr", "outer_momentum", "lr", "scalar_lr", "seed", "steps", "tokens",
          "final_val_loss", "replicate_bytes_total", "link_bytes_total", "bytes_per_token_vs_ddp_fp32", "x_fewer_bytes", "compute_s",
          "time_to_target_10mbit_s", "time_to_target_1mbit_s"]
KEY = ("method", "lr", "scalar_lr", "seed", "steps")
FORMATS = tuple(exchange for exchange in EXCHANGES if exchange != "auto")   # ("auto" is one of them at each M:
                                                                            # local_defaults runs it)
CURVE_FIELDS = ["method", "lr", "scalar_lr", "seed", "steps", "step", "val_loss", "replicate_bytes", "compute_s"]
LINKS_MBIT = (10, 1)
RANKS = 4             # a run: 4 processes, replicas (nodes) × RANKS / replicas shard ranks per node (other
                      # replica counts: that many nodes of one rank, see ranks_per_node)
REPLICAS = 2          # the benchmark's mesh: 2 nodes × 2 ranks (--replicas 4: 4 nodes × 1, methods named …_M4)
RING_CROSSINGS = 1    # DDP's ring over the 4 ranks: one rank's bytes cross each way (results/slowlink*.csv)
BASELINE = "ddp_adamw"
HORIZONS = (10, 30, 100)   # the grid's H (--horizons)
INNER_LR = {"signmuon": 3e-3, "dion": 0.02, "muon": 0.02, "adamw": 1.5e-3}    # convergence_best.csv's per-step bests
OUTER_LR = 0.7          # LocalSteps' default (MuLoCo's), momentum 0.6
DDP_METHODS = {m.name for m in runs.methods(128) if m.script == runs.DDP_TRAIN}   # (128: the benchmark's n_embd)


@dataclasses.dataclass(frozen=True)
class Config:
    """A runs.Method with what localsteps.csv says of it: the optimizer inside, H (0: every step), the
    outer exchange (or the per-step one) and the outer momentum."""
    method: runs.Method
    inner: str
    H: int
    exchange: str
    outer_momentum: float | None = None
    outer_lr: float | None = None
    replicas: int = REPLICAS

    @property
    def ranks_per_node(self) -> int:
        return ranks_per_node(self.replicas)

    @property
    def processes(self) -> int:
        return self.replicas * self.ranks_per_node


def ranks_per_node(replicas: int) -> int:
    """RANKS / replicas where that divides (the same 4 processes, 2 × 2 or 4 × 1), else 1 (3, 8: that many
    nodes of one rank: more or fewer processes, so more or fewer tokens per step than the 4-process runs)."""
    return RANKS // replicas if RANKS % replicas == 0 else 1


def base_name(method: str) -> str:
    """A method's name without its …_M<replicas> suffix (replicas_variant)."""
    return re.sub(r"_M\d+$", "", method)


def local_config(name: str, inner: str, H: int, exchange: str, outer_momentum: float = 0.6,
                 block: int | None = None, outer_lr: float = OUTER_LR, density: float | None = None) -> Config:
    """A local-steps config; `block` None: 4096 (DEFAULT_BLOCK, what every config without _b<block> in its name
    ran with, named in the label only when given)."""
    args = ("--optimizer", inner, "--local-steps", str(H), "--outer-exchange", exchange, "--outer-lr", f"{outer_lr:g}",
            "--outer-momentum", f"{outer_momentum:g}", "--outer-block", str(block or DEFAULT_BLOCK),
            *(("--outer-density", f"{density:g}") if density else ()))
    method = runs.Method(name, runs.FSDP_TRAIN, args, INNER_LR[inner], runs.ADAMW_SCALAR_LR)
    label = exchange + (f", block {block}" if block else "") + (f", density {density:g}" if density else "")
    return Config(method, inner, H, label, outer_momentum, outer_lr)


def topk_density_at(bits_per_entry: float, block: int = DEFAULT_BLOCK) -> float:
    """The "topk" density whose payload per entry is `bits_per_entry` (formats.py's table): per chunk of `block`
    entries k picks of 2 + ⌈log2 block⌉ bits and one fp32 scale, so k = (bits_per_entry·block − 32) /
    (2 + ⌈log2 block⌉), density = k / block (rounded to 3 decimals). Both topk and sign_mean all-gather, so
    equal bits per entry are equal bytes; the counted bytes (replicate_bytes_total) check it."""
    return round((bits_per_entry * block - 32) / (2 + math.ceil(math.log2(block))) / block, 3)


SIGN_MEAN_B128_BITS = 1 + 32 / 128      # sign_mean, block 128: a sign bit per entry and an fp32 scale per 128


def int4_bits_as_gathered(replicas: int, block: int = DEFAULT_BLOCK) -> float:
    """The bits per entry an all-gather format (topk, sign_mean: (M − 1)·b bits per entry sent) sends for int4's
    bytes on M = `replicas`: int4's all-to-all and all-gather send 2(M − 1)/M·(4 + 32/block) (formats.py), so
    b = 2/M·(4 + 32/block)."""
    return 2 / replicas * (4 + 32 / block)


def local_defaults(H: int, replicas: int = REPLICAS) -> Config:
    """local_defaults: LocalSteps(Muon, sync_every=H) with every other option at its default, as its signature
    gives it (passed explicitly, so train.py's defaults.json cannot differ from it); labelled with the format
    the default exchange runs on `replicas` replicas (formats.resolve)."""
    default = {name: p.default for name, p in inspect.signature(shardopt.LocalSteps).parameters.items()}
    block = default["block"] or outer_format(default["exchange"]).block      # None: the format's own
    config = local_config("local_defaults", "muon", H, default["exchange"], default["outer_momentum"], block,
                          default["outer_lr"])
    runs_as = resolve(default["exchange"], replicas)
    return dataclasses.replace(config, exchange=config.exchange.replace(default["exchange"], runs_as, 1))


def streaming_variant(config: Config, overlap: bool, fragments: int) -> Config:
    """A local-steps config whose exchange runs during the next round (overlap) and/or syncs in `fragments`
    parts at staggered steps, labelled …_overlap, …_f3."""
    if not config.H:
        raise SystemExit(f"--outer-overlap/--fragments: {config.method.name} has no outer loop")
    suffix = ("_overlap" if overlap else "") + (f"_f{fragments}" if fragments > 1 else "")
    args = (*config.method.args, *(("--outer-overlap",) if overlap else ()), "--fragments", str(fragments))
    label = config.exchange + (", overlapped" if overlap else "") + (f", {fragments} fragments" if fragments > 1 else "")
    return dataclasses.replace(config, method=dataclasses.replace(config.method, name=config.method.name + suffix,
                                                                  args=args), exchange=label)


def outer_variant(config: Config, outer_lr: float, outer_momentum: float) -> Config:
    """A local-steps config with another outer SGD (lr, momentum), labelled e.g. local_muon_H30_int8_olr1_m0."""
    if not config.H:
        raise SystemExit(f"--outer-lrs/--outer-momenta: {config.method.name} has no outer loop (choose local-steps configs)")
    method = dataclasses.replace(config.method, name=f"{config.method.name}_olr{outer_lr:g}_m{outer_momentum:g}",
                                 args=(*config.method.args, "--outer-lr", f"{outer_lr:g}",
                                       "--outer-momentum", f"{outer_momentum:g}"))
    return dataclasses.replace(config, method=method, outer_lr=outer_lr, outer_momentum=outer_momentum)


def replicas_variant(config: Config, replicas: int) -> Config:
    """A config on `replicas` nodes of ranks_per_node(replicas) ranks each, labelled …_M<replicas> (unchanged
    at the benchmark's REPLICAS). A per-step peer only where its processes change (3, 8): on 4 processes it
    is one run whatever the nodes (its rows serve 2 and 4 replicas alike)."""
    if replicas == REPLICAS:
        return config
    if not config.H and replicas * ranks_per_node(replicas) == RANKS:
        raise SystemExit(f"--replicas {replicas}: {config.method.name} runs on {RANKS} processes at 2 and 4 replicas "
                         f"alike (its rows serve both); choose local-steps configs, or 3 or 8 replicas")
    method = dataclasses.replace(config.method, name=f"{config.method.name}_M{replicas}")
    return dataclasses.replace(config, method=method, replicas=replicas)


def add_variant_arguments(parser, replicas: bool = True) -> None:
    """The options that turn the chosen local-steps configs into their variants (`variants`); --replicas
    where `replicas` (sizes.py's mesh is fixed)."""
    parser.add_argument("--outer-lrs", nargs="+", type=float, default=None,
                        help="run each chosen local-steps config at each outer lr (with --outer-momenta)")
    parser.add_argument("--outer-momenta", nargs="+", type=float, default=None, help="(see --outer-lrs)")
    parser.add_argument("--outer-overlap", action="store_true",
                        help="the chosen local-steps configs with the exchange one round late (…_overlap)")
    parser.add_argument("--fragments", type=int, default=1, help="the chosen configs synced in F fragments (…_fF)")
    if replicas:
        parser.add_argument("--replicas", type=int, choices=(2, 3, 4, 8), default=REPLICAS,
                            help=f"nodes (replicas) of {RANKS} / replicas ranks each (3, 8: of one rank) for the "
                                 f"chosen configs (…_M4); {REPLICAS}: the benchmark's mesh")


def variants(chosen: list[Config], args) -> list[Config]:
    """chosen, each at every (--outer-lrs × --outer-momenta), then overlapped / in fragments where asked, on
    --replicas nodes."""
    if args.outer_lrs or args.outer_momenta:
        chosen = [outer_variant(c, lr, m) for c in chosen for lr in args.outer_lrs or [OUTER_LR]
                  for m in args.outer_momenta or [0.6]]
    if args.outer_overlap or args.fragments > 1:
        chosen = [streaming_variant(c, args.outer_overlap, args.fragments) for c in chosen]
    return [replicas_variant(c, getattr(args, "replicas", REPLICAS)) for c in chosen]


def configs(n_embd: int, horizons: tuple[int, ...] = HORIZONS, replicas: int = REPLICAS) -> list[Config]:
    """Every config of the benchmark: the per-step peers (issue 42's four), local_defaults at H 30, then DiLoCo,
    MuLoCo-style and LocalSteps with Sign-Muon, Dion and Muon inside for each outer exchange and H in `horizons`
    (and Muon with topk at sign_mean block 128's bytes, …_topk_as_sign_mean_b128, and at int4's on `replicas`
    replicas, …_topk_as_int4)."""
    per_step = {m.name: m for m in runs.methods(n_embd)}
    found = [Config(per_step["ddp_adamw"], "adamw", 0, "mean (fp32 gradients)"),
             Config(per_step["ddp_muon"], "muon", 0, "mean (fp32 gradients)"),
             Config(per_step["signmuon_lion"], "signmuon", 0, "vote (1 bit, every step)"),
             Config(per_step["dion_1/4_lion"], "dion", 0, "low rank 1/4 (every step)"), local_defaults(30, replicas)]
    for H in horizons:
        found += [local_config(f"diloco_m{m:g}_H{H}", "adamw", H, "mean", m) for m in (0.9, 0.6)]
        found.append(local_config(f"muloco_H{H}", "muon", H, "int4"))
        found += [local_config(f"local_{inner}_H{H}_{exchange}", inner, H, exchange)
                  for inner in ("signmuon", "dion", "muon") for exchange in FORMATS
                  if not (inner == "muon" and exchange == "int4")]        # (that one is muloco_H<H>)
        found += [local_config(f"local_{inner}_H{H}_{exchange}_b128", inner, H, exchange, block=128)
                  for inner in ("signmuon", "dion", "muon") for exchange in ("sign_mean", "sign_vote", "lowrank")]
        found.append(local_config(f"local_muon_H{H}_topk_as_sign_mean_b128", "muon", H, "topk",
                                  density=topk_density_at(SIGN_MEAN_B128_BITS)))     # equal bytes (issue 42)
        found.append(local_config(f"local_muon_H{H}_topk_as_int4", "muon", H, "topk",
                                  density=topk_density_at(int4_bits_as_gathered(replicas))))
    return found


def link_factor(method: str, replicas: int = REPLICAS) -> int:
    """The bytes one node puts on the link per byte one rank counted: each of shardopt's RANKS / replicas
    replicate groups (one per rank of a node) crosses it; DDP's ring crosses it once (the ratios slowlink.py
    measured on the emulated link)."""
    return RING_CROSSINGS if base_name(method) in DDP_METHODS else ranks_per_node(replicas)


def arrange(rows: list[dict], curves: dict, step_ms: dict | None = None) -> list[dict]:
    """The columns that depend on ddp_adamw's row at the same steps and tokens (its best lr over the file; at 3
    or 8 replicas ddp_adamw_M<replicas>'s: bytes ratio and time to its final val loss), recomputed whenever the
    CSV is written. step_ms: method →
    its step time from the quiet pass (--step-times); where given, a run's compute seconds up to a step
    are step × step_ms (the campaign's own step times are measured on a machine shared with other runs)."""
    step_ms = step_ms or {}
    baselines = {}
    for row in rows:
        if base_name(row["method"]) == BASELINE:
            at = (str(row["steps"]), str(row["tokens"]))
            if at not in baselines or float(row["final_val_loss"]) < float(baselines[at]["final_val_loss"]):
                baselines[at] = row
    for row in rows:
        if str(row.get("H", "0")) != "0" and not row.get("outer_lr"):
            row["outer_lr"] = f"{OUTER_LR:g}"     # (rows from before the column: the default)
        row["replicas"] = int(row.get("replicas") or REPLICAS)     # (rows from before the column: the benchmark's)
        baseline = baselines.get((str(row["steps"]), str(row["tokens"])))
        if baseline is None:
            continue
        row["link_bytes_total"] = int(row["replicate_bytes_total"]) * link_factor(row["method"], row["replicas"])
        ratio = row["link_bytes_total"] / (int(baseline["replicate_bytes_total"]) * link_factor(BASELINE))
        row["bytes_per_token_vs_ddp_fp32"] = f"{ratio:.6f}"
        row["x_fewer_bytes"] = f"{1 / ratio:.1f}" if ratio else "inf"
        curve = quiet(curves.get(tuple(str(row[k]) for k in KEY)), step_ms.get(row["method"]))
        reference = curves.get(tuple(str(baseline[k]) for k in KEY))
        target = reference[-1][2] if reference else float(baseline["final_val_loss"])   # (unrounded)
        for mbit in LINKS_MBIT:
            per_byte = link_factor(row["method"], row["replicas"]) * 8 / (mbit * 1e6)   # one rank's byte → link s
            seconds = runs.time_to_target(curve, target, per_byte) if curve else math.nan
            row[f"time_to_target_{mbit}mbit_s"] = "not reached" if seconds == math.inf else \
                "" if math.isnan(seconds) else f"{seconds:.1f}"
    return [{field: row.get(field, "") for field in FIELDS} for row in rows]


def quiet(curve: list | None, step_ms: float | None) -> list | None:
    """curve with its seconds recomputed as step × step_ms / 1000 (unchanged where step_ms is None)."""
    if curve is None or step_ms is None:
        return curve
    return [(step, step * step_ms / 1000, loss, sent) for step, _, loss, sent in curve]


def plot(rows: list[dict], path: Path) -> None:
    """Val loss vs bytes per token (relative to DDP fp32), each config at its best lr, a panel per horizon
    (the benchmark's mesh: REPLICAS nodes)."""
    from integrations.plot import colour, panels, save   # matplotlib (the train extra): only to draw
    horizons = sorted({int(r["steps"]) for r in rows})
    if not horizons:
        return
    figure, axes = panels(len(horizons), 1, figsize=(11, 5 * len(horizons)), squeeze=False)
    for axis, steps in zip(axes[:, 0], horizons):
        best = best_rows([r for r in rows if int(r["steps"]) == steps and r.get("bytes_per_token_vs_ddp_fp32")
                          and int(r.get("replicas") or REPLICAS) == REPLICAS])
        for index, row in enumerate(best):
            marker = "s" if row["H"] == "0" else "o"
            axis.scatter(float(row["bytes_per_token_vs_ddp_fp32"]), float(row["final_val_loss"]), marker=marker,
                         color=colour(index), label=row["method"])
        axis.set(xscale="log", xlabel="replicate bytes per token / DDP fp32's", ylabel="final val loss",
                 title=f"{steps} steps (best lr each; squares: every step)")
        axis.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # beside the points
    save(figure, path)


def best_rows(rows: list[dict]) -> list[dict]:
    """Per (method, steps) the row of its lowest final val loss (over lrs and seeds)."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["method"], int(row["steps"]))
        if key not in best or float(row["final_val_loss"]) < float(best[key]["final_val_loss"]):
            best[key] = row
    return list(best.values())


STEP_MS_FIELDS = ["method", "steps", "step_ms"]


def measure_step_times(chosen: list[Config], args, path: Path) -> None:
    """The quiet pass: each config for args.steps steps, one at a time (nothing else should run), its
    median step time (runs.summarize) into `path` (rows of other methods kept)."""
    rows = campaign.Campaign(path, STEP_MS_FIELDS, ("method",))
    for config in chosen:
        method = config.method
        out = args.runs_dir / f"quiet{args.steps}" / method.name.replace("/", "_")
        command = method.command(method.lr, None, 0, out, runs.model_args(args), config.replicas, config.ranks_per_node)
        if rows.attempt(method.name, lambda: campaign.run_local(command, config.processes, out / "log.txt",
                                                                args.run_timeout)):
            rows.add({"method": method.name, "steps": args.steps,
                      "step_ms": f"{runs.summarize(runs.read_metrics(out)).step_ms:.1f}"})
    rows.finish("--runs-dir")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=None, help="config names (default: all of configs())")
    parser.add_argument("--lr-factors", nargs="+", type=float, default=[0.5, 1.0, 2.0],
                        help="× each config's lr (the inner lr of the 2-D weights)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--horizons", nargs="+", type=int, default=list(HORIZONS),
                        help="the H of the local-steps configs (their names: …_H<H>_…)")
    add_variant_arguments(parser)
    runs.add_model_arguments(parser)
    parser.add_argument("--run-timeout", type=float, default=7200.0)
    parser.add_argument("--runs-dir", type=Path, default=runs.LOCAL_RUNS / "localsteps")
    parser.add_argument("--csv", type=Path, default=campaign.ROOT / "results" / "localsteps.csv")
    parser.add_argument("--step-times", action="store_true",
                        help="the quiet pass instead of the campaign: each --configs config (at lr factor 1) for "
                             "--steps steps alone on the machine, one after another; their median step times go "
                             "to <csv>_step_ms.csv, from which every row's time to target is computed")
    parser.add_argument("--merge", nargs="+", type=Path, default=[],
                        help="other localsteps CSVs (with their _curves.csv) whose rows join --csv's; runs only the "
                             "--configs given (none by default)")
    args = parser.parse_args()
    every = {c.method.name: c for c in configs(args.n_embd, tuple(args.horizons), args.replicas)}
    unknown = [name for name in args.configs or [] if name not in every]
    if unknown:
        raise SystemExit(f"--configs: unknown {', '.join(unknown)}; known: {', '.join(every)}")
    chosen = variants([every[name] for name in args.configs] if args.configs else [] if args.merge
                      else list(every.values()), args)
    model = runs.model_args(args)
    tokens_per_rank = args.batch_size * args.block_size
    curves_campaign = campaign.Campaign(args.csv.with_name(args.csv.stem + "_curves.csv"), CURVE_FIELDS,
                                        (*KEY, "step"))

    def curves() -> dict:
        found: dict = {}
        for r in curves_campaign.everything():
            found.setdefault(tuple(str(r[k]) for k in KEY), []).append(
                (int(r["step"]), float(r["compute_s"]), float(r["val_loss"]), int(r["replicate_bytes"])))
        return found

    quiet_csv = args.csv.with_name(args.csv.stem + "_step_ms.csv")
    if args.step_times:
        return measure_step_times(chosen, args, quiet_csv)
    step_ms = {r["method"]: float(r["step_ms"]) for r in campaign.read_csv(quiet_csv)} if quiet_csv.exists() else {}
    finals = campaign.Campaign(args.csv, FIELDS, KEY, arrange=lambda rows: arrange(rows, curves(), step_ms))
    for other in args.merge:
        curves_campaign.add(*campaign.read_csv(other.with_name(other.stem + "_curves.csv")), show=False)
        finals.add(*({field: row.get(field, "") for field in FIELDS} for row in campaign.read_csv(other)), show=False)
    print(f"localsteps: {len(chosen)} configs × {len(args.lr_factors)} lrs × seeds {args.seeds}; {args.steps} steps "
          f"of {tokens_per_rank:,} tokens per rank; {args.replicas} × {ranks_per_node(args.replicas)} ranks", flush=True)
    for config in chosen:
        method = config.method
        for factor in args.lr_factors:
            for seed in args.seeds:
                lr, scalar_lr = method.lr * factor, method.scalar_lr
                out = runs.local_run_dir(args.runs_dir / f"s{args.steps}", method, lr, None, seed, config.ranks_per_node)
                command = method.command(lr, None, seed, out, model, config.replicas, config.ranks_per_node)
                if not finals.attempt(f"{method.name} lr {lr:g} seed {seed}", lambda: campaign.run_local(
                        command, config.processes, out / "log.txt", args.run_timeout, reuse=True)):
                    continue
                summary = runs.summarize(runs.read_metrics(out))
                key = {"method": method.name, "lr": f"{lr:g}", "scalar_lr": method.scalar_lr_text(scalar_lr),
                       "seed": seed, "steps": summary.steps}
                curves_campaign.add(*({**key, "step": step, "val_loss": f"{loss:.6f}", "replicate_bytes": sent,
                                       "compute_s": f"{seconds:.2f}"} for step, seconds, loss, sent in summary.curve),
                                    show=False)
                finals.add({**key, "inner": config.inner, "H": config.H, "replicas": config.replicas,
                            "exchange": config.exchange,
                            "outer_momentum": "" if config.outer_momentum is None else f"{config.outer_momentum:g}",
                            "outer_lr": "" if config.outer_lr is None else f"{config.outer_lr:g}",
                            "tokens": summary.steps * tokens_per_rank * config.processes, "final_val_loss": f"{summary.final_val_loss:.4f}",
                            "replicate_bytes_total": summary.replicate_bytes_total,
                            "compute_s": f"{summary.curve[-1][1]:.1f}"})
    everything = finals.everything()
    campaign.print_table(best_rows(everything))
    plot(everything, args.csv.with_suffix(".png"))
    print(f"wrote {args.csv}, {curves_campaign.path.name} and {args.csv.with_suffix('.png').name}")
    finals.finish("--runs-dir")


if __name__ == "__main__":
    main()
