"""The files results are kept in: CSVs with a fixed set of columns (results/*.csv, a run's metrics.csv)
and the device a benchmark row was measured on. Shared by the training scripts, the benchmarks in
launch/bench/, launch/results_table.py and integrations/plot.py."""

from __future__ import annotations

import csv
from pathlib import Path

import torch


def read_csv(path: Path) -> list[dict]:
    """The rows of a CSV with a header, as dicts of strings."""
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def write_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    """Rows with exactly `fields` as columns (a missing or extra key is an error, not a blank), the
    folder made if needed."""
    for row in rows:
        if list(row) != fields:
            raise ValueError(f"row columns {list(row)} differ from the schema {fields}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(rows)


def read_metrics(run_dir: Path) -> list[dict]:
    """A training run's metrics.csv (integrations/training.Metrics: one row per logged step)."""
    return read_csv(Path(run_dir) / "metrics.csv")


def is_synced(row: dict) -> bool:
    """Whether a row of results/sizes.csv evaluated the replicas' synced model (final_model "synced"; blank in
    rows of other CSVs) rather than one replica's."""
    return row.get("final_model", "synced") in ("synced", "")


def lowest(rows) -> dict | None:
    """The row of `rows` with the lowest final val loss (None when there is none)."""
    return min(rows, key=lambda r: float(r["final_val_loss"]), default=None)


def lowest_far(rows: list[dict], fewest_x: float) -> dict | None:
    """The lowest local-steps row of `rows` at ≥ `fewest_x`× fewer link bytes per token than DDP fp32, of those that
    end synced (the final sync's bytes counted; rows from before it evaluated rank 0's model and counted none)."""
    return lowest(r for r in rows if r["H"] != "0" and r["x_fewer_bytes"] and float(r["x_fewer_bytes"]) >= fewest_x
                  and is_synced(r))


def far_label(fewest_x: float) -> str:
    """method_picks' label of the best local-steps row at ≥ `fewest_x`× fewer link bytes."""
    return f"best at ≥ {fewest_x:,.0f}×"


def method_picks(rows: list[dict], fewest_x: float = 1000.0) -> dict[str, dict]:
    """Issue 42's methods among `rows` (one size and step count of results/sizes.csv), each its lowest row over
    lrs, seeds and settings: the per-step methods and local_defaults (and local_defaults_m0.6, the earlier
    defaults) by name, DiLoCo / MuLoCo (diloco_*, muloco_*) and top-k (its exchange) over every H and outer
    setting, the best local-steps row and the best of those at ≥ `fewest_x`× (lowest_far); label → row, the
    labels with no row left out."""
    picks = {name: lowest(r for r in rows if r["method"] == name) for name in
             ("ddp_adamw", "ddp_muon", "signmuon_lion", "dion_1/4_lion", "local_defaults", "local_defaults_m0.6")}
    picks["DiLoCo"] = lowest(r for r in rows if r["method"].startswith("diloco_"))
    picks["MuLoCo"] = lowest(r for r in rows if r["method"].startswith("muloco_"))
    picks["topk"] = lowest(r for r in rows if r["exchange"].startswith("topk"))
    picks["best local steps"] = lowest(r for r in rows if r["H"] != "0" and r["x_fewer_bytes"])
    picks[far_label(fewest_x)] = lowest_far(rows, fewest_x)
    return {label: row for label, row in picks.items() if row is not None}


def horizon_family(row: dict) -> str:
    """The local-steps rows that differ only in H, named by what they share: the optimizer inside, the outer
    exchange, the outer lr / momentum and the model evaluated (a row of results/sizes.csv → "muon, sign_vote,
    block 128, outer 0.7 / 0"; "…, rank 0's model" where it evaluated one replica's, final_model).
    local_defaults at H 30 and local_muon_H40_sign_vote_b128_olr0.7_m0 are one family when LocalSteps' defaults
    are those settings."""
    unsynced = "" if is_synced(row) else ", rank 0's model"
    return f"{row['inner']}, {row['exchange']}, outer {row['outer_lr']} / {row['outer_momentum']}{unsynced}"


def rows_by_horizon(rows: list[dict]) -> list[tuple[int, list[dict]]]:
    """`rows` (one family's: horizon_family) grouped by their H, in order of H."""
    grouped: dict[int, list[dict]] = {}
    for row in rows:
        grouped.setdefault(int(row["H"]), []).append(row)
    return sorted(grouped.items())


def device_name(device: torch.device) -> str:
    """The `device` column of a benchmark row: the GPU's name, or "cpu (N threads)"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"
