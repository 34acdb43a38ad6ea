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
    """Orthonormal basis of the column space of each P (..., a, r), a ≥ r, with no value read back to the host.

    "qr": Householder QR (the exact path). The Cholesky variants first dither P (`dither`: P + τ·Ω, Ω ~ N(0, 1)
    drawn from `seed` so every rank draws the same, τ = δ·‖P‖_F/√(a·r), δ = `dither_size`, a few units in the
    last place relative to ‖P‖_F): an exactly rank-deficient P (zero or repeated columns, a low-rank product)
    becomes full rank and, as with Householder's rounding, its null directions get orthonormal completions,
    so Dion's Q keeps rank r.
    Then "cholesky" is shifted Cholesky-QR3 (`shifted_cholesky_qr3`), "rcqr" randomized Cholesky-QR
    (`randomized_cholesky_qr`). Neither has a host-side fallback: a matrix whose factorization still fails
    (a Cholesky `info` ≠ 0 or a non-finite entry, e.g. a non-finite P) maps to all zeros, decided on the
    device, and so does an all-zero P (Householder QR would give it an arbitrary basis): its Dion update is
    zero, R = BᵀQ = 0 keeps all of B in the momentum and keeps its Q (`column_normalize`).
    """
    if method not in QR_METHODS:
        raise ValueError(f"qr_method must be one of {QR_METHODS}, got {method!r}")
    if P.device.type == "meta":   # shapes only (traffic.py's counting run): no factorization
        return torch.empty_like(P)
    usable = P.abs().amax(dim=(-2, -1), keepdim=True) > 0
    if method == "qr":
        Q = torch.linalg.qr(P).Q
    else:
        generator = torch.Generator(device=P.device).manual_seed(seed)
        dithered = dither(P, dither_size(method, P), generator)
        if method == "cholesky":
            Q, factored = shifted_cholesky_qr3(dithered)
        else:
            Q, factored = randomized_cholesky_qr(dithered, generator)
        finite = torch.isfinite(Q).all(dim=-1, keepdim=True).all(dim=-2, keepdim=True)
        usable = usable & finite & factored[..., None, None]
    return torch.where(usable, Q, torch.zeros_like(Q))


def unit_roundoff(P: torch.Tensor) -> float:
    """u = ε/2 of P's dtype (2⁻²⁴ in float32, 2⁻⁵³ in float64)."""
    return torch.finfo(P.dtype).eps / 2


def dither_size(method: str, P: torch.Tensor) -> float:
    """The dither δ for P (..., a, r), in units of u: "rcqr" 8·u (the sketch's QR handles any κ(P) up to about
    1/u; the dither only has to lift exact zeros); "cholesky" 4·√(a·r)·u, so that after the shifted pass
    κ(Q₁) ≈ √(s)/σ_min(P + τΩ) ≈ √(a·r·u)/δ = 1/(4·√u) stays within Cholesky-QR2's reach. Both are at least
    twice the smallest sizes that factored every rank-deficient and κ ≤ 1e12 float32 test matrix at
    a ≤ 4096, r ≤ 256 (2·√(a·r)·u and 1e-7 ≈ 1.7·u; 0.75·√(a·r)·u failed at 768×64)."""
    a, r = P.shape[-2:]
    return unit_roundoff(P) * (8 if method == "rcqr" else 4 * math.sqrt(a * r))


def dither(P: torch.Tensor, delta: float, generator: torch.Generator) -> torch.Tensor:
    """P + τ·Ω for P (..., a, r): Ω ~ N(0, 1) of P's shape from `generator`, τ = δ·‖P‖_F/√(a·r) per matrix,
    so that ‖τ·Ω‖_F ≈ δ·‖P‖_F and span(P) turns by about δ·‖P‖_F/σ_i(P) in its directions of singular value σ_i."""
    a, r = P.shape[-2:]
    noise = torch.randn(P.shape, generator=generator, dtype=P.dtype, device=P.device)
    tau = torch.linalg.matrix_norm(P, keepdim=True) * (delta / math.sqrt(a * r))
    return torch.addcmul(P, tau, noise)


