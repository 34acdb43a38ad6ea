"""The README's results tables (markdown), regenerated from the committed CSVs in results/.

    python launch/results_table.py                       # print the tables of results/*.csv
    python launch/results_table.py results/demo.csv      # print one
    python launch/results_table.py --readme README.md    # rewrite the README's results section (and the
                                                         # opening table, from results/comm.csv)

results/demo.csv (launch/demo.sh; one row per run as integrations/fsdp/train.py --summary-csv
writes them) becomes the table of final val loss, replicate-axis bytes per step and wall time;
bytes are those one rank sends per step on the replicate axis (the slow, between-node links),
counted by shardopt's communication layer for every optimizer alike, and "vs AdamW" divides
by the AdamW row of the same file. Any other CSV is shown column for column. In the README the
tables go between the lines <!-- results:begin --> and <!-- results:end --> (or replace a line
that reads RESULTS_TABLE, the first time).
"""

import argparse
import csv
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
HEADLINE_BEGIN, HEADLINE_END = "<!-- headline:begin (results/comm.csv) -->", "<!-- headline:end -->"


def write_csv(path, rows: list[dict]) -> None:
    """Write a benchmark's rows (dicts with the same keys) to `path`, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def human_bytes(count: float) -> str:
    """3 significant digits, decimal units: 1657092 → "1.66 MB"."""
    for unit in ("B", "KB", "MB", "GB"):
        if round(count, 1) < 1000 or unit == "GB":
            return f"{count:.3g} {unit}"
        count /= 1000


def training_table(rows: list[dict]) -> str:
    adamw = next((float(r["replicate_bytes_per_step"]) for r in rows if r["optimizer"] == "adamw"), None)
    lines = ["| optimizer | mesh (replicate × shard) | steps | final val loss | replicate-axis bytes/step | vs AdamW | wall time |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = r["optimizer"] + (f" (rank fraction {float(r['rank_fraction']):g})" if r.get("rank_fraction") else "") \
            + (f" ({r['vote']})" if r.get("vote") else "")
        sent = float(r["replicate_bytes_per_step"])
        ratio = f"1/{adamw / sent:.1f}" if adamw and sent and r["optimizer"] != "adamw" else "1" if adamw else "–"
        lines.append(f"| {name} | {r['replicate']} × {r['shard']} | {r['steps']} | {float(r['final_val_loss']):.3f} | "
                     f"{human_bytes(sent)} | {ratio} | {float(r['wall_s']):.0f} s |")
    return "\n".join(lines)


def comm_table(rows: list[dict], replicas: int = 8) -> str:
    """bench_comm.py's rows at `replicas` replicas: one line per method (and scalar algorithm), one
    column per model; a cell is DDP fp32's bytes over this method's (in brackets: over DDP bf16's),
    whole model, with ✓ where real runs at 2 and 4 processes counted exactly the formula's bytes."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    cases = list(dict.fromkeys((r["method"], r["scalar"]) for r in rows))
    header = [f"{m} ({int(next(r['params'] for r in rows if r['model'] == m)) / 1e6:,.1f} M, "
              f"{100 * float(next(r['non_matrix_share'] for r in rows if r['model'] == m)):.0f} % non-matrix)" for m in models]
    lines = [f"| replicate-axis bytes per step, whole model, {replicas} replicas: 1/(DDP fp32 ÷ method) "
             f"[vs DDP bf16] | " + " | ".join(header) + " |", "|---|" + "---:|" * len(models)]
    for method, scalar in cases:
        cells = []
        for model in models:
            row = next(r for r in rows if (r["model"], r["method"], r["scalar"], int(r["replicas"])) ==
                       (model, method, scalar, replicas))
            checked = [r for r in rows if (r["model"], r["method"], r["scalar"]) == (model, method, scalar)
                       and r["measured_equals_formula"] != ""]
            cell = f"1/{float(row['vs_ddp_fp32']):.1f} [1/{float(row['vs_ddp_bf16']):.1f}]"
            if checked:
                cell += " ✓" if all(r["measured_equals_formula"] == "True" and r["replicas_identical"] == "True"
                                    for r in checked) else " ✗"
            cells.append(cell)
        name = method + (f" + {scalar} for the rest" if scalar else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


HEADLINE_CASES = [("sign-muon", "lion", "Sign-Muon + Lion-vote"), ("dion 1/16 bf16", "lion", "Dion 1/16 (bf16 factors) + Lion-vote"),
                  ("dion 1/4 bf16", "lion", "Dion 1/4 (bf16 factors) + Lion-vote"),
                  ("sign-muon", "adamw", "Sign-Muon + AdamW mean for the rest")]
HEADLINE_MODELS = ("GPT-2 small", "Llama-3-8B shapes")


def headline_table(rows: list[dict], replicas: int = 8) -> str:
    """The README's opening table: whole-model ratios to DDP fp32 (and bf16) for two models."""
    lines = ["| whole model, " + f"{replicas} replicas | " + " | ".join(HEADLINE_MODELS) + " |",
             "|---|" + "---:|" * len(HEADLINE_MODELS)]
    for method, scalar, name in HEADLINE_CASES:
        cells = []
        for model in HEADLINE_MODELS:
            row = next(r for r in rows if (r["model"], r["method"], r["scalar"], int(r["replicas"])) ==
                       (model, method, scalar, replicas))
            cells.append(f"1/{float(row['vs_ddp_fp32']):.1f} of DDP fp32 (1/{float(row['vs_ddp_bf16']):.1f} of DDP bf16)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def slowlink_table(rows: list[dict]) -> str:
    """launch/bench/slowlink.py's rows as one line per (procs per node, method): time to the target at
    each rate, its ratio to ddp_adamw's at the same rate ("1/k": k times faster, "k×": k times the time)
    and the median step time
    there (without a limit: compute only; its growth as the rate falls is the link's share), and the
    largest ratio over the rates of the bytes node 1 put on the link to those one rank counted (1 with
    one process per node; with P, P for shardopt's P replicate groups, 1 for a DDP ring)."""
    rates = sorted({float(r["rate_mbit"]) for r in rows}, reverse=True)
    label = {rate: "no limit" if rate == float("inf") else f"{rate:g} Mbit/s" for rate in rates}
    cell = {(r["procs_per_node"], r["method"], float(r["rate_mbit"])): r for r in rows}
    lines = ["| procs/node | method | lr (scalar lr) | final val loss | "
             + " | ".join(f"{label[rate]}: time to target (vs ddp_adamw); step" for rate in rates)
             + " | wire per node / counted per rank (max) |",
             "|---:|---|---:|---:|" + "---:|" * len(rates) + "---:|"]
    for procs, method in dict.fromkeys((r["procs_per_node"], r["method"]) for r in rows):
        mine = [cell.get((procs, method, rate)) for rate in rates]
        first = next(r for r in mine if r)
        times = []
        for rate, row in zip(rates, mine):
            baseline = cell.get((procs, "ddp_adamw", rate))
            if row is None:
                times.append("–")
                continue
            seconds = float(row["time_to_target_s"])
            ratio = float(baseline["time_to_target_s"]) / seconds if baseline and seconds not in (0, float("inf")) else None
            versus = "" if not ratio or method == "ddp_adamw" else f" (1/{ratio:.1f})" if ratio >= 1 else f" ({1 / ratio:.1f}×)"
            times.append(("never" if seconds == float("inf") else f"{seconds:.1f} s{versus}")
                         + f"; {float(row['step_ms']):.0f} ms/step")
        wire = [float(r["wire_bytes_per_step"]) / float(r["replicate_bytes_per_step"]) for r in mine
                if r and r["wire_bytes_per_step"] and float(r["replicate_bytes_per_step"])]
        lines.append(f"| {procs} | {method} | {setting_text(first)} | {float(first['final_val_loss']):.3f} | "
                     + " | ".join(times)
                     + (f" | {max(wire):.2f} |" if wire else " | – |"))
    return "\n".join(lines)


def setting_text(row: dict) -> str:
    """A row's learning rates: "lr" or, with a scalar_lr column, "lr (scalar_lr)"."""
    return row["lr"] + (f" ({row['scalar_lr']})" if row.get("scalar_lr") else "")


def grid_table(rows: list[dict]) -> str:
    """A learning-rate grid (convergence.csv, fashion_mnist.csv: method, lr, [scalar_lr,] seed and a final
    metric) as one line per method: every setting it ran, by increasing lr (then scalar lr), with the metric
    of each seed (seed order); the best by the first seed is marked."""
    metric = "final_val_loss" if "final_val_loss" in rows[0] else "test_accuracy"
    what = "lr (scalar lr)" if "scalar_lr" in rows[0] else "lr"
    lines = [f"| method | {metric} at each {what} (seeds in order; best marked **) |", "|---|---|"]
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        by_setting: dict[str, list[dict]] = {}
        for r in sorted(mine, key=lambda r: (float(r["lr"]), float(r.get("scalar_lr") or 0), int(r["seed"]))):
            by_setting.setdefault(setting_text(r), []).append(r)
        first_seed = {key: float(group[0][metric]) for key, group in by_setting.items()}
        best = (min if metric == "final_val_loss" else max)(first_seed, key=first_seed.get)
        cells = [("**" if key == best else "") + f"{key}: " + " / ".join(r[metric] for r in group)
                 + ("**" if key == best else "") for key, group in by_setting.items()]
        lines.append(f"| {method} | " + " · ".join(cells) + " |")
    return "\n".join(lines)


def plain_table(rows: list[dict]) -> str:
    columns = list(rows[0]) if rows else []
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r[c] for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def tables(paths: list[Path]) -> str:
    parts = []
    for path in paths:
        with path.open() as f:
            rows = list(csv.DictReader(f))
        shown = path.relative_to(ROOT).as_posix() if path.resolve().is_relative_to(ROOT) else path.as_posix()
        render = training_table if rows and {"optimizer", "final_val_loss"} <= set(rows[0]) else \
            comm_table if rows and "vs_ddp_fp32" in rows[0] else \
            slowlink_table if rows and "time_to_target_s" in rows[0] else \
            grid_table if rows and {"method", "lr", "seed"} <= set(rows[0]) else plain_table
        parts.append(f"<!-- {shown}: python launch/results_table.py {shown} -->\n{render(rows)}")
    return "\n\n".join(parts)


def rewrite_readme(readme: Path, text: str, headline: str | None = None) -> None:
    """Put `text` between the results markers and, where the README has the headline markers and
    results/comm.csv exists, `headline` between those."""
    content = readme.read_text()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in content and END in content:
        content = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, content, count=1, flags=re.S)
    elif re.search(r"^RESULTS_TABLE$", content, flags=re.M):
        content = re.sub(r"^RESULTS_TABLE$", lambda _: block, content, count=1, flags=re.M)
    else:
        raise SystemExit(f"{readme}: no {BEGIN} … {END} block and no RESULTS_TABLE line to put the tables in")
    if headline is not None and HEADLINE_BEGIN in content and HEADLINE_END in content:
        block = f"{HEADLINE_BEGIN}\n{headline}\n{HEADLINE_END}"
        content = re.sub(re.escape(HEADLINE_BEGIN) + ".*?" + re.escape(HEADLINE_END), lambda _: block, content,
                         count=1, flags=re.S)
    temporary = readme.with_suffix(readme.suffix + ".tmp")
    temporary.write_text(content)
    temporary.replace(readme)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", nargs="*", type=Path, help="default: results/demo.csv, then the other results/*.csv")
    parser.add_argument("--readme", type=Path, help="rewrite this README's results section instead of printing")
    args = parser.parse_args()
    paths = [p.resolve() for p in args.csv] or sorted(
        (p for p in (ROOT / "results").glob("*.csv") if not p.name.endswith("_curves.csv")),   # curves: in the PNGs
        key=lambda p: (p.name != "demo.csv", p.name))
    text = tables(paths)
    if args.readme:
        comm = ROOT / "results" / "comm.csv"
        headline = headline_table(list(csv.DictReader(comm.open()))) if comm.exists() else None
        rewrite_readme(args.readme, text, headline)
        print(f"wrote the tables of {len(paths)} CSV file(s) into {args.readme}")
    else:
        print(text)


if __name__ == "__main__":
    main()
