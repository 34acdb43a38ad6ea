"""The table of launch/torchft_local.sh, from each group's summary.json (its "torchft" rounds) and kill.json."""

import argparse
import json
import statistics
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--groups", type=int, default=3)
parser.add_argument("--kill-group", type=int, default=1)
args = parser.parse_args()


def summaries(run: str) -> dict:
    found = {}
    for i in range(args.groups):
        path = args.out / run / f"group{i}" / "summary.json"
        if path.exists():
            found[i] = json.loads(path.read_text())
    return found


failure, baseline = summaries("failure"), summaries("baseline")
kill_path = args.out / "failure" / "kill.json"
kill = {k: v for line in kill_path.read_text().splitlines() for k, v in json.loads(line).items()} if \
    kill_path.exists() else {}
survivor = next(i for i in failure if i != args.kill_group)
rounds = [r for r in failure[survivor]["torchft"]["rounds"] if not r["join"]]
t0 = kill.get("started", rounds[0]["ended_at"] - rounds[0]["seconds"])
print(f"## torchft local run: {args.groups} groups, survivor group {survivor}'s view\n")
print("| rounds | replicas M | contributors | committed | ended at (s) |\n|---|---|---|---|---|")
segment = []
for index, entry in enumerate(rounds + [None]):
    key = None if entry is None else (entry["replicas"], entry["contributors"], entry["committed"])
    if segment and (entry is None or key != segment[0][1]):
        first, last = segment[0][0], segment[-1][0]
        m, c, ok = segment[0][1]
        print(f"| {first + 1}–{last + 1} | {m} | {c} | {'yes' if ok else 'no'} | {rounds[last]['ended_at'] - t0:.1f} |")
        segment = []
    if entry is not None:
        segment.append((index, key))
median = statistics.median(r["seconds"] for r in rounds)
full = max(r["replicas"] for r in rounds)
hit = [r for r in rounds if not r["committed"] or r["contributors"] < full]   # a group dead, healing or failed
lost = sum(max(0.0, r["seconds"] - median) for r in hit)
ft = failure[survivor]["torchft"]
print(f"\nrounds committed {ft['rounds_committed']}, discarded {ft['rounds_discarded']}; median round "
      f"{median:.2f} s; the {len(hit)} rounds with a group dead, healing or failed took {lost:.1f} s more than "
      f"the median (the survivor's wall time lost)")
if kill:
    healed = failure.get(args.kill_group, {}).get("torchft", {})
    print(f"killed group {args.kill_group} at step {kill['killed_at_step']} "
          f"({kill['killed_at'] - t0:.1f} s), restarted {kill['restarted_at'] - kill['killed_at']:.1f} s later; "
          f"heal: {healed.get('heal_bytes_received', 0):,} B received")
print("\n| replicas M | bytes per sync (one rank sends) |\n|---|---|")
for m, nbytes in sorted(ft["bytes_per_round_by_replicas"].items(), key=lambda kv: -int(kv[0])):
    print(f"| {m} | {nbytes:,} |")
print("\n| run | final val loss (per group: each reads its own val batches) | wall s |\n|---|---|---|")
for name, found in (("with the failure", failure), ("without", baseline)):
    if found:
        losses = ", ".join(f"{s['final_val_loss']:.4f}" for s in found.values())
        mean = sum(s["final_val_loss"] for s in found.values()) / len(found)
        print(f"| {name} | {losses} (mean {mean:.4f}) | {max(s['wall_s'] for s in found.values())} |")
