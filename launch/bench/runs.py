"""What the benchmark drivers share: the methods, their command lines, and what is read back from a run
(campaign.py launches the runs, reads finished ones back and merges the rows into the CSVs).

A method is a label (the `method` column) and the command-line arguments of one of two entry points:
integrations/fsdp/train.py (shardopt's optimizers on a (replicate, shard) mesh: dion, signmuon) and
launch/bench/train_ddp.py (what users run today: DDP + AdamW/Muon, PowerSGD, post-local SGD,
signSGD with majority vote). Both write the same metrics.csv columns; `summarize` reads them.

Times: `train_seconds` adds up the measured step times (step_ms × steps of each logged window), so
evaluations, start-up and rendezvous are not in any method's time to target.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from campaign import BENCH, ROOT
from integrations.results import read_metrics  # noqa: F401  (the drivers read a run back: summarize(read_metrics(out)))
from shardopt.algorithms.polar import SCHEDULES

FSDP_TRAIN = ROOT / "integrations" / "fsdp" / "train.py"
DDP_TRAIN = BENCH / "train_ddp.py"
LOCAL_RUNS = ROOT / "runs" / "local"

SLOWLINK_FIELDS = ["method", "rate_mbit", "procs_per_node", "lr", "scalar_lr", "steps", "step_ms", "replicate_bytes_per_step",
                   "wire_bytes_per_step", "time_to_target_s", "final_val_loss"]
CONVERGENCE_FIELDS = ["method", "lr", "scalar_lr", "seed", "steps", "final_val_loss", "replicate_bytes_total"]
RUN_KEY = ("method", "lr", "scalar_lr", "seed")     # one run of convergence.py's learning-rate grid
# The scalar lr (embeddings, tied head and norms) of every method with an AdamW scalar group, and of the
# Lion-vote ones. With BPE-4096 the tied embedding is 40 % of the GPT's parameters and wants a far larger
# AdamW lr than the training scripts' default 3e-3 (their byte-level demo's): ddp_adamw's best in
# convergence.csv (scalar_lr column) and signmuon's and dion's in results/scalar_quality.csv.
ADAMW_SCALAR_LR = 0.1
LION_SCALAR_LR = 1e-2       # results/scalar_quality.csv (signmuon's best); the training scripts' default
DION_WIRE_ITEMSIZE = 2      # Dion's default wire_dtype is bfloat16 (docs/design.md §3)


@dataclass(frozen=True)
class Method:
    """One row label and how to run it. `lr` is the default learning rate of its 2-D weights,
    `scalar_lr` that of the embeddings, tied head and norms (None: the method has one lr for every
    parameter, signsgd)."""
    name: str
    script: Path
    args: tuple[str, ...]
    lr: float
    scalar_lr: float | None
    note: str = ""

    def scalar_lr_text(self, scalar_lr: float | None) -> str:
        """The scalar lr a run uses (scalar_lr, or the default where None) as the CSVs write it; "" for a
        method with one lr for every parameter."""
        return "" if self.scalar_lr is None else f"{scalar_lr or self.scalar_lr:g}"

    def command(self, lr: float, scalar_lr: float | None, seed: int, out_dir: Path, model_args: list[str],
                nodes: int, procs_per_node: int) -> list[str]:
        """The entry point's arguments (after `torchrun … script`) for one run; scalar_lr None: the default."""
        if self.scalar_lr is None and scalar_lr is not None:
            raise ValueError(f"{self.name} has one lr for every parameter; scalar_lr must be None, got {scalar_lr}")
        mesh = ["--replicate", str(nodes), "--shard", str(procs_per_node), "--check-replicas-every", "0"] \
            if self.script == FSDP_TRAIN else ["--ranks-per-node", str(procs_per_node)]
        scalar = ["--nonmatrix-lr", self.scalar_lr_text(scalar_lr)] if self.scalar_lr is not None else []
        return [str(self.script), *self.args, *mesh, "--lr", f"{lr:g}", *scalar, "--seed", str(seed),
                "--out-dir", str(out_dir), *model_args]


def powersgd_matched_rank(n_embd: int, rank_fraction: float = 0.25) -> int:
    """PowerSGD rank whose bytes match Dion at `rank_fraction`: every matrix of the GPT has
    min(m, n) = n_embd, Dion sends (m + n)·r_dion numbers in bf16, PowerSGD (m + n)·r in fp32."""
    return max(1, round(math.ceil(rank_fraction * n_embd) * DION_WIRE_ITEMSIZE / 4))