def cholesky_qr_pass(X: torch.Tensor, shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One Cholesky-QR pass on X (..., a, r): L·Lᵀ = XᵀX + s·I (s: `shift`, (...,) per matrix, or none),
    returns (X·L⁻ᵀ, whether the factorization succeeded (..., ) bool), read on the device only."""
    gram = X.mT @ X
    if shift is not None:
        gram.diagonal(dim1=-2, dim2=-1).add_(shift[..., None])
    L, info = torch.linalg.cholesky_ex(gram)
    return torch.linalg.solve_triangular(L.mT, X, upper=True, left=False), info == 0


def shifted_cholesky_qr3(P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted Cholesky-QR3 (Fukaya, Kannan, Nakatsukasa, Yamamoto, Yanagisawa, SIAM J. Sci. Comput. 2020) for
    P (..., a, r): Q₁ = P·L₁⁻ᵀ with L₁L₁ᵀ = PᵀP + s·I, s = a·u·‖P‖²_F (above the Gram's rounding error, at most
    about a·u·‖P‖²_F, so the factorization succeeds in floating point), then two unshifted passes (Cholesky-QR2)
    on Q₁, whose condition number the shift has brought within their reach (κ(Q₁) ≲ √s/σ_min(P)). Returns
    (Q, every factorization succeeded (...,))."""
    shift = P.shape[-2] * unit_roundoff(P) * P.square().sum(dim=(-2, -1))
    Q, shifted = cholesky_qr_pass(P, shift)
    Q, factored = cholesky_qr2(Q)
    return Q, shifted & factored


def cholesky_qr2(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two unshifted Cholesky-QR passes on X (..., a, r): Q = X₁·L₂⁻ᵀ, X₁ = X·L₁⁻ᵀ, LₖLₖᵀ = Xₖ₋₁ᵀXₖ₋₁ (the
    second restores the orthogonality the first loses, ~u·κ(X)²). Returns (Q, both succeeded (...,))."""
    X, first = cholesky_qr_pass(X)
    Q, second = cholesky_qr_pass(X)
    return Q, first & second


def randomized_cholesky_qr(P: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Randomized Cholesky-QR (the Dion paper's) for P (..., a, r): a Gaussian sketch S (s×a, N(0, 1/s),
    s = ceil(1.25·r/128)·128 rows, from `generator`) gives R from Householder QR(S·P); P₁ = P·R⁻¹ is well
    conditioned (κ = O(1) for κ(P) up to about 1/u) and `cholesky_qr2` finishes it (one pass is not enough in
    float32: it left ‖QᵀQ − I‖ at 2e-4 on a rank-64 1024×128 P, two reach Householder's ~1e-6). Cost
    O(s·a·r + a·r²) in matmuls instead of Householder's sequential O(a·r²). Returns (Q, both factorizations
    succeeded (...,))."""
    a, r = P.shape[-2:]
    rows = math.ceil(RCQR_OVERSAMPLE * r / 128) * 128
    sketch = torch.randn((*P.shape[:-2], rows, a), generator=generator, dtype=P.dtype, device=P.device)
    R = torch.linalg.qr((sketch / math.sqrt(rows)) @ P, mode="r").R
    return cholesky_qr2(torch.linalg.solve_triangular(R, P, upper=True, left=False))


def column_normalize(R: torch.Tensor, col_sq_norms: torch.Tensor, Q_prev: torch.Tensor,
                     epsilon: float) -> torch.Tensor:
    """Q[:, j] = R[:, j] / (‖R[:, j]‖₂ + ε); a column with ‖R[:, j]‖ = 0 keeps Q_prev[:, j].

    R, Q_prev: (..., b, r). col_sq_norms: (..., r), the squared column norms
    (summed over every row block of R when R is row-sharded).
    """
    norms = col_sq_norms.sqrt().unsqueeze(-2)
    return torch.where(norms > 0, R / (norms + epsilon), Q_prev)
