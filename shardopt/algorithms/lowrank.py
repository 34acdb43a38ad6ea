"""Low-rank power-iteration pieces used by Dion (pure functions on local tensors).

All functions take stacks of matrices (..., rows, cols) so that a batch of
same-shape parameters is one call.
"""

import math

import torch

QR_METHODS = ("qr", "cholesky", "rcqr")
RCQR_OVERSAMPLE = 1.25   # sketch rows = ceil(1.25·r / 128)·128, as in the Dion paper's code


def dion_rank(m: int, n: int, rank_fraction: float, rank_multiple_of: int) -> int:
    """r = min(m, n, ceil(rank_fraction·min(m, n) / rank_multiple_of)·rank_multiple_of)."""
    k = min(m, n)
    return min(k, math.ceil(rank_fraction * k / rank_multiple_of) * rank_multiple_of)


def dion_matmul_dtype(name: str | None, compute: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype Dion's large matmuls (B·Q, Bᵀ·P, P·Rᵀ, P·Qᵀ) round their inputs to: the group's `matmul_dtype`
    name, or for None bf16 on CUDA when the step computes in fp32 (tensor cores, fp32 accumulation), else the
    compute dtype itself (fp32 on a CPU, where bf16 matmuls are ~30× slower; fp64 for fp64 params)."""
    if name is not None:
        return getattr(torch, name)
    return torch.bfloat16 if device.type == "cuda" and compute == torch.float32 else compute


def subtract_product_(M: torch.Tensor, A: torch.Tensor, B: torch.Tensor, alpha: float, dtype: torch.dtype):
    """M ← M − alpha·A·B in place for stacks M (k, a, b), A (k, a, r), B (k, r, b); A·B from A and B rounded
    to `dtype` (one fused baddbmm when `dtype` is M's, else a (k, a, b) product in `dtype`)."""
    if dtype == M.dtype:
        return M.baddbmm_(A, B, alpha=-alpha)
    return M.sub_(torch.bmm(A.to(dtype), B.to(dtype)), alpha=alpha)


def orthonormalize(P: torch.Tensor, method: str = "qr", seed: int = 0) -> torch.Tensor:
    """Orthonormal basis of the column space of each P (..., a, r), a ≥ r.

    "qr": Householder QR (the exact path). "cholesky": Cholesky-QR, P·R⁻¹ with
    RᵀR = PᵀP, twice for accuracy. "rcqr": randomized Cholesky-QR (Dion paper):
    a Gaussian sketch S (s×a, N(0, 1/s), s = ceil(1.25·r/128)·128 rows, drawn
    from `seed` so every rank draws the same S) gives R from QR(S·P), then
    P₁ = P·R⁻¹ is well conditioned and one Cholesky-QR step finishes it:
    Q = P₁·L⁻ᵀ with L·Lᵀ = P₁ᵀP₁. Cost O(s·a·r + a·r²) instead of Householder's
    sequential O(a·r²). Both Cholesky variants fall back to Householder QR when
    a factorization fails (rank-deficient P). Whether to run Householder is a host
    decision, so every call of a Cholesky variant reads its `info` back: one device
    sync per bucket and call, whether or not it falls back ("qr" reads nothing).
    A matrix that is all zeros maps to all zeros (Householder QR would give an
    arbitrary basis), so a zero update stays zero.
    """
    if method not in QR_METHODS:
        raise ValueError(f"qr_method must be one of {QR_METHODS}, got {method!r}")
    if P.device.type == "meta":   # shapes only (traffic.py's counting run): no factorization, no sync
        return torch.empty_like(P)
    Q = None
    if method == "cholesky":
        Q = _cholesky_qr(P)
    elif method == "rcqr":
        Q = _randomized_cholesky_qr(P, seed)
    if Q is None:
        Q = torch.linalg.qr(P).Q
    nonzero = P.abs().amax(dim=(-2, -1), keepdim=True) > 0
    return torch.where(nonzero, Q, torch.zeros_like(Q))


def _cholesky_qr(P: torch.Tensor) -> torch.Tensor | None:
    """Two Cholesky-QR passes queued back to back; both factorizations' `info` are read in one device sync at
    the end (a failed first pass gives a second on garbage, which is then dropped with it: None)."""
    Q, failed = P, torch.zeros((), dtype=torch.bool, device=P.device)
    for _ in range(2):
        L, info = torch.linalg.cholesky_ex(Q.mT @ Q)
        failed = failed | (info != 0).any()
        Q = torch.linalg.solve_triangular(L, Q.mT, upper=False).mT
    return None if bool(failed) else Q


def _randomized_cholesky_qr(P: torch.Tensor, seed: int) -> torch.Tensor | None:
    a, r = P.shape[-2:]
    zero = P.abs().amax(dim=(-2, -1), keepdim=True) == 0     # zero matrices give NaN here; the caller zeroes them
    rows = math.ceil(RCQR_OVERSAMPLE * r / 128) * 128
    generator = torch.Generator(device=P.device).manual_seed(seed)
    sketch = torch.randn((*P.shape[:-2], rows, a), generator=generator, dtype=P.dtype, device=P.device)
    sketch /= math.sqrt(rows)
    R = torch.linalg.qr(sketch @ P, mode="r").R
    P = torch.linalg.solve_triangular(R, P, upper=True, left=False)
    L, info = torch.linalg.cholesky_ex(P.mT @ P)
    Q = torch.linalg.solve_triangular(L.mT, P, upper=True, left=False)
    if bool(((info != 0) & ~zero[..., 0, 0]).any() | ~(torch.isfinite(Q) | zero).all()):
        return None
    return Q


def column_normalize(R: torch.Tensor, col_sq_norms: torch.Tensor, Q_prev: torch.Tensor,
                     epsilon: float) -> torch.Tensor:
    """Q[:, j] = R[:, j] / (‖R[:, j]‖₂ + ε); a column with ‖R[:, j]‖ = 0 keeps Q_prev[:, j].

    R, Q_prev: (..., b, r). col_sq_norms: (..., r), the squared column norms
    (summed over every row block of R when R is row-sharded).
    """
    norms = col_sq_norms.sqrt().unsqueeze(-2)
    return torch.where(norms > 0, R / (norms + epsilon), Q_prev)