def methods(n_embd: int) -> list[Method]:
    """Every method of the benchmark, baseline first ("_lion": Lion's 1-bit vote for the non-matrix group
    instead of AdamW's full-precision mean)."""
    matched = powersgd_matched_rank(n_embd)
    adamw = ADAMW_SCALAR_LR
    return [
        Method("ddp_adamw", DDP_TRAIN, ("--method", "ddp_adamw"), 3e-3, adamw),
        Method("ddp_muon", DDP_TRAIN, ("--method", "ddp_muon"), 0.02, adamw, "torch.optim.Muon"),
        Method("powersgd_rank1", DDP_TRAIN, ("--method", "powersgd", "--powersgd-rank", "1"), 3e-3, adamw),
        Method(f"powersgd_rank{matched}", DDP_TRAIN, ("--method", "powersgd", "--powersgd-rank", str(matched)), 3e-3,
               adamw, "bytes of dion_1/4"),
        Method("localsgd", DDP_TRAIN, ("--method", "localsgd", "--local-period", "8"), 3e-3, adamw),
        Method("signsgd", DDP_TRAIN, ("--method", "signsgd"), 1e-3, None),
        Method("dion_1/4", FSDP_TRAIN, ("--optimizer", "dion", "--rank-fraction", "0.25"), 0.02, adamw),
        Method("dion_1/16", FSDP_TRAIN, ("--optimizer", "dion", "--rank-fraction", "0.0625"), 0.02, adamw),
        Method("signmuon", FSDP_TRAIN, ("--optimizer", "signmuon"), 3e-3, adamw, "non-matrix group adamw"),
        Method("signmuon_lion", FSDP_TRAIN, ("--optimizer", "signmuon", "--nonmatrix-algorithm", "lion"), 3e-3,
               LION_SCALAR_LR),
        Method("dion_1/4_lion", FSDP_TRAIN, ("--optimizer", "dion", "--rank-fraction", "0.25",
                                            "--nonmatrix-algorithm", "lion"), 0.02, LION_SCALAR_LR),
    ]


def newton_schulz_optimizer(method: Method) -> bool:
    """Whether `method` runs one of shardopt's optimizers with a Newton–Schulz step (Sign-Muon, Muon)."""
    return "--optimizer" in method.args and method.args[method.args.index("--optimizer") + 1] in ("signmuon", "muon")


def polar_variant(method: Method, ns_steps: int, coefficients: str) -> Method:
    """`method` (one of Sign-Muon's or Muon's) with `ns_steps` Newton–Schulz steps of the `coefficients`
    schedule (shardopt/algorithms/polar.py), labelled e.g. signmuon_lion_ns2_polar_express."""
    if not newton_schulz_optimizer(method):
        raise SystemExit(f"--ns-steps/--ns-coefficients: {method.name} has no Newton–Schulz step of shardopt's "
                         f"(choose signmuon methods)")
    return dataclasses.replace(method, name=f"{method.name}_ns{ns_steps}_{coefficients}",
                               args=(*method.args, "--ns-steps", str(ns_steps), "--ns-coefficients", coefficients))


def add_polar_arguments(parser) -> None:
    """--ns-steps and --ns-coefficients: the Newton–Schulz variants `polar_variants` makes."""
    parser.add_argument("--ns-steps", nargs="+", type=int, default=None,
                        help="Newton–Schulz steps of each Sign-Muon variant (default: the training script's)")
    parser.add_argument("--ns-coefficients", nargs="+", choices=tuple(SCHEDULES), default=None,
                        help="Newton–Schulz schedules of each Sign-Muon variant (default: quintic)")


def polar_variants(chosen: list[Method], args) -> list[Method]:
    """Each of `chosen` once per (--ns-coefficients, --ns-steps) (polar_variant); [] where neither is given."""
    if not (args.ns_steps or args.ns_coefficients):
        return []
    return [polar_variant(method, steps, coefficients) for method in chosen
            for coefficients in args.ns_coefficients or ["quintic"] for steps in args.ns_steps or [5]]


def overlap_variant(method: Method) -> Method:
    """`method` (one of shardopt's per-step optimizers) with each bucket's exchange started during backward
    (--overlap-backward on, docs/design.md §12), labelled e.g. dion_1/4_overlap."""
    if method.script != FSDP_TRAIN or "--local-steps" in method.args:
        raise SystemExit(f"--overlap-backward: {method.name} is not one of shardopt's per-step optimizers")
    return dataclasses.replace(method, name=f"{method.name}_overlap", args=(*method.args, "--overlap-backward", "on"))


