"""The table of launch/torchft_local.sh: one row per run (with the failure, without it, today's figure without
torchft), from each group's summary.json (its "torchft" rounds), kill.json and today/today.json.

    python launch/torchft_table.py runs/torchft_local                          # print the survivor's rounds and the table
    python launch/torchft_table.py runs/torchft_local --csv results/torchft_localsteps.csv   # and write its rows

`markdown(rows)` draws the rows of such a CSV (docs/benchmarks.md's torchft blocks, through
launch/results_table.py). Wall time lost: what the rounds with a group dead, healing or failed took beyond the
median round, on a survivor. Bytes per sync: what one rank sends in a committed round with every replica
contributing, at each replica count M (a per-step round is a step). Job wall: the slowest group's seconds from
its start (a restarted group's from its restart); the machine is shared, so it moves with the other jobs too.
"""

import argparse
import json
import statistics
from pathlib import Path

from integrations.results import write_csv

FIELDS = ["setup", "run", "groups", "steps", "killed_at_step", "replicas_alive", "rounds_committed",
          "rounds_discarded", "steps_repeated", "wall_lost_s", "bytes_per_sync_full", "bytes_per_sync_one_less",
          "heal_bytes", "final_val_loss", "val_loss_vs_without_pct", "wall_s", "job_ended_after_s",
          "last_checkpoint_step", "steps_lost"]


def summaries(out: Path, run: str, groups: int) -> dict:
    paths = {i: out / run / f"group{i}" / "summary.json" for i in range(groups)}
    return {i: json.loads(path.read_text()) for i, path in paths.items() if path.exists()}


def read_json_lines(path: Path) -> dict:
    return {k: v for line in path.read_text().splitlines() for k, v in json.loads(line).items()} if path.exists() else {}


def segments(rounds: list, t0: float) -> list:
    """Runs of rounds with the same (M, contributors, committed): (first, last, M, C, committed, ended at s)."""
    found = []
    for index, entry in enumerate(rounds):
        key = (entry["replicas"], entry["contributors"], entry["committed"])
        if found and found[-1][2:5] == key:
            found[-1] = (found[-1][0], index, *key, entry["ended_at"] - t0)
        else:
            found.append((index, index, *key, entry["ended_at"] - t0))
    return found


def alive_text(found: list) -> str:
    """Replicas alive over time, from the segments: "3 → 2 (17.0 s) → 3, 2 contributing (22.1 s) → 3 (25.3 s)"."""
    parts, previous, since = [], None, None
    for _, _, m, c, committed, ended in found:
        state = f"{m}" + (f", {c} contributing" if c < m else "") + ("" if committed else ", discarded")
        if state != previous:
            parts.append(state if since is None else f"{state} ({since:.1f} s)")
            previous = state
        since = ended
    return " → ".join(parts)


def mean_loss(found: dict) -> float:
    return sum(s["final_val_loss"] for s in found.values()) / len(found)


