"""Loss curves from the metrics.csv of one or more runs of integrations/fsdp/train.py.

    python integrations/plot.py runs/demo/adamw runs/demo/dion runs/demo/signmuon --out runs/demo/compare.png

One figure, two panels, one line per run: validation loss against the step, and against the
bytes one rank has sent on the replicate axis (the slow link) since step 0. A single run also
shows its train loss. Needs matplotlib (pip install -e '.[train]').
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # figures go to files: no display needed
import matplotlib.pyplot as plt  # noqa: E402

from integrations.results import read_metrics  # noqa: E402


def panels(rows: int, columns: int, **options):
    """A figure of rows × columns axes (plt.subplots' figure and axes), for `save`. Every figure of
    integrations/ and launch/bench/ starts here."""
    return plt.subplots(rows, columns, **options)


def colour(index: int) -> tuple:
    """The index-th of tab20's 20 colours (a figure of 11 or more methods needs more than the default 10)."""
    return plt.cm.tab20.colors[index % 20]


def save(figure, path: Path) -> None:
    """`figure` as a PNG at `path` (100 dpi, trimmed to what is drawn), then closed."""
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)


def points(rows: list[dict], x: str, y: str) -> list[tuple[float, float]]:
    return [(float(r[x]), float(r[y])) for r in rows if r.get(x, "") != "" and r[y] != ""]


def plot_runs(run_dirs, out: Path, title: str = "") -> None:
    """Write the two-panel figure for `run_dirs` (each labelled by its directory name) to `out`."""
    figure, (by_step, by_bytes) = panels(1, 2, figsize=(11, 4))
    for run_dir in run_dirs:
        rows = read_metrics(run_dir)
        name = Path(run_dir).name
        if len(run_dirs) == 1:
            by_step.plot(*zip(*points(rows, "step", "train_loss")), label=f"{name} train")
        by_step.plot(*zip(*points(rows, "step", "val_loss")), marker="o", label=f"{name} val")
        sent = [(x / 1e6, y) for x, y in points(rows, "replicate_bytes", "val_loss") if x > 0]
        if sent:
            by_bytes.plot(*zip(*sent), marker="o", label=name)
    by_step.set(xlabel="step", ylabel="loss (nats/token)", title=title or "loss vs step")
    by_bytes.set(xlabel="MB sent per rank on the replicate axis (log)", ylabel="val loss", xscale="log",
                 title="val loss vs replicate-axis bytes")
    for axes in (by_step, by_bytes):
        axes.legend()
        axes.grid(alpha=0.3)
    save(figure, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run directories (each with a metrics.csv)")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    plot_runs(args.runs, args.out, args.title)
    print(f"plot: wrote {args.out}")


if __name__ == "__main__":
    main()
