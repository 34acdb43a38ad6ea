"""Float64 references written from docs/design.md's equations (plain loops, no shardopt math).

Every function works on one whole matrix X (m×n) as float64; distributed
tests feed them the quantities a single process would see.
"""

import math

import torch


def newton_schulz(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """docs/design.md §2 quintic on one float64 matrix: wide orientation, Frobenius-normalized start."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def dion_step(X, G, M, Q, *, lr, mu, weight_decay, epsilon=1e-8, transpose: bool):
    """docs/design.md §1 steps 1–7 on one matrix. M is m×n (X's orientation), Q is b×r. Returns (X, M, Q)."""
    Gb, Mb = (G.T, M.T) if transpose else (G, M)
    B = Mb + Gb
    P = B @ Q
    if P.abs().max() == 0:
        P_orth = torch.zeros_like(P)
    else:
        P_orth = torch.linalg.qr(P).Q
    R = B.T @ P_orth
    B = B - (1 - mu) * P_orth @ R.T
    norms = R.norm(dim=0)
    Q_new = torch.where(norms > 0, R / (norms + epsilon), Q)
    update = P_orth @ Q_new.T
    if transpose:
        B, update = B.T, update.T
    m, n = X.shape
    X = (1 - lr * weight_decay) * X - lr * math.sqrt(m / n) * update
    return X, B, Q_new


def initial_q(b: int, r: int, seed: int) -> torch.Tensor:
    """Q₀ as docs/design.md and shardopt document it: N(0,1) float32 from manual_seed(seed), as float64."""
    return torch.randn(b, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).double()


def optimizer_param_seed(optimizer_seed: int, param_index: int) -> int:
    """The per-parameter seed the optimizer documents: (seed·1_000_003 + index) mod 2⁶³."""
    return (optimizer_seed * 1_000_003 + param_index) % 2**63


def vote_signs(directions: list[torch.Tensor]) -> torch.Tensor:
    """sign(Σ_i sign(U_i)) with sign(0) = +1 inside, 0 on ties; float64."""
    total = sum(torch.where(U >= 0, 1, -1) for U in directions)
    return torch.sign(total).double()


def matrix_seed(param_seed: int, index: int) -> int:
    """The seed of matrix `index` of a param (expert·blocks + block) as shardopt documents it:
    (param_seed + index·0x9E3779B97F4A7C15) mod 2⁶³ (matrix 0 keeps the param's seed)."""
    return (param_seed + index * 0x9E3779B97F4A7C15) % 2**63


def double_averaging_checks(steps: int, every: int = 1000) -> int:
    """How many of the steps 1 … `steps` run the double-averaging check (steps 1, 1+every, …; none
    with every = 0): the schedule docs/design.md §9 and ShardOptimizer document."""
    return -(-steps // every) if every > 0 else 0