def rows(out: Path, setup: str, groups: int, kill_group: int) -> list[dict]:
    """The CSV rows of one launcher run (module docstring); prints the survivor's rounds."""
    failure, baseline = summaries(out, "failure", groups), summaries(out, "baseline", groups)
    kill = read_json_lines(out / "failure" / "kill.json")
    survivor = next(i for i in failure if i != kill_group)
    rounds = [r for r in failure[survivor]["torchft"]["rounds"] if not r["join"]]
    t0 = kill.get("started", rounds[0]["ended_at"] - rounds[0]["seconds"])
    found = segments(rounds, t0)
    print(f"## {setup}: {groups} groups, survivor group {survivor}'s rounds\n")
    print("| rounds | replicas M | contributors | committed | ended at (s) |\n|---|---|---|---|---|")
    for first, last, m, c, committed, ended in found:
        print(f"| {first + 1}–{last + 1} | {m} | {c} | {'yes' if committed else 'no'} | {ended:.1f} |")
    median = statistics.median(r["seconds"] for r in rounds)
    hit = [r for r in rounds if not r["committed"] or r["contributors"] < groups]   # a group dead, healing or failed
    ft = failure[survivor]["torchft"]
    by_m = {int(m): n for m, n in ft["bytes_per_round_by_replicas"].items()}
    base = {"setup": setup, "groups": groups, "steps": failure[survivor]["steps"], **{k: "" for k in FIELDS[4:]}}
    without = mean_loss(baseline) if baseline else None
    table = [{**base, "run": "with the failure", "killed_at_step": kill.get("killed_at_step", ""),
              "replicas_alive": alive_text(found), "rounds_committed": ft["rounds_committed"],
              "rounds_discarded": ft["rounds_discarded"], "steps_repeated": ft.get("steps_repeated", ""),
              "wall_lost_s": round(sum(max(0.0, r["seconds"] - median) for r in hit), 1),
              "bytes_per_sync_full": by_m.get(groups, ""), "bytes_per_sync_one_less": by_m.get(groups - 1, ""),
              "heal_bytes": failure.get(kill_group, {}).get("torchft", {}).get("heal_bytes_received", ""),
              "final_val_loss": round(mean_loss(failure), 4), "wall_s": max(s["wall_s"] for s in failure.values()),
              "val_loss_vs_without_pct": round(100 * (mean_loss(failure) / without - 1), 2) if without else ""}]
    if baseline:
        ft = baseline[survivor]["torchft"]
        table.append({**base, "run": "without", "replicas_alive": alive_text(segments(
            [r for r in ft["rounds"] if not r["join"]], 0.0)), "rounds_committed": ft["rounds_committed"],
            "rounds_discarded": ft["rounds_discarded"], "steps_repeated": ft.get("steps_repeated", ""),
            "bytes_per_sync_full": ft["bytes_per_round_by_replicas"].get(str(groups), ""),
            "final_val_loss": round(without, 4), "wall_s": max(s["wall_s"] for s in baseline.values())})
    today = read_json_lines(out / "today" / "today.json")
    if today:
        table.append({**base, "run": "today (one torchrun world, no torchft)", "killed_at_step": today["killed_at_step"],
                      "replicas_alive": f"{groups} → the job ends (exit code {today['job_exit_code']})",
                      "job_ended_after_s": today["job_ended_after_s"],
                      "last_checkpoint_step": today["last_checkpoint_step"],
                      "steps_lost": today["killed_at_step"] - today["last_checkpoint_step"]})
    return table


def markdown(table: list[dict]) -> str:
    """The rows of a results/torchft_*.csv as docs/benchmarks.md shows them."""
    groups = int(table[0]["groups"])
    lines = [f"| run | replicas alive over time (M; the time it changed) | rounds committed / discarded | wall time "
             f"lost (s) | bytes per sync at M = {groups} | at M = {groups - 1} | heal (bytes) | final val loss "
             f"(vs without) | job wall (s) |", "|---|---|---|---:|---:|---:|---:|---|---:|"]
    for r in table:
        if r["steps_lost"] != "":
            since = f"the last checkpoint (step {r['last_checkpoint_step']})" if int(r["last_checkpoint_step"]) else \
                "the start (no checkpoint yet)"
            lines.append(f"| {r['run']}, killed at step {r['killed_at_step']} | {r['replicas_alive']}, "
                         f"{float(r['job_ended_after_s']):.1f} s after the kill | – | {int(r['steps_lost'])} steps "
                         f"lost since {since} | | | | – | – |")
            continue
        killed = f", killed at step {r['killed_at_step']}" if r["killed_at_step"] != "" else ""
        versus = f" ({float(r['val_loss_vs_without_pct']):+.2f} %)" if r["val_loss_vs_without_pct"] != "" else ""
        number = lambda key: f"{int(r[key]):,}" if r[key] != "" else "–"   # noqa: E731
        lines.append(f"| {r['run']}{killed} | {r['replicas_alive']} | {r['rounds_committed']} / {r['rounds_discarded']} "
                     f"| {r['wall_lost_s'] or '–'} | {number('bytes_per_sync_full')} | "
                     f"{number('bytes_per_sync_one_less')} | {number('heal_bytes')} | "
                     f"{float(r['final_val_loss']):.4f}{versus} | {float(r['wall_s']):.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the launcher's OUT folder")
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--kill-group", type=int, default=1)
    parser.add_argument("--setup", help="what ran (the CSV's first column); default: from the summaries")
    parser.add_argument("--csv", type=Path, help="write the rows to this CSV (e.g. results/torchft_perstep.csv)")
    args = parser.parse_args()
    first = summaries(args.out, "failure", args.groups)
    some = next(iter(first.values()))
    setup = args.setup or (f"local steps ({some['outer_exchange']}, H = {some['local_steps']}, inner "
                           f"{some['optimizer']} + {some['scalar_algorithm']})" if some.get("local_steps") else
                           f"per-step {some['optimizer']} + {some['scalar_algorithm']}") + f", {some['tokenizer']} GPT"
    table = rows(args.out, setup, args.groups, args.kill_group)
    print("\n" + markdown(table))
    if args.csv:
        write_csv(args.csv, FIELDS, [{key: row[key] for key in FIELDS} for row in table])
        print(f"\nwrote {args.csv}")


if __name__ == "__main__":
    main()