def select(all_methods: list[Method], names: list[str] | None) -> list[Method]:
    """The methods named (all if None), with a clear error for an unknown name."""
    if not names:
        return all_methods
    by_name = {m.name: m for m in all_methods}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(by_name)}")
    return [by_name[n] for n in names]


def add_model_arguments(parser) -> None:
    """The model, data and schedule options both drivers take (passed on by `model_args`)."""
    parser.add_argument("--tokenizer", choices=("bpe", "byte"), default="bpe",
                        help="vocabulary: BPE-4096 (python integrations/data.py --tokenizer bpe) or bytes (256)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-batches", type=int, default=8)


def model_args(args) -> list[str]:
    """Model, data and schedule options (from `add_model_arguments`), the same for both entry points;
    log every step (median step time)."""
    return ["--tokenizer", args.tokenizer, "--steps", str(args.steps), "--n-embd", str(args.n_embd),
            "--n-layer", str(args.n_layer), "--n-head", "4", "--batch-size", str(args.batch_size),
            "--block-size", str(args.block_size), "--eval-every", str(args.eval_every),
            "--eval-batches", str(args.eval_batches), "--warmup", str(args.warmup), "--log-every", "1"]


def local_run_dir(root: Path, method: "Method", lr: float, scalar_lr: float | None, seed: int,
                  procs_per_node: int) -> Path:
    """Where one of convergence.py's runs on this machine lives (read back instead of rerun when finished).
    slowlink.py keeps its own runs (its step times must come from a machine doing nothing else)."""
    scalar = f"_slr{method.scalar_lr_text(scalar_lr)}" if method.scalar_lr is not None else ""
    return Path(root) / f"{method.name.replace('/', '_')}_lr{lr:g}{scalar}_seed{seed}_p{procs_per_node}"


# ---- reading a run back -----------------------------------------------------------------------
@dataclass
class Summary:
    steps: int
    step_ms: float                      # median over logged windows (per step with --log-every 1)
    replicate_bytes_per_step: float
    replicate_bytes_total: int
    final_val_loss: float
    curve: list[tuple[int, float, float, int]] = field(default_factory=list)   # (step, train s, val loss, bytes so far)
    wire_bytes_per_step: float | None = None    # link_tx_bytes from the first trained row to the last / steps between


def summarize(rows: list[dict]) -> Summary:
    """Step-time median, bytes, final val loss and the val-loss curve (by step, training seconds and
    bytes sent so far) of one run's metrics.csv rows (integrations/fsdp/train.py or train_ddp.py).

    Wire bytes per step = (link_tx_bytes at the last row − at the first trained row) / the steps between:
    the steady steps (and the evaluations among them) without the start-up before the first step;
    None where the rows have no such counter (an older run, not Linux) or fewer than two trained rows."""
    seconds, sent, previous = 0.0, 0, 0
    step_ms, curve, link = [], [], []
    for row in rows:
        step = int(row["step"])
        if row.get("step_ms"):
            seconds += float(row["step_ms"]) / 1000 * (step - previous)
            sent += int(row["replicate_bytes_per_step"]) * (step - previous)
            step_ms.append(float(row["step_ms"]))
            previous = step
            if row.get("link_tx_bytes"):
                link.append((step, int(row["link_tx_bytes"])))
        if row.get("val_loss"):
            curve.append((step, seconds, float(row["val_loss"]), sent))
    if not curve or not step_ms:
        raise ValueError("metrics.csv holds no trained step with a val loss; was the run evaluated (--eval-every)?")
    wire = (link[-1][1] - link[0][1]) / (link[-1][0] - link[0][0]) if len(link) > 1 else None
    return Summary(steps=previous, step_ms=statistics.median(step_ms), replicate_bytes_per_step=sent / max(1, previous),
                   replicate_bytes_total=sent, final_val_loss=curve[-1][2], curve=curve, wire_bytes_per_step=wire)


def time_to_target(curve: list[tuple[int, float, float, int]], target: float, seconds_per_byte: float = 0.0) -> float:
    """Training seconds at the first evaluation with val loss ≤ target (step 0 excluded: no training yet
    is no time), plus the bytes sent until then × seconds_per_byte (a link the exchange does not overlap);
    inf if never reached."""
    return next((seconds + sent * seconds_per_byte for step, seconds, loss, sent in curve
                 if step > 0 and loss <= target), math.inf)


