"""Polar factor by Newton–Schulz iteration: Muon's quintic, or Polar Express's per-step quintics.

For G = U·Σ·Vᵀ the polar factor is U·Vᵀ. Newton–Schulz approximates it with
only matmuls, step k applying the odd quintic pₖ(σ) = aₖ·σ + bₖ·σ³ + cₖ·σ⁵ to every singular value:

    X₀ = G / (s·‖G‖_F + 1e-7)
    Xₖ₊₁ = aₖ·Xₖ + (bₖ·Aₖ + cₖ·Aₖ²)·Xₖ,   Aₖ = Xₖ·Xₖᵀ

iterated on the wide orientation (rows ≤ columns) so Aₖ is the small Gram
matrix. The coefficient schedules (`SCHEDULES`, the `ns_coefficients` option):

- "quintic" (Muon's, K. Jordan): (aₖ, bₖ, cₖ) = (3.4445, −4.7750, 2.0315) at every step, s = 1. It does
  not converge to exactly 1: after 5 steps the singular values of a well-conditioned input lie in
  about [0.68, 1.2024] (1.2024 is the quintic's own peak); directions with σ far below ‖G‖_F/√rank
  (e.g. the smallest of a square Gaussian matrix) stay small.
- "polar_express" (Amsel, Persson, Musco, Gower, "The Polar Express: Optimal Matrix Sign Methods and
  Their Application to the Muon Algorithm", arXiv 2505.16932, Algorithm 1 and Appendix G): pₖ is the
  minimax (equioscillating) odd quintic approximation of 1 on the interval [ℓₖ, uₖ] that the earlier
  steps leave, from [ℓ₁, u₁] = [1e-3, 1], with the lower end cushioned to ≥ 0.02407·uₖ and the result
  recentred so that 1 − pₖ(ℓₖ) = pₖ(uₖ) − 1; then ℓₖ₊₁ = pₖ(ℓₖ), uₖ₊₁ = 2 − ℓₖ₊₁. Seven such steps, then
  the limit (15/8, −10/8, 3/8) (degree-5 Newton–Schulz) repeated. The paper's safety factor for bf16:
  every step but the repeated one is pₖ(x/1.01), and s = 1.01. tests/test_polar.py derives the seven
  steps again (Remez exchange in float64) and checks the composition maps [1e-3, 1] into [1 − εₖ, 1 + εₖ].
"""

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("shardopt")


@dataclass(frozen=True)
class Schedule:
    """A Newton–Schulz coefficient schedule: `per_step` (a, b, c) of the first steps, then `repeat` at every
    later step; the input is divided by `norm_scale`·‖G‖_F + 1e-7."""

    per_step: tuple[tuple[float, float, float], ...]
    repeat: tuple[float, float, float]
    norm_scale: float = 1.0

    def coefficients(self, steps: int) -> tuple[tuple[float, float, float], ...]:
        """(a, b, c) of each of `steps` steps."""
        return self.per_step[:steps] + (self.repeat,) * max(0, steps - len(self.per_step))


# arXiv 2505.16932, Algorithm 1 (ℓ₁ = 1e-3, u₁ = 1): the optimal quintics before the safety factor
POLAR_EXPRESS_OPTIMAL = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
)
POLAR_EXPRESS_SAFETY = 1.01
QUINTIC = (3.4445, -4.7750, 2.0315)
SCHEDULES = {
    "quintic": Schedule(per_step=(), repeat=QUINTIC),
    "polar_express": Schedule(
        per_step=tuple((a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY ** 3, c / POLAR_EXPRESS_SAFETY ** 5)
                       for a, b, c in POLAR_EXPRESS_OPTIMAL),
        repeat=(15 / 8, -10 / 8, 3 / 8), norm_scale=POLAR_EXPRESS_SAFETY),
}


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (tensor cores), fp32 elsewhere (bf16 CPU matmul is ~30× slower)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(X: torch.Tensor, coefficients: tuple[tuple[float, float, float], ...]) -> torch.Tensor:
    """One quintic iteration per (a, b, c) of `coefficients` on a normalized stack X (k, rows, cols),
    rows ≤ cols. Working set: X, A, b·A + c·A², the new X."""
    for a, b, c in coefficients:
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

    def compiled_or_eager(X, coefficients):
        try:
            return _compiled["fn"](X, coefficients)
        except Exception as error:   # noqa: BLE001 - no compiler / unsupported backend: stay correct, warn once
            _compiled["failed"] = error
            logger.warning("shardopt: torch.compile of Newton–Schulz failed (%s); using eager", error)
            return newton_schulz(X, coefficients)
    return compiled_or_eager


def polar(G: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None, compile: bool = False,
          coefficients: str = "quintic") -> torch.Tensor:
    """Approximate polar factor U·Vᵀ of each matrix in G: `steps` Newton–Schulz steps of the schedule
    named `coefficients` (a key of SCHEDULES: "quintic" or "polar_express", module docstring).

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
    if coefficients not in SCHEDULES:
        raise ValueError(f"Invalid coefficients: {coefficients!r}; allowed: {', '.join(map(repr, SCHEDULES))}")
    schedule = SCHEDULES[coefficients]
    dtype = dtype or default_ns_dtype(G.device)
    X = G.to(dtype)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) * schedule.norm_scale + 1e-7)
    batch = X.shape[:-2]
    X = _iterations(compile and X.device.type != "meta")(X.reshape(batch.numel(), *X.shape[-2:]),
                                                         schedule.coefficients(steps))
    X = X.reshape(*batch, *X.shape[-2:])
    return X.mT if tall else X
