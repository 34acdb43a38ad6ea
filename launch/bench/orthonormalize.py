"""Dion's orthonormalization (qr_method) in float32 on the CPU: accuracy per matrix class, and a short training.

    python launch/bench/orthonormalize.py       # → results/orthonormalize.csv, results/orthonormalize_dion.csv
    python launch/bench/orthonormalize.py --part matrices --shapes 64x16 768x64   # a quick look

Matrices (results/orthonormalize.csv): stacks of 2 P (a×r, float32) at the shapes Dion orthonormalizes
(a = 64..4096, r = 4..256) of each class: Gaussian; P = U·diag(σ)·Vᵀ with σ from 1 down to 1/κ, κ = 1e4, 1e8,
1e12; exactly low rank (A·B made in float32 with inner size r/4, or 1, as a first step's B·Q from a small
batch); every third column zero; every odd column a copy of an even one; all zeros (Dion zeroes it). For each
qr_method: the worst over the stack of ‖QᵀQ − I‖₂ and of ‖P − Q·QᵀP‖_F/‖P‖_F (P in span(Q); Householder's
own value is the float32 floor), the smallest number of singular values of Q above 1/2 (r: full rank), and
how many matrices the device-side guard zeroed (a failed factorization; an all-zero P is always zeroed).

Training (results/orthonormalize_dion.csv): a 3-layer MLP student (256→512→512→256, no bias) fitted to a
fixed random teacher of the same shape by Dion (rank_fraction 1/4, r = 64, lr 0.02) for --steps steps from
the same initial weights on the same batches, once per qr_method, at a small batch (8 rows: the first
gradients have rank 8 < r, so the first P are exactly rank deficient) and a large one (256 rows). Reports the
final and the mean training loss of the last 20 steps, and ‖X − X_qr‖/‖X_qr‖ against the Householder run.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import torch

import shardopt
from shardopt.algorithms.lowrank import orthonormalize

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("qr", "cholesky", "rcqr")
SHAPES = ("64x4", "64x16", "768x64", "1024x128", "4096x64", "4096x256")
KINDS = ("gaussian", "kappa 1e4", "kappa 1e8", "kappa 1e12", "rank r/4", "rank 1", "zero columns",
         "repeated columns", "all zero")


def test_matrix(kind: str, a: int, r: int, seed: int = 1) -> torch.Tensor:
    """A stack of 2 float32 P (a, r) of the class `kind` (the module docstring's list)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(2, *shape, generator=generator, dtype=dtype)
    if kind.startswith("kappa"):
        U, V = torch.linalg.qr(randn(a, r, dtype=torch.float64)).Q, torch.linalg.qr(randn(r, r, dtype=torch.float64)).Q
        sigma = torch.logspace(0, -math.log10(float(kind.split()[1])), r, dtype=torch.float64)
        return ((U * sigma) @ V.mT).float()
    if kind.startswith("rank"):
        inner = max(1, r // 4) if kind == "rank r/4" else 1
        return randn(a, inner) @ randn(inner, r)
    P = randn(a, r)
    if kind == "zero columns":
        P[..., ::3] = 0
    elif kind == "repeated columns":
        P[..., 1::2] = P[..., 0::2][..., :r // 2]
    elif kind == "all zero":
        P.zero_()
    return P


def accuracy(P: torch.Tensor, Q: torch.Tensor) -> dict:
    """The worst over the stack of ‖QᵀQ − I‖₂ and ‖P − Q·QᵀP‖_F/‖P‖_F, the smallest count of singular values of Q
    above 1/2, and how many Q are all zeros."""
    r = P.shape[-1]
    finite = torch.isfinite(Q).all(dim=-1).all(dim=-1)
    Q = torch.where(finite[:, None, None], Q, torch.zeros_like(Q))          # a non-finite Q counts as no basis
    orthogonality = torch.linalg.matrix_norm(Q.mT @ Q - torch.eye(r), ord=2)
    norms = torch.linalg.matrix_norm(P)
    residual = torch.linalg.matrix_norm(P - Q @ (Q.mT @ P)) / torch.where(norms > 0, norms, 1)
    rank = (torch.linalg.svdvals(Q) > 0.5).sum(-1)
    return {"orthogonality": f"{orthogonality.max().item():.2e}", "residual": f"{residual.max().item():.2e}",
            "min_rank": int(rank.min()), "zeroed": int(((Q == 0).all(dim=-1).all(dim=-1) | ~finite).sum())}


def matrices(shapes) -> list[dict]:
    rows = []
    for shape in shapes:
        a, r = map(int, shape.split("x"))
        for kind in KINDS:
            P = test_matrix(kind, a, r)
            for method in METHODS:
                row = {"qr_method": method, "matrix": kind, "a": a, "r": r, **accuracy(P, orthonormalize(P, method))}
                rows.append(row)
                print(*row.values(), sep="\t", flush=True)
    return rows


def train(method: str, batch: int, steps: int, seed: int = 0) -> tuple[list[float], list[torch.Tensor]]:
    """Fit the MLP student to the teacher with Dion(qr_method=method); returns (losses, final weights)."""
    generator = torch.Generator().manual_seed(seed)
    widths = (256, 512, 512, 256)
    teacher = [torch.randn(o, i, generator=generator) / math.sqrt(i) for i, o in zip(widths, widths[1:])]
    student = [torch.nn.Parameter(torch.randn(o, i, generator=generator) / math.sqrt(i))
               for i, o in zip(widths, widths[1:])]
    optimizer = shardopt.Dion(student, lr=0.02, rank_fraction=0.25, qr_method=method, seed=seed)

    def forward(weights, x):
        for index, W in enumerate(weights):
            x = x @ W.T
            x = torch.tanh(x) if index < len(weights) - 1 else x
        return x
    losses = []
    for _ in range(steps):
        x = torch.randn(batch, widths[0], generator=generator)
        loss = (forward(student, x) - forward(teacher, x)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [W.detach().clone() for W in student]


def training(steps: int) -> list[dict]:
    rows = []
    for batch in (8, 256):
        runs = {method: train(method, batch, steps) for method in METHODS}
        householder = runs["qr"][1]
        for method, (losses, weights) in runs.items():
            drift = max(((W - H).norm() / H.norm()).item() for W, H in zip(weights, householder))
            row = {"qr_method": method, "batch": batch, "steps": steps, "first_loss": f"{losses[0]:.4f}",
                   "final_loss": f"{losses[-1]:.4f}", "last20_mean_loss": f"{sum(losses[-20:]) / 20:.4f}",
                   "weights_vs_qr": f"{drift:.2e}"}
            rows.append(row)
            print(*row.values(), sep="\t", flush=True)
    return rows


def write(rows: list[dict], path: Path):
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("matrices", "dion", "both"), default="both")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="a×r, e.g. 768x64")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.part in ("matrices", "both"):
        write(matrices(args.shapes), args.out / "orthonormalize.csv")
    if args.part in ("dion", "both"):
        write(training(args.steps), args.out / "orthonormalize_dion.csv")


if __name__ == "__main__":
    main()
