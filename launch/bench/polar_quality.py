"""How good and how costly is the polar step at 1, 2, 3 and 5 Newton–Schulz steps, per coefficient schedule?

    python integrations/data.py --tokenizer bpe        # once
    python launch/bench/polar_quality.py               # → results/polar_quality.csv (~2 min on 1 thread)

Real momenta: the benchmark GPT (integrations/gpt.json's 4 layers, n_embd 128, on BPE-4096: the model of
launch/bench/convergence.py) trains in one process with Sign-Muon as signmuon_lion runs it (matrices at
lr 1.5e-3, momentum 0.95, 5 quintic steps; Lion-vote embeddings and norms at 1e-2, the lrs of
results/convergence_best.csv), and the momentum of every 2-D weight is taken at each of --snapshots.
Each momentum M is orthogonalized as a whole matrix (one replica, shard 1) and as its two row blocks
(shard 2 with orthogonalize="shard": what each rank of the 2 × 2 convergence runs orthogonalizes).
For each block shape, schedule (shardopt/algorithms/polar.py SCHEDULES) and step count, against the exact polar
factor P = U·Vᵀ of the SVD M = U·Σ·Vᵀ in float64:

    sign_agreement  fraction of entries with sign(polar(M)) = sign(P) (sign(0) = +1, shardopt.wire.signs):
                    the bits Sign-Muon votes with
    relative_error  ‖polar(M) − P‖_F / ‖P‖_F (averaged over the matrices of the shape)
    ms_per_call     median CPU time of one fp32 polar call on the stack of the shape's matrices of one
                    snapshot (the optimizer's bucket: one matrix per layer), --rounds rounds interleaved
                    over every variant so that machine load hits all alike
    time_vs_default ms_per_call / that of the default (5 quintic steps) on the same shape, same run

A row with shape "all" sums the time over the shapes (one optimizer step's polar work) and averages
the qualities weighted by entries.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import shardopt
from integrations import data
from integrations.model import GPT, GPTConfig
from integrations.results import write_csv
from integrations.training import lr_multiplier
from shardopt.algorithms.polar import SCHEDULES, polar
from shardopt.wire.signs import positive_signs

from campaign import ROOT

FIELDS = ["matrices", "shape", "count", "schedule", "ns_steps", "sign_agreement", "relative_error", "ms_per_call",
          "time_vs_default"]
DEFAULT = ("quintic", 5)
BLOCKS = {"whole": 1, "shard 1/2": 2}   # label → row blocks per matrix


def train_momenta(snapshots: list[int], seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """{snapshot step: {param name: momentum (m, n)}} of the benchmark GPT trained by Sign-Muon + Lion."""
    data_dir = data.data_dir(data.default_cache(), "bpe")
    train = data.load(data_dir, "train")
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=data.vocab_size(data_dir), block_size=64, n_layer=4, n_head=4, n_embd=128))
    groups = shardopt.param_groups(model, "signmuon", "lion", nonmatrix_options=dict(lr=1e-2, weight_decay=0.0))
    optimizer = shardopt.SignMuon(groups, lr=1.5e-3, momentum=0.95, seed=seed)
    names = {param: name for name, param in model.named_parameters()}
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda taken: lr_multiplier(taken + 1, 20, 200))
    momenta = {}
    for step in range(1, max(snapshots) + 1):
        x, y = data.get_batch(train, 16, 64, seed, step, 0)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step in snapshots:
            momenta[step] = {names[p]: optimizer.state[p]["momentum"].double().clone() for p in groups[0]["params"]}
            print(f"step {step}: train loss {loss.item():.3f}, {len(momenta[step])} momenta", flush=True)
    return momenta


def exact_polar(M: torch.Tensor) -> torch.Tensor:
    """U·Vᵀ of the float64 SVD of each matrix of M (k, m, n)."""
    U, _, Vh = torch.linalg.svd(M, full_matrices=False)
    return U @ Vh


def stacks(momenta: dict[int, dict[str, torch.Tensor]]) -> dict[tuple[str, tuple[int, int]], list[torch.Tensor]]:
    """(matrices label, block shape) → one (k, m, n) float64 stack per snapshot (k: a block of every layer's
    matrix of that shape)."""
    found: dict = {}
    for per_param in momenta.values():
        by_shape: dict = {}
        for M in per_param.values():
            by_shape.setdefault(tuple(M.shape), []).append(M)
        for label, parts in BLOCKS.items():
            for (m, n), matrices in by_shape.items():
                blocks = [block for M in matrices for block in M.chunk(parts, dim=0)]
                found.setdefault((label, tuple(blocks[0].shape)), []).append(torch.stack(blocks))
    return found


def measure(momenta, ns_steps: list[int], rounds: int) -> list[dict]:
    variants = [(schedule, steps) for schedule in SCHEDULES for steps in ns_steps]
    if DEFAULT not in variants:
        variants.append(DEFAULT)
    rows = []
    for (label, shape), snapshot_stacks in stacks(momenta).items():
        exact = [exact_polar(M) for M in snapshot_stacks]
        quality = {}
        for schedule, steps in variants:
            agree, error = [], []
            for M, P in zip(snapshot_stacks, exact):
                U = polar(M, steps, torch.float32, coefficients=schedule).double()
                agree.append((positive_signs(U) == positive_signs(P)).double().mean().item())
                error.append((torch.linalg.matrix_norm(U - P) / torch.linalg.matrix_norm(P)).mean().item())
            quality[schedule, steps] = statistics.mean(agree), statistics.mean(error)
        M32 = snapshot_stacks[-1].float()
        seconds = {variant: [] for variant in variants}
        for _ in range(rounds):
            for schedule, steps in variants:
                start = time.perf_counter()
                polar(M32, steps, torch.float32, coefficients=schedule)
                seconds[schedule, steps].append(time.perf_counter() - start)
        median_ms = {variant: 1e3 * statistics.median(times) for variant, times in seconds.items()}
        for variant in variants:
            rows.append({"matrices": label, "shape": "×".join(map(str, shape)), "count": M32.shape[0],
                         "schedule": variant[0], "ns_steps": variant[1], "entries": M32.numel(),
                         "sign_agreement": quality[variant][0], "relative_error": quality[variant][1],
                         "ms": median_ms[variant]})
    return rows + totals(rows)


def totals(rows: list[dict]) -> list[dict]:
    """Per (matrices label, variant): the time summed over shapes, the qualities weighted by entries."""
    by: dict = {}
    for row in rows:
        by.setdefault((row["matrices"], row["schedule"], row["ns_steps"]), []).append(row)
    summed = []
    for (label, schedule, steps), group in by.items():
        entries = sum(r["entries"] for r in group)
        summed.append({"matrices": label, "shape": "all", "count": sum(r["count"] for r in group),
                       "schedule": schedule, "ns_steps": steps, "entries": entries,
                       "sign_agreement": sum(r["sign_agreement"] * r["entries"] for r in group) / entries,
                       "relative_error": sum(r["relative_error"] * r["entries"] for r in group) / entries,
                       "ms": sum(r["ms"] for r in group)})
    return summed


def formatted(rows: list[dict]) -> list[dict]:
    """The CSV rows: rounded, with each row's time over the default's on the same (matrices, shape)."""
    default_ms = {(r["matrices"], r["shape"]): r["ms"] for r in rows if (r["schedule"], r["ns_steps"]) == DEFAULT}
    return [{"matrices": r["matrices"], "shape": r["shape"], "count": r["count"], "schedule": r["schedule"],
             "ns_steps": r["ns_steps"], "sign_agreement": f"{r['sign_agreement']:.4f}",
             "relative_error": f"{r['relative_error']:.4f}", "ms_per_call": f"{r['ms']:.3f}",
             "time_vs_default": f"{r['ms'] / default_ms[r['matrices'], r['shape']]:.2f}"} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--snapshots", nargs="+", type=int, default=[10, 50, 100],
                        help="training steps after which the momenta are taken")
    parser.add_argument("--ns-steps", nargs="+", type=int, default=[1, 2, 3, 5])
    parser.add_argument("--rounds", type=int, default=30, help="timed calls per variant and shape")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--csv", type=Path, default=ROOT / "results" / "polar_quality.csv")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = formatted(measure(train_momenta(sorted(args.snapshots), args.seed), args.ns_steps,
                             args.rounds))
    print(" ".join(f"{field:>15}" for field in FIELDS))
    for row in rows:
        print(" ".join(f"{row[field]!s:>15}" for field in FIELDS))
    write_csv(args.csv, FIELDS, rows)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
