"""Newton–Schulz coefficient schedules (shardopt/algorithms/polar.py, the `ns_coefficients` option): the published
Polar Express coefficients re-derived, each schedule's effect on singular values, sign agreement with
the exact polar factor on a real gradient, the option's validation, and the default path unchanged."""

import math
import sys
from pathlib import Path

import pytest
import torch

import shardopt
from shardopt.algorithms.polar import POLAR_EXPRESS_OPTIMAL, QUINTIC, SCHEDULES, polar
from shardopt.wire.signs import positive_signs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "integrations"))
from model import GPT, GPTConfig  # noqa: E402

CUSHION = 0.02407327424182761   # arXiv 2505.16932 Appendix G: the lower end is at least this × the upper
LOWER = 1e-3                    # ℓ₁ of the published coefficients (u₁ = 1)


def gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def compose(coefficients, x: torch.Tensor) -> torch.Tensor:
    """pₖ ∘ … ∘ p₁ applied to the scalars x, pᵢ(x) = a·x + b·x³ + c·x⁵."""
    for a, b, c in coefficients:
        x = a * x + b * x ** 3 + c * x ** 5
    return x


def minimax_quintic(low: float, high: float) -> tuple[float, float, float]:
    """The odd quintic p closest to 1 in max norm on [low, high], by Remez exchange: 1 − p alternates in
    sign with equal size E at low, the two interior extrema of p, and high."""
    points = torch.tensor([low, low + (high - low) / 3, low + 2 * (high - low) / 3, high], dtype=torch.float64)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    for _ in range(100):
        system = torch.stack([points, points ** 3, points ** 5, signs], dim=1)   # p(xᵢ) + sᵢ·E = 1
        a, b, c, error = torch.linalg.solve(system, torch.ones(4, dtype=torch.float64)).tolist()
        discriminant = math.sqrt(9 * b * b - 20 * a * c)                       # p'(x) = a + 3b·x² + 5c·x⁴ = 0
        extrema = sorted(math.sqrt((-3 * b + sign * discriminant) / (10 * c)) for sign in (-1, 1))
        moved = max(abs(extrema[0] - points[1].item()), abs(extrema[1] - points[2].item()))
        points[1], points[2] = extrema[0], extrema[1]
        if moved < 1e-15:
            break
    return a, b, c


def polar_express_derived(steps: int) -> list[tuple[float, float, float]]:
    """Polar Express's offline stage (arXiv 2505.16932 §4.2–4.4, Appendix G), re-derived: on the interval
    [ℓ, u] the earlier steps leave, the minimax quintic on [max(ℓ, CUSHION·u), u], rescaled so that
    1 − p(ℓ) = p(u) − 1; then ℓ ← p(ℓ), u ← 2 − ℓ."""
    low, high, schedule = LOWER, 1.0, []
    for _ in range(steps):
        a, b, c = minimax_quintic(max(low, CUSHION * high), high)
        ends = compose([(a, b, c)], torch.tensor([low, high], dtype=torch.float64))
        recentre = 2 / ends.sum().item()
        a, b, c = a * recentre, b * recentre, c * recentre
        schedule.append((a, b, c))
        low = ends[0].item() * recentre
        high = 2 - low
    return schedule


# ---- the published coefficients --------------------------------------------------------------

def test_polar_express_coefficients_match_a_remez_rederivation():
    for published, derived in zip(POLAR_EXPRESS_OPTIMAL, polar_express_derived(len(POLAR_EXPRESS_OPTIMAL)), strict=True):
        assert torch.allclose(torch.tensor(published, dtype=torch.float64), torch.tensor(derived, dtype=torch.float64), rtol=1e-9, atol=0), \
            (published, derived)


def test_polar_express_maps_the_interval_towards_one_with_shrinking_error():
    """The paper's guarantee: after k optimal steps every σ ∈ [ℓ, 1] lies in [1 − εₖ, 1 + εₖ], εₖ
    decreasing to 0 (measured εₖ: 0.992, 0.966, 0.866, 0.560, 0.124, 0.0012, 1e-9)."""
    x = torch.logspace(math.log10(LOWER), 0, 20001, dtype=torch.float64)
    errors = [(compose(POLAR_EXPRESS_OPTIMAL[:k], x) - 1).abs().max().item() for k in range(1, 8)]
    assert all(later < earlier for earlier, later in zip(errors, errors[1:])), errors
    assert errors[4] < 0.13 and errors[5] < 2e-3 and errors[6] < 1e-8, errors


