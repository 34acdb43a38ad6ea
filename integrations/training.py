"""What a fair comparison needs identical in the two training scripts of the small GPT,
integrations/fsdp/train.py (shardopt's optimizers under FSDP2) and launch/bench/train_ddp.py (DDP
and torch's hooks): the options and their defaults, the batches, the lr schedule, the evaluation
and the metrics rows.

Options come from, in rising order: JSON files of defaults (integrations/gpt.json for the model,
data and schedule both scripts share; a script adds its own), the `--config` files a user names,
and the command line (nanoGPT's pattern). A JSON file is an object of option values by their
destination names: {"n_embd": 256, "steps": 1000}.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from integrations import data
from integrations.netdev import link_tx_bytes
from integrations.results import read_csv

ROOT = Path(__file__).resolve().parents[1]
GPT_DEFAULTS = ROOT / "integrations" / "gpt.json"


# ---- options ------------------------------------------------------------------------------------
def add_gpt_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, data, schedule and evaluation options of both scripts (defaults: gpt.json)."""
    parser.add_argument("--n-layer", type=int, help="transformer blocks")
    parser.add_argument("--n-head", type=int, help="attention heads")
    parser.add_argument("--n-embd", type=int, help="width")
    parser.add_argument("--block-size", type=int, help="context length")
    parser.add_argument("--batch-size", type=int, help="sequences per rank per micro-batch")
    parser.add_argument("--steps", type=int, help="length of the run (and of the lr schedule)")
    parser.add_argument("--warmup", type=int, help="linear lr warm-up steps, then cosine to 10%%")
    parser.add_argument("--log-every", type=int, help="a metrics row every N steps")
    parser.add_argument("--eval-every", type=int, help="evaluate every N steps and at the last (0: not in training)")
    parser.add_argument("--eval-batches", type=int, help="val batches per rank per evaluation")
    parser.add_argument("--tokenizer", choices=data.TOKENIZERS, help="byte (vocab 256) or BPE (vocab 4096: "
                        "prepare with python integrations/data.py --tokenizer bpe)")
    parser.add_argument("--data-dir", type=Path, help="default: the prepared data of --tokenizer")
    parser.add_argument("--seed", type=int, help="of the initial weights and the batches")


