"""Markdown tables drawn from the rows of a results CSV: one function per kind of CSV (`table` picks it by
the columns), the README's summary tables and docs/trainers.md's byte tables. launch/results_table.py
puts them into those documents and docs/results.md."""

from integrations.results import far_label, horizon_family, is_synced, lowest, method_picks, rows_by_horizon

INF = float("inf")


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
    """comm_bytes.py's rows at `replicas` replicas: one line per method (and scalar algorithm), one
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


def time_to_target(row: dict | None, baseline: dict | None) -> str:
    """A slow-link row's time to target and its ratio to `baseline`'s (ddp_adamw at the same rate and
    process count): "12.0 s (1/75.0)" is 75 times faster, "1800.0 s (2.0×)" twice the time; "never"
    where it did not reach the target, "–" where it was not measured."""
    if row is None:
        return "–"
    seconds = float(row["time_to_target_s"])
    if seconds == INF:
        return "never"
    ratio = float(baseline["time_to_target_s"]) / seconds if baseline and seconds else None
    versus = "" if not ratio or row["method"] == "ddp_adamw" else f" (1/{ratio:.1f})" if ratio >= 1 else f" ({1 / ratio:.1f}×)"
    return f"{seconds:.1f} s{versus}"


def slowlink_table(rows: list[dict]) -> str:
    """launch/bench/slowlink.py's rows as one line per (procs per node, method): time to the target at
    each rate, its ratio to ddp_adamw's at the same rate (time_to_target) and the median step time
    there (without a limit: compute only; its growth as the rate falls is the link's share), and the
    largest ratio over the rates of the bytes node 1 put on the link to those one rank counted (1 with
    one process per node; with P, P for shardopt's P replicate groups, 1 for a DDP ring)."""
    rates = sorted({float(r["rate_mbit"]) for r in rows}, reverse=True)
    label = {rate: "no limit" if rate == INF else f"{rate:g} Mbit/s" for rate in rates}
    cell = {(r["procs_per_node"], r["method"], float(r["rate_mbit"])): r for r in rows}
    lines = ["| procs/node | method | lr (scalar lr) | final val loss | "
             + " | ".join(f"{label[rate]}: time to target (vs ddp_adamw); step" for rate in rates)
             + " | wire per node / counted per rank (max) |",
             "|---:|---|---:|---:|" + "---:|" * len(rates) + "---:|"]
    for procs, method in dict.fromkeys((r["procs_per_node"], r["method"]) for r in rows):
        mine = [cell.get((procs, method, rate)) for rate in rates]
        first = next(r for r in mine if r)
        times = [time_to_target(row, cell.get((procs, "ddp_adamw", rate)))
                 + (f"; {float(row['step_ms']):.0f} ms/step" if row else "") for rate, row in zip(rates, mine)]
        wire = [float(r["wire_bytes_per_step"]) / float(r["replicate_bytes_per_step"]) for r in mine
                if r and r["wire_bytes_per_step"] and float(r["replicate_bytes_per_step"])]
        lines.append(f"| {procs} | {method} | {setting_text(first)} | {float(first['final_val_loss']):.3f} | "
                     + " | ".join(times)
                     + (f" | {max(wire):.2f} |" if wire else " | – |"))
    return "\n".join(lines)


def slowlink_summary(rows: list[dict]) -> str:
    """The README's slow-link table: one line per method but the …_overlap variants (docs/results.md has
    them), one column per limited rate and process count per node, each cell its time to ddp_adamw's
    unlimited val loss (time_to_target)."""
    rates = sorted({float(r["rate_mbit"]) for r in rows} - {INF}, reverse=True)
    columns = [(rate, procs) for rate in rates for procs in dict.fromkeys(r["procs_per_node"] for r in rows)]
    cell = {(r["procs_per_node"], r["method"], float(r["rate_mbit"])): r for r in rows}
    lines = ["| time to ddp_adamw's val loss | " + " | ".join(f"{rate:g} Mbit/s, {procs} per node"
                                                              for rate, procs in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for method in dict.fromkeys(r["method"] for r in rows if not r["method"].endswith("_overlap")):
        lines.append(f"| {method} | " + " | ".join(time_to_target(cell.get((procs, method, rate)),
                                                                  cell.get((procs, "ddp_adamw", rate)))
                                                   for rate, procs in columns) + " |")
    return "\n".join(lines)


def localsteps_summary(rows: list[dict]) -> str:
    """The README's local-steps table: per horizon (steps), ddp_adamw and signmuon_lion (per step), the best (lowest final val
    loss over lrs) DiLoCo, MuLoCo-style and LocalSteps row, and the LocalSteps row with the most x fewer
    bytes among those at or below ddp_adamw's loss (where one is; of equal bytes, the lowest loss). Rows of
    the benchmark's mesh only (2 replicas; the replicas column, blank in older files)."""
    lines = ["| steps | method | lr | final val loss | x fewer link bytes per token than DDP fp32 | "
             "time to ddp_adamw's loss at 10 Mbit/s | at 1 Mbit/s |", "|---:|---|---:|---:|---:|---:|---:|"]
    for steps in sorted({int(r["steps"]) for r in rows}):
        mine = [r for r in rows if int(r["steps"]) == steps and r["x_fewer_bytes"] and r.get("replicas", "2") in ("", "2")]

        def best(kind) -> dict | None:
            found = [r for r in mine if kind(r["method"])]
            return min(found, key=lambda r: float(r["final_val_loss"])) if found else None
        chosen = [best(lambda m, name=name: m == name) for name in ("ddp_adamw", "signmuon_lion")]
        chosen += [best(lambda m, prefix=prefix: m.startswith(prefix)) for prefix in ("diloco", "muloco", "local_")]
        baseline = chosen[0]
        if baseline is not None:
            matching = [r for r in mine if r["method"].startswith(("local_", "muloco"))
                        and float(r["final_val_loss"]) <= float(baseline["final_val_loss"])]
            chosen.append(max(matching, key=lambda r: (float(r["x_fewer_bytes"]), -float(r["final_val_loss"])))
                          if matching else None)
        shown = []
        for r in chosen:
            if r is None or r in shown:
                continue
            shown.append(r)
            times = [r[f"time_to_target_{mbit}mbit_s"] for mbit in (10, 1)]
            lines.append(f"| {steps} | {r['method']} | {r['lr']} | {float(r['final_val_loss']):.3f} | "
                         f"{float(r['x_fewer_bytes']):,.0f}× | "
                         + " | ".join(t if t == "not reached" else f"{float(t):,.0f} s" for t in times) + " |")
    return "\n".join(lines)


def unsynced(row: dict) -> str:
    """The method cell's note for a row that evaluated one replica's model (results/sizes.csv's final_model)."""
    return "" if is_synced(row) else "; rank 0's model"


def sizes_gap_table(rows: list[dict], fewest_x: float = 1000.0) -> str:
    """results/sizes.csv's summary: per size and steps, issue 42's methods (integrations.results.method_picks: the
    per-step methods, local_defaults, the best DiLoCo, MuLoCo, top-k and local-steps row, and the best of those at
    ≥ `fewest_x` × fewer link bytes per token than DDP fp32 that end synced); each with its gap (final val loss −
    the reference's best) to ddp_adamw and ddp_muon, and the spread over its runs (a row that evaluated rank 0's
    model says so)."""
    lines = ["| size (params) | steps (tokens/param) | row | method | final val loss (runs: spread) | x fewer link "
             "bytes | gap to ddp_adamw | gap to ddp_muon |", "|---|---:|---|---|---:|---:|---:|---:|"]
    for size, steps in dict.fromkeys((r["size"], int(r["steps"])) for r in rows):
        mine = [r for r in rows if (r["size"], int(r["steps"])) == (size, steps)]
        picks = method_picks(mine, fewest_x)
        for label, r in picks.items():
            losses = [float(o["final_val_loss"]) for o in mine if o["method"] == r["method"]]
            gaps = [f"{float(r['final_val_loss']) - float(ref['final_val_loss']):+.3f}" if ref else "–"
                    for ref in (picks.get("ddp_adamw"), picks.get("ddp_muon"))]
            x = f"{float(r['x_fewer_bytes']):,.0f}×" if r["x_fewer_bytes"] else "–"
            lines.append(f"| {size} ({int(r['params']) / 1e6:.2f} M) | {steps} ({int(r['tokens']) / int(r['params']):.2f}) "
                         f"| {label} | {r['method']} (lr {r['lr']}{unsynced(r)}) | {float(r['final_val_loss']):.3f} ({len(losses)}: "
                         f"{min(losses):.3f}–{max(losses):.3f}) | {x} | {gaps[0]} | {gaps[1]} |")
    return "\n".join(lines)


def sizes_horizon_table(rows: list[dict]) -> str:
    """results/sizes.csv's curve against H: per size, steps, family of local-steps rows that differ only in H
    (integrations.results.horizon_family: the optimizer inside, exchange, outer lr / momentum) and lr, the final
    val loss and x fewer link bytes at each H; ddp_adamw's and ddp_muon's best at the same size and steps beside it."""
    lines = ["| size | steps | family (lr) | final val loss (x fewer link bytes) at each H | ddp_adamw | ddp_muon |",
             "|---|---:|---|---|---:|---:|"]
    for size, steps in dict.fromkeys((r["size"], int(r["steps"])) for r in rows):
        mine = [r for r in rows if (r["size"], int(r["steps"])) == (size, steps)]
        references = [min((float(r["final_val_loss"]) for r in mine if r["method"] == name), default=None)
                      for name in ("ddp_adamw", "ddp_muon")]
        families: dict[tuple, list[dict]] = {}
        for r in mine:
            if r["H"] != "0":
                families.setdefault((horizon_family(r), r["lr"]), []).append(r)
        for (family, lr), members in families.items():
            by_h = rows_by_horizon(members)
            if len(by_h) < 2:
                continue
            cells = ", ".join(horizon_cell(H, runs) for H, runs in by_h)
            lines.append(f"| {size} | {steps} | {family} ({lr}) | {cells} | "
                         + " | ".join("–" if v is None else f"{v:.3f}" for v in references) + " |")
    return "\n".join(lines)

def horizon_cell(H: int, runs: list[dict]) -> str:
    """One H of a family: the lowest final val loss of its runs (seeds), how many when more than one, its x fewer
    link bytes, and whether it evaluated rank 0's model."""
    r = lowest(runs)
    count = f", best of {len(runs)}" if len(runs) > 1 else ""
    return f"H {H}: {float(r['final_val_loss']):.3f} ({float(r['x_fewer_bytes'] or 'nan'):,.0f}×{count}{unsynced(r)})"


def sizes_topk_table(rows: list[dict], tolerance: float = 0.02) -> str:
    """results/sizes.csv's top-k rows beside the dense rows that sent the same counted bytes: per top-k row, every
    row of another exchange at the same size, steps, H, optimizer inside, outer lr / momentum, lr and seed whose
    replicate_bytes_total is within `tolerance` of the top-k row's; the difference is top-k's loss − the dense one's."""
    lines = ["| size | steps | H | top-k (density): final val loss | dense exchange at equal bytes: final val loss | "
             "bytes, top-k / dense | top-k − dense |", "|---|---:|---:|---|---|---:|---:|"]
    same = ("size", "steps", "H", "inner", "outer_lr", "outer_momentum", "lr", "seed")
    for r in (r for r in rows if r["exchange"].startswith("topk")):
        for dense in rows:
            ratio = float(r["replicate_bytes_total"]) / float(dense["replicate_bytes_total"] or "nan")
            if dense["exchange"].startswith("topk") or any(dense[k] != r[k] for k in same) \
                    or not abs(ratio - 1) <= tolerance:
                continue
            loss, dense_loss = float(r["final_val_loss"]), float(dense["final_val_loss"])
            lines.append(f"| {r['size']} | {r['steps']} | {r['H']} | {r['exchange'].removeprefix('topk, ')}: "
                         f"{loss:.3f}{unsynced(r)} | {dense['exchange']}: {dense_loss:.3f}{unsynced(dense)} | "
                         f"{ratio:.3f} | {loss - dense_loss:+.3f} |")
    return "\n".join(lines)


def sizes_summary(rows: list[dict], steps: int = 200, fewest_x: float = 1000.0) -> str:
    """The README's table of results/sizes.csv: per size at `steps`, the best final val loss (over lrs and seeds)
    of ddp_adamw, ddp_muon, signmuon_lion and local_defaults, and the best local-steps row at ≥ `fewest_x`× fewer
    link bytes per token than DDP fp32 with its gap to ddp_adamw: the gap table's picks (results.method_picks)."""
    lines = [f"| size (params, tokens/param) | ddp_adamw | ddp_muon | signmuon_lion (32×) | local_defaults | best local "
             f"steps at ≥ {fewest_x:,.0f}× | its gap to ddp_adamw |", "|---|---:|---:|---:|---:|---|---:|"]
    for size in dict.fromkeys(r["size"] for r in rows if int(r["steps"]) == steps):
        mine = [r for r in rows if r["size"] == size and int(r["steps"]) == steps]
        picks = method_picks(mine, fewest_x)   # the gap table's rows
        best = {name: picks.get(name) for name in ("ddp_adamw", "ddp_muon", "signmuon_lion", "local_defaults")}
        pick = picks.get(far_label(fewest_x))
        cells = ["–" if r is None else f"{float(r['final_val_loss']):.3f}" for r in best.values()]
        if best["local_defaults"] is not None:
            cells[3] += f" ({float(best['local_defaults']['x_fewer_bytes']):,.0f}×)"
        far = "–" if pick is None else f"{pick['method']}: {float(pick['final_val_loss']):.3f} " \
                                       f"({float(pick['x_fewer_bytes']):,.0f}×)"
        gap = "–" if pick is None or best["ddp_adamw"] is None else \
            f"{float(pick['final_val_loss']) - float(best['ddp_adamw']['final_val_loss']):+.3f}"
        r0 = mine[0]
        lines.append(f"| {size} ({int(r0['params']) / 1e6:.1f} M, {int(r0['tokens']) / int(r0['params']):.2f}) | "
                     + " | ".join(cells) + f" | {far} | {gap} |")
    return "\n".join(lines)


def trainer_bytes_table(rows: list[dict], framework: str) -> str:
    """docs/trainers.md's table of `framework`'s rows of results/trainers.csv (launch/bench/trainer_bytes.py)."""
    lines = ["| layout | params | replicate B/step | vs an fp32 all-reduce | step 1 | step after the save |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in (r for r in rows if r["framework"] == framework):
        fp32, sent = int(r["fp32_all_reduce_bytes"]), int(r["step_bytes"])
        lines.append(f"| {r['layout']} | {int(r['params']):,} | {sent:,} | 1/{fp32 / sent:.1f} of {fp32:,} B | "
                     f"{int(r['first_step_bytes']):,} | {int(r['after_save_bytes']):,} (step {r['after_save_step']}) |")
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


def table(rows: list[dict]) -> str:
    """A CSV's full table, drawn by the function that fits its columns (a grid of one model and horizon only:
    sizes.csv's rows of several sizes and step counts are shown column for column)."""
    render = training_table if rows and {"optimizer", "final_val_loss"} <= set(rows[0]) else \
        comm_table if rows and "vs_ddp_fp32" in rows[0] else \
        slowlink_table if rows and "time_to_target_s" in rows[0] else \
        grid_table if rows and {"method", "lr", "seed"} <= set(rows[0]) and "size" not in rows[0] else plain_table
    return render(rows)