@pytest.mark.parametrize("schedule, steps, low, high", [
    # the image of σ ∈ [1e-3, 1] (after the schedule's normalization) under `steps` steps, as computed
    # on a dense grid: the quintic never converges (peak 1.2024); Polar Express does
    ("quintic", 1, 0.0034, 1.2025), ("quintic", 5, 0.47, 1.2025),
    ("polar_express", 1, 0.0080, 1.992), ("polar_express", 5, 0.84, 1.124), ("polar_express", 8, 0.99, 1.01)])
def test_schedule_maps_normalized_singular_values_into_stated_interval(schedule, steps, low, high):
    x = torch.logspace(math.log10(LOWER), 0, 20001, dtype=torch.float64) / SCHEDULES[schedule].norm_scale
    y = compose(SCHEDULES[schedule].coefficients(steps), x)
    assert low <= y.min().item() and y.max().item() <= high, (y.min().item(), y.max().item())


def test_schedule_coefficients_per_step_then_repeat():
    assert SCHEDULES["quintic"].coefficients(3) == (QUINTIC,) * 3
    express = SCHEDULES["polar_express"].coefficients(9)
    assert len(express) == 9 and express[7] == express[8] == (15 / 8, -10 / 8, 3 / 8)
    a, b, c = POLAR_EXPRESS_OPTIMAL[0]
    assert express[0] == (a / 1.01, b / 1.01 ** 3, c / 1.01 ** 5)   # the safety factor: p(x / 1.01)


# ---- singular values of the matrix iteration -------------------------------------------------

def conditioned(m: int, n: int, condition: float, seed: int = 1) -> torch.Tensor:
    """An m×n float64 matrix with singular values evenly spaced in [1, condition]."""
    U = torch.linalg.qr(gaussian(m, min(m, n), seed=seed)).Q
    V = torch.linalg.qr(gaussian(n, min(m, n), seed=seed + 1)).Q
    return U @ torch.diag(torch.linspace(1.0, condition, min(m, n), dtype=torch.float64)) @ V.T


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("steps", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("shape", [(96, 64), (64, 96)], ids=lambda shape: "x".join(map(str, shape)))
def test_singular_values_are_the_scalar_composition_of_the_inputs(schedule, steps, shape):
    """Well-conditioned input (condition 10): polar's singular values are pₖ ∘ … ∘ p₁ of the input's
    normalized ones, to 1e-10 in float64 and 1e-4 in float32; with 5+ steps they are within the stated
    distance of 1 (quintic: [0.68, 1.2025]; Polar Express: 5 steps [0.87, 1.124], 8 steps 1 ± 1e-3)."""
    G = conditioned(*shape, condition=10.0)
    sigma = torch.linalg.svdvals(G)
    expected = compose(SCHEDULES[schedule].coefficients(steps),
                       sigma / (sigma.norm() * SCHEDULES[schedule].norm_scale + 1e-7)).sort().values
    for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        got = torch.linalg.svdvals(polar(G, steps, dtype, coefficients=schedule).double()).sort().values
        assert torch.allclose(got, expected, rtol=0, atol=tolerance), (dtype, (got - expected).abs().max().item())
    bounds = {("quintic", 5): (0.68, 1.2025), ("quintic", 8): (0.68, 1.2025),
              ("polar_express", 5): (0.87, 1.124), ("polar_express", 8): (0.999, 1.001)}
    if (schedule, steps) in bounds:
        low, high = bounds[schedule, steps]
        assert low <= expected.min().item() and expected.max().item() <= high, (expected.min(), expected.max())


# ---- sign agreement on a real gradient -------------------------------------------------------

@pytest.fixture(scope="module")
def real_gradient() -> torch.Tensor:
    return gradient_of_repository_text()


def gradient_of_repository_text() -> torch.Tensor:
    """The gradient of mlp.c_fc (512×128) of the GPT of integrations/model.py on batches of text that ships
    in the repository (README.md and docs/*.md as bytes), float64."""
    text = b"".join(path.read_bytes() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128))
    starts = torch.randint(len(tokens) - 65, (16,), generator=torch.Generator().manual_seed(0))
    windows = tokens[starts[:, None] + torch.arange(65)]
    _, loss = model(windows[:, :-1], windows[:, 1:])
    loss.backward()
    return model.transformer.h[1].mlp.c_fc.weight.grad.double()