class _Renamed(argparse.Action):
    """The old spelling of a renamed option: stores into the new option's destination and prints a
    deprecation warning once per process (on rank 0 under torchrun)."""
    warned: set[str] = set()

    def __init__(self, *args, new: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string not in self.warned and os.environ.get("RANK", "0") == "0":
            print(f"DeprecationWarning: {option_string} is renamed {self.new}; the old spelling goes in a later "
                  f"release", file=sys.stderr)
        self.warned.add(option_string)
        setattr(namespace, self.dest, values)


def add_renamed(parser: argparse.ArgumentParser, new: str, old: str, **kwargs) -> None:
    """Option `new` (kwargs as for add_argument), also accepted as `old`, hidden from --help."""
    action = parser.add_argument(new, **kwargs)
    parser.add_argument(old, dest=action.dest, action=_Renamed, new=new, nargs=action.nargs, type=action.type,
                        choices=action.choices, metavar=action.metavar, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)


def parse_args(parser: argparse.ArgumentParser, *default_files: Path, **derived) -> argparse.Namespace:
    """The options: defaults from `default_files` (later over earlier) and `derived` (values read from the
    library, e.g. an optimizer's signature, so no file repeats them), then each --config file, then the command
    line. A --config key that no default has is an error naming the known ones."""
    defaults = {}
    for path in default_files:
        defaults |= json.loads(Path(path).read_text())
    defaults |= derived
    parser.add_argument("--config", type=Path, action="append", default=[], metavar="JSON",
                        help="a JSON file of option values over the defaults "
                             f"({', '.join(Path(p).resolve().relative_to(ROOT).as_posix() for p in default_files)}"
                             f"{' and the library signatures' if derived else ''}); the command line overrides it")
    parser.set_defaults(**defaults)
    configs = argparse.ArgumentParser(add_help=False)
    configs.add_argument("--config", type=Path, action="append", default=[])
    for path in configs.parse_known_args()[0].config:
        values = json.loads(path.read_text())
        unknown = sorted(set(values) - set(defaults))
        if unknown:
            parser.error(f"--config {path}: unknown keys {unknown}; known: {', '.join(sorted(defaults))}")
        parser.set_defaults(**values)
    args = parser.parse_args()
    args.data_dir = args.data_dir or data.data_dir(data.default_cache(), args.tokenizer)
    return args


# ---- batches, lr schedule, evaluation -----------------------------------------------------------
class Batches:
    """One rank's batches: batch `step` of a split is data.get_batch(tokens, batch_size, block_size,
    seed, step, rank, split), a function of (seed, step, rank) alone, so a resumed run reads what an
    uninterrupted one would. Train batches count from 1 (the step), val batches from 0."""

    def __init__(self, args: argparse.Namespace, rank: int, device: torch.device):
        self.tokens = {split: data.load(args.data_dir, split) for split in ("train", "val")}
        self.args, self.rank, self.device = args, rank, device

    def __call__(self, split: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (batch_size, block_size) int64 on the device."""
        a = self.args
        x, y = data.get_batch(self.tokens[split], a.batch_size, a.block_size, a.seed, step, self.rank, split)
        return x.to(self.device), y.to(self.device)


def lr_multiplier(step: int, warmup: int, steps: int) -> float:
    """The lr of step `step` (from 1) over the base lr: linear warm-up over `warmup` steps, then cosine
    from 1 to 0.1 at `steps`."""
    if step <= warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a one-element tensor over every rank of the world (fp32 all-reduce sum / world size)."""
    value = value.detach().float().reshape(1).clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Batches, eval_batches: int) -> float:
    """Mean val loss over val batches 0 … eval_batches − 1 of every rank, averaged over all ranks."""
    model.eval()
    losses = torch.stack([model(*batches("val", i))[1].float() for i in range(eval_batches)])
    model.train()
    return mean_over_ranks(losses.mean())


def log_and_eval(step: int, last: int, args: argparse.Namespace) -> tuple[bool, bool]:
    """(log a metrics row at `step`, evaluate there): every --log-every steps and at every evaluation;
    evaluations every --eval-every steps (0: none) and at the last step."""
    evaluate_now = bool(args.eval_every) and (step % args.eval_every == 0 or step == last)
    return step % args.log_every == 0 or evaluate_now or step == last, evaluate_now


# ---- metrics ------------------------------------------------------------------------------------
def metrics_row(step: int, tokens: int, lr: float, train_loss: float, val_loss: float | None, steps: int,
                seconds: float, replicate_bytes: int, started: float) -> dict:
    """The columns both scripts' metrics.csv have, formatted alike, for a window of `steps` steps that
    took `seconds` and sent `replicate_bytes` between nodes (one rank's)."""
    return {"step": step, "tokens": tokens, "lr": f"{lr:.6g}", "train_loss": f"{train_loss:.6f}",
            "val_loss": "" if val_loss is None else f"{val_loss:.6f}", "step_ms": f"{1000 * seconds / steps:.2f}",
            "replicate_bytes_per_step": replicate_bytes // steps, "link_tx_bytes": link_tx_bytes() or "",
            "elapsed_s": f"{time.perf_counter() - started:.1f}"}


class Metrics:
    """metrics.csv of a run, one row per logged step, written by rank 0 (`write`); every rank keeps the
    rows. With `resume_step`, the rows of an earlier run up to that step are kept. `tensorboard` (column →
    tag) also logs those columns to <folder>/tensorboard (purge_step drops the events a crashed run
    logged after the step it resumes from)."""

    def __init__(self, path: Path, fields: list[str], write: bool, resume_step: int = 0,
                 tensorboard: dict[str, str] | None = None):
        self.path, self.fields, self.write, self.tags = path, fields, write, tensorboard or {}
        self.rows: list[dict] = []
        self.board = None
        if write:
            path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step and path.exists():
                self.rows = [row for row in read_csv(path) if int(row["step"]) <= resume_step]
            with path.open("w", newline="") as f:
                csv.DictWriter(f, fields).writeheader()
                csv.DictWriter(f, fields).writerows(self.rows)
            if self.tags:
                from torch.utils.tensorboard import SummaryWriter
                self.board = SummaryWriter(path.parent / "tensorboard", purge_step=resume_step + 1)

    def add(self, row: dict) -> None:
        """Append `row` (missing columns empty)."""
        row = dict.fromkeys(self.fields, "") | row
        self.rows.append(row)
        if self.write:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, self.fields).writerow(row)
        if self.board:
            for field, tag in self.tags.items():
                if row[field] != "":
                    self.board.add_scalar(tag, float(row[field]), int(row["step"]))
            self.board.flush()

    def close(self) -> None:
        if self.board:
            self.board.close()


def append_csv(path: Path, row: dict) -> None:
    """Append one row to a CSV, with a header if the file is new."""
    new_file = not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, list(row))
        if new_file:
            writer.writeheader()
        writer.writerow(row)
