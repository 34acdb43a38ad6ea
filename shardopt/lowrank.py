"""Low-rank power-iteration pieces used by Dion (pure functions on local tensors).

All functions take stacks of matrices (..., rows, cols) so that a batch of
same-shape parameters is one call.
"""

import math

import torch

QR_METHODS = ("qr", "cholesky")


def dion_rank(m: int, n: int, rank_fraction: float, rank_multiple_of: int) -> int:
    """r = min(m, n, ceil(rank_fraction·min(m, n) / rank_multiple_of)·rank_multiple_of)."""
    k = min(m, n)
    return min(k, math.ceil(rank_fraction * k / rank_multiple_of) * rank_multiple_of)


def orthonormalize(P: torch.Tensor, method: str = "qr") -> torch.Tensor:
    """Orthonormal basis of the column space of each P (..., a, r), a ≥ r.

    "qr": Householder QR. "cholesky": Cholesky-QR, P·R⁻¹ with RᵀR = PᵀP, twice
    for accuracy; it falls back to Householder QR when PᵀP is not positive
    definite (that check reads `info` back from the device: one sync).
    A matrix that is all zeros maps to all zeros (Householder QR would give an
    arbitrary basis), so a zero update stays zero.
    """
    if method not in QR_METHODS:
        raise ValueError(f"qr_method must be one of {QR_METHODS}, got {method!r}")
    if method == "cholesky":
        Q = _cholesky_qr(P)
        if Q is None:
            Q = torch.linalg.qr(P).Q
    else:
        Q = torch.linalg.qr(P).Q
    nonzero = P.abs().amax(dim=(-2, -1), keepdim=True) > 0
    return torch.where(nonzero, Q, torch.zeros_like(Q))


def _cholesky_qr(P: torch.Tensor) -> torch.Tensor | None:
    Q = P
    for _ in range(2):
        L, info = torch.linalg.cholesky_ex(Q.mT @ Q)
        if bool((info != 0).any()):
            return None
        Q = torch.linalg.solve_triangular(L, Q.mT, upper=False).mT
    return Q


def column_normalize(R: torch.Tensor, col_sq_norms: torch.Tensor, Q_prev: torch.Tensor,
                     epsilon: float) -> torch.Tensor:
    """Q[:, j] = R[:, j] / (‖R[:, j]‖₂ + ε); a column with ‖R[:, j]‖ = 0 keeps Q_prev[:, j].

    R, Q_prev: (..., b, r). col_sq_norms: (..., r), the squared column norms
    (summed over every row block of R when R is row-sharded).
    """
    norms = col_sq_norms.sqrt().unsqueeze(-2)
    return torch.where(norms > 0, R / (norms + epsilon), Q_prev)
