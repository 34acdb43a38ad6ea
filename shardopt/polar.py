"""Polar factor by Newton–Schulz iteration (Muon's quintic).

For G = U·Σ·Vᵀ the polar factor is U·Vᵀ. Newton–Schulz approximates it with
only matmuls:

    X₀ = G / (‖G‖_F + 1e-7)
    Xₖ₊₁ = a·Xₖ + (b·Aₖ + c·Aₖ²)·Xₖ,   Aₖ = Xₖ·Xₖᵀ,   (a, b, c) = (3.4445, −4.7750, 2.0315)

iterated on the wide orientation (rows ≤ columns) so Aₖ is the small Gram
matrix. The quintic does not converge to exactly 1: after 5 steps the
singular values of a well-conditioned input lie in about [0.68, 1.2024]
(1.2024 is the quintic's own peak); directions with σ far below ‖G‖_F/√rank
(e.g. the smallest of a square Gaussian matrix) stay small.
"""

import logging

import torch

logger = logging.getLogger("shardopt")
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (tensor cores), fp32 elsewhere (bf16 CPU matmul is ~30× slower)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(X: torch.Tensor, steps: int) -> torch.Tensor:
    """`steps` quintic iterations on a normalized stack X (k, rows, cols), rows ≤ cols.
    Working set: X, A, b·A + c·A², the new X."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        A = X @ X.mT
        X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)
        del A
    return X


_compiled = {}   # "fn": torch.compile(newton_schulz), made on first use; "failed": the error, if it failed


def _iterations(compile: bool):
    """newton_schulz, or its torch.compile'd version when `compile` (eager if compiling failed once)."""
    if not compile or "failed" in _compiled:
        return newton_schulz
    if "fn" not in _compiled:
        _compiled["fn"] = torch.compile(newton_schulz, dynamic=False)

    def compiled_or_eager(X, steps):
        try:
            return _compiled["fn"](X, steps)
        except Exception as error:   # noqa: BLE001 - no compiler / unsupported backend: stay correct, warn once
            _compiled["failed"] = error
            logger.warning("shardopt: torch.compile of Newton–Schulz failed (%s); using eager", error)
            return newton_schulz(X, steps)
    return compiled_or_eager


def polar(G: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None, compile: bool = False) -> torch.Tensor:
    """Approximate polar factor U·Vᵀ of each matrix in G.

    G: (..., m, n), any float dtype. Returns (..., m, n) in `dtype`
    (default: `default_ns_dtype(G.device)`). Works on each trailing matrix
    independently, so a stack of same-shape matrices is one batched call.
    An all-zero matrix stays zero. compile=True runs the iterations through
    torch.compile (falling back to eager if compiling fails). Off by default: on
    the CPU it helped only small stacks (8×256×256: 1.4×) and slowed larger ones
    (4×768×3072: 0.37×; results/compile.csv), and compiling takes seconds per shape.
    """
    if G.ndim < 2:
        raise ValueError(f"polar needs a matrix (..., m, n), got shape {tuple(G.shape)}")
    dtype = dtype or default_ns_dtype(G.device)
    X = G.to(dtype)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + 1e-7)
    batch = X.shape[:-2]
    X = _iterations(compile and X.device.type != "meta")(X.reshape(batch.numel(), *X.shape[-2:]), steps)
    X = X.reshape(*batch, *X.shape[-2:])
    return X.mT if tall else X