def sign_agreement(U: torch.Tensor, P: torch.Tensor) -> float:
    return (positive_signs(U) == positive_signs(P)).double().mean().item()


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_sign_agreement_with_exact_polar_on_a_real_gradient_grows_with_steps(real_gradient, schedule):
    """Against U·Vᵀ of the float64 SVD, 1, 2, 3, 5 steps in float32 (measured: quintic 0.674, 0.723, 0.792,
    0.932; Polar Express 0.689, 0.749, 0.819, 0.960). The gradient has one singular value 1e-8·‖G‖_F, whose
    direction no schedule recovers in a few steps, so neither reaches 1."""
    U, _, Vh = torch.linalg.svd(real_gradient, full_matrices=False)
    exact = U @ Vh
    agreement = [sign_agreement(polar(real_gradient, steps, torch.float32, coefficients=schedule), exact)
                 for steps in (1, 2, 3, 5)]
    assert agreement[0] > 0.65 and agreement[-1] > 0.92, agreement
    assert agreement == sorted(agreement), agreement


def test_polar_express_keeps_converging_where_the_quintic_plateaus(real_gradient):
    """At 8 steps the quintic's signs agree no better than at 5 (0.930 vs 0.932; it oscillates in
    [0.68, 1.2]); Polar Express's reach 0.971."""
    U, _, Vh = torch.linalg.svd(real_gradient, full_matrices=False)
    exact = U @ Vh
    quintic, express = (sign_agreement(polar(real_gradient, 8, torch.float32, coefficients=name), exact)
                        for name in ("quintic", "polar_express"))
    assert express > quintic + 0.02 and express > 0.96, (quintic, express)


# ---- the option: validation, and where it reaches ----------------------------------------------

def test_polar_rejects_an_unknown_schedule_naming_the_parameter():
    with pytest.raises(ValueError, match=r"Invalid coefficients: 'cubic'; allowed: 'quintic', 'polar_express'"):
        polar(gaussian(6, 4), 2, coefficients="cubic")


@pytest.mark.parametrize("algorithm", ["signmuon", "muon"])
@pytest.mark.parametrize("value", ["cubic", None, 5])
def test_group_rejects_an_unknown_ns_coefficients(algorithm, value):
    param = torch.nn.Parameter(torch.ones(4, 3))
    with pytest.raises(ValueError, match=rf"Invalid ns_coefficients: {value!r} \(param group 0\); allowed: "
                                         r"'quintic', 'polar_express'"):
        shardopt.ShardOptimizer([{"params": [param], "algorithm": algorithm, "ns_coefficients": value}], dict(lr=0.01))


def test_ns_coefficients_in_an_adamw_group_is_refused():
    param = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match=r"Invalid ns_coefficients in param group 0 \(algorithm 'adamw'\)"):
        shardopt.ShardOptimizer([{"params": [param], "algorithm": "adamw", "ns_coefficients": "quintic"}],
                                dict(lr=0.01))


def one_step(algorithm: str, **group) -> torch.Tensor:
    """The weight after one step of `algorithm` on a fixed 12×8 matrix and gradient (float64 polar)."""
    param = torch.nn.Parameter(gaussian(12, 8, seed=3))
    param.grad = gaussian(12, 8, seed=4)
    optimizer = shardopt.ShardOptimizer([{"params": [param], "algorithm": algorithm, "ns_dtype": "float64",
                                          "ns_steps": 2, **group}], dict(lr=0.01))
    optimizer.step()
    return param.detach().clone()


@pytest.mark.parametrize("algorithm", ["signmuon", "muon"])
def test_ns_coefficients_reaches_the_step_and_quintic_is_the_default(algorithm):
    default = one_step(algorithm)
    assert torch.equal(default, one_step(algorithm, ns_coefficients="quintic"))
    assert not torch.equal(default, one_step(algorithm, ns_coefficients="polar_express"))
    assert shardopt.ShardOptimizer([torch.nn.Parameter(torch.ones(3, 3))],
                                   dict(lr=0.01)).param_groups[0]["ns_coefficients"] == "quintic"


def quintic_as_before(G: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """shardopt.algorithms.polar's quintic before the schedules existed (commit 9019c18), operation for operation."""
    X = G.to(dtype)
    tall = X.size(-2) > X.size(-1)
    X = X.mT if tall else X
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + 1e-7)
    batch = X.shape[:-2]
    X = X.reshape(batch.numel(), *X.shape[-2:])
    a, b, c = 3.4445, -4.7750, 2.0315
    for _ in range(steps):
        A = X @ X.mT
        X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)
    X = X.reshape(*batch, *X.shape[-2:])
    return X.mT if tall else X


@pytest.mark.parametrize("shape", [(24, 10), (10, 24), (3, 16, 16), (2, 2, 40, 12)], ids=str)
@pytest.mark.parametrize("steps", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_default_polar_is_bitwise_the_quintic_as_before(shape, steps, dtype):
    G = gaussian(*shape, seed=5).float()
    assert torch.equal(polar(G, steps, dtype), quintic_as_before(G, steps, dtype))
