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


def horizon_family(row: dict) -> str:
    """The local-steps rows that differ only in H, named by what they share: the optimizer inside, the outer
    exchange, the outer lr / momentum and the model evaluated (a row of results/sizes.csv → "muon, sign_vote,
    block 128, outer 0.7 / 0"; "…, rank 0's model" where it evaluated one replica's, final_model).
    local_defaults at H 30 and local_muon_H40_sign_vote_b128_olr0.7_m0 are one family when LocalSteps' defaults
    are those settings."""
    unsynced = "" if row.get("final_model", "synced") in ("synced", "") else ", rank 0's model"
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
