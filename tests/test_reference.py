"""Dion and Sign-Muon on one process against float64 references written from docs/design.md §1 and §2.

The references below are plain loops over single matrices, independent of shardopt's math
(their own Gram–Schmidt and Newton–Schulz). Only the documented Q₀ rule is shared:
Q₀ ~ N(0, 1), b×r, float32, from torch.Generator().manual_seed(seed) on the CPU, where the
per-parameter seed is (optimizer seed · 1_000_003 + parameter index) mod 2⁶³.
"""

import math

import pytest
import torch

import shardopt
from reference import newton_schulz



def gaussian(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def relative_error(mine, reference):
    return ((mine - reference).norm() / reference.norm()).item()


# ---- Dion reference (docs/design.md §1) -----------------------------------------------------------------

def reference_rank(m, n, rank_fraction, rank_multiple_of):
    k = min(m, n)
    return min(k, math.ceil(rank_fraction * k / rank_multiple_of) * rank_multiple_of)


def reference_q0(m, n, r, seed):
    b = min(m, n)          # unsharded: B is oriented a×b with a ≥ b
    return torch.randn(b, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).double()


def gram_schmidt(P):
    """Orthonormal columns spanning P (a×r), classical Gram–Schmidt applied twice; P = 0 ↦ 0."""
    if not P.abs().max() > 0:
        return torch.zeros_like(P)
    columns = []
    for j in range(P.shape[1]):
        v = P[:, j].clone()
        for _ in range(2):
            for q in columns:
                v = v - (q @ v) * q
        columns.append(v / v.norm())
    return torch.stack(columns, dim=1)


class DionReference:
    """One matrix X (m×n) with its Dion state; `step(G)` applies docs/design.md §1 steps 1–7."""

    def __init__(self, X, Q0, *, lr, mu, weight_decay, epsilon):
        self.X, self.Q = X.clone(), Q0.clone()
        self.M = torch.zeros_like(X)
        self.lr, self.mu, self.weight_decay, self.epsilon = lr, mu, weight_decay, epsilon
        self.transpose = X.shape[0] < X.shape[1]

    def step(self, G):
        m, n = self.X.shape
        B = (self.M + G).T if self.transpose else self.M + G          # 1. B ← M + G (a×b)
        P = gram_schmidt(B @ self.Q)                                  # 2.–3.
        R = B.T @ P                                                   # 4.
        B = B - (1 - self.mu) * P @ R.T                               # 5. error feedback
        Q = self.Q.clone()
        for j in range(R.shape[1]):                                   # 6. column normalization
            norm = R[:, j].norm()
            if norm > 0:
                Q[:, j] = R[:, j] / (norm + self.epsilon)
        self.Q = Q
        update = P @ Q.T
        if self.transpose:
            B, update = B.T, update.T
        self.M = B
        self.X = (1 - self.lr * self.weight_decay) * self.X - self.lr * math.sqrt(m / n) * update   # 7.
        return self.X


def step_alongside(optimizer, params, references, steps, *, momentum_tolerance):
    """Feed the optimizer and the references the same gradients; every update must agree to 1e-6
    relative and every momentum to `momentum_tolerance`. Returns the worst update error."""
    worst = 0.0
    for step in range(steps):
        before = [p.detach().clone() for p in params]
        for i, p in enumerate(params):
            p.grad = gaussian(*p.shape, seed=1000 * step + i)
        optimizer.step()
        for i, (p, reference) in enumerate(zip(params, references)):
            ref_before = reference.X
            ref_after = reference.step(p.grad.detach())
            error = relative_error(p.detach() - before[i], ref_after - ref_before)
            worst = max(worst, error)
            assert error <= 1e-6, f"step {step}, param {i} {tuple(p.shape)}: relative error {error:.2e}"
            assert relative_error(optimizer.state[p]["momentum"], reference.M) <= momentum_tolerance
    return worst


def per_param_seed(optimizer_seed, index):
    return (optimizer_seed * 1_000_003 + index) % 2**63


DION_SHAPES = [(40, 24), (24, 40), (32, 32), (40, 24)]    # tall, wide, square, and a second tall (same bucket)


def run_dion_against_reference(shapes, steps, *, rank_fraction, rank_multiple_of=1, qr_method="qr", lr=0.02,
                               mu=0.95, weight_decay=0.1, epsilon=1e-8, seed=3):
    params = [gaussian(*shape, seed=100 + i).requires_grad_() for i, shape in enumerate(shapes)]
    optimizer = shardopt.Dion(params, lr=lr, mu=mu, rank_fraction=rank_fraction, rank_multiple_of=rank_multiple_of,
                              weight_decay=weight_decay, epsilon=epsilon, qr_method=qr_method, seed=seed)
    references = []
    for i, (p, (m, n)) in enumerate(zip(params, shapes)):
        r = reference_rank(m, n, rank_fraction, rank_multiple_of)
        references.append(DionReference(p.detach(), reference_q0(m, n, r, per_param_seed(seed, i)), lr=lr, mu=mu,
                                         weight_decay=weight_decay, epsilon=epsilon))
    worst = step_alongside(optimizer, params, references, steps, momentum_tolerance=1e-6)
    for p, reference in zip(params, references):
        assert relative_error(p.detach(), reference.X) <= 1e-6
    return optimizer, params, worst


@pytest.mark.parametrize("rank_fraction", [1.0, 0.5, 0.125])
def test_dion_matches_float64_reference_tall_wide_square_with_weight_decay(rank_fraction):
    optimizer, params, worst = run_dion_against_reference(DION_SHAPES, steps=6, rank_fraction=rank_fraction)
    for p, (m, n) in zip(params, DION_SHAPES):
        r = reference_rank(m, n, rank_fraction, 1)
        assert optimizer.state[p]["Q"].shape == (min(m, n), r)
    assert worst < 1e-9


@pytest.mark.parametrize("shape, rank_fraction, multiple, expected_r", [
    ((64, 40), 0.1, 8, 8),
    ((40, 64), 0.3, 8, 16),
    ((48, 48), 0.2, 16, 16),
])
def test_dion_rank_multiple_of_rounds_rank_up_and_matches_reference(shape, rank_fraction, multiple, expected_r):
    optimizer, params, _ = run_dion_against_reference([shape], steps=5, rank_fraction=rank_fraction,
                                                      rank_multiple_of=multiple)
    assert optimizer.state[params[0]]["Q"].shape == (min(shape), expected_r)


@pytest.mark.parametrize("rank_fraction", [1.0, 0.25])
def test_dion_cholesky_qr_matches_reference_and_householder(rank_fraction):
    run_dion_against_reference(DION_SHAPES, steps=5, rank_fraction=rank_fraction, qr_method="cholesky")
    results = {}
    for method in ("qr", "cholesky"):
        params = [gaussian(*shape, seed=7 + i).requires_grad_() for i, shape in enumerate(DION_SHAPES)]
        optimizer = shardopt.Dion(params, lr=0.05, rank_fraction=rank_fraction, qr_method=method, seed=11)
        for step in range(5):
            for i, p in enumerate(params):
                p.grad = gaussian(*p.shape, seed=31 * step + i)
            optimizer.step()
        results[method] = [p.detach().clone() for p in params]
    for householder, cholesky in zip(results["qr"], results["cholesky"]):
        assert relative_error(cholesky, householder) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(12, 8), (8, 12)])
def test_dion_zero_gradient_from_zero_state_keeps_q_and_only_decays(shape, dtype):
    lr, wd = 0.1, 0.2
    param = gaussian(*shape, seed=1).to(dtype).requires_grad_()
    start = param.detach().clone()
    optimizer = shardopt.Dion([param], lr=lr, weight_decay=wd, rank_fraction=0.5, seed=5)
    param.grad = torch.zeros_like(param)
    optimizer.step()
    m, n = shape
    r = reference_rank(m, n, 0.5, 1)
    state = optimizer.state[param]
    assert torch.equal(state["Q"], reference_q0(m, n, r, per_param_seed(5, 0)).to(dtype))
    assert torch.equal(state["momentum"], torch.zeros_like(param))
    assert torch.isfinite(param).all() and torch.isfinite(state["Q"]).all()
    assert torch.equal(param.detach(), start * (1 - lr * wd))


def test_dion_seed_changes_initial_q_and_param_index_separates_equal_shapes():
    params = [gaussian(16, 8, seed=i).requires_grad_() for i in range(2)]
    optimizer = shardopt.Dion(params, rank_fraction=0.5, seed=0)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    Q0, Q1 = optimizer.state[params[0]]["Q"], optimizer.state[params[1]]["Q"]
    assert not torch.equal(Q0, Q1)
    assert torch.equal(Q1, reference_q0(16, 8, 4, per_param_seed(0, 1)))


# ---- Sign-Muon reference (docs/design.md §2) ------------------------------------------------------------

class SignMuonReference:
    """One matrix X (m×n) on one process: the majority vote over one replica is the sign itself."""

    def __init__(self, X, *, lr, momentum, nesterov, ns_steps, post_polar, lr_scale, weight_decay):
        self.X, self.M = X.clone(), torch.zeros_like(X)
        self.lr, self.beta, self.nesterov, self.ns_steps = lr, momentum, nesterov, ns_steps
        self.post_polar, self.lr_scale, self.weight_decay = post_polar, lr_scale, weight_decay

    def step(self, G):
        beta = self.beta
        self.M = beta * self.M + (1 - beta) * G                               # 1. EMA
        U_in = (1 - beta) * G + beta * self.M if self.nesterov else self.M
        U = newton_schulz(U_in, self.ns_steps)                                # 2.
        V = torch.where(U >= 0, 1.0, -1.0).double()                          # 3.–4. sign, 0 ↦ +1
        if self.post_polar:
            V = newton_schulz(V, self.ns_steps)                               # 5.
        n = self.X.shape[1]
        scale = 1.0 if self.lr_scale == "none" else 1 / math.sqrt(n)
        self.X = (1 - self.lr * self.weight_decay) * self.X - self.lr * scale * V   # 6.
        return self.X


SIGNMUON_SHAPES = [(40, 24), (24, 40), (32, 32), (40, 24)]


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("post_polar", [False, True])
@pytest.mark.parametrize("lr_scale", ["none", "unit_gain"])
def test_signmuon_matches_float64_reference(nesterov, post_polar, lr_scale):
    options = dict(lr=0.01, momentum=0.9, nesterov=nesterov, ns_steps=5, post_polar=post_polar, lr_scale=lr_scale,
                   weight_decay=0.1)
    params = [gaussian(*shape, seed=200 + i).requires_grad_() for i, shape in enumerate(SIGNMUON_SHAPES)]
    optimizer = shardopt.SignMuon(params, ns_dtype="float64", **options)
    references = [SignMuonReference(p.detach(), **options) for p in params]
    step_alongside(optimizer, params, references, 6, momentum_tolerance=1e-12)


@pytest.mark.parametrize("lr_scale, n", [("none", 10), ("unit_gain", 10), ("unit_gain", 25)])
def test_signmuon_update_is_lr_times_scale_per_entry(lr_scale, n):
    param = gaussian(7, n, seed=1).requires_grad_()
    start = param.detach().clone()
    optimizer = shardopt.SignMuon([param], lr=0.03, lr_scale=lr_scale)
    param.grad = gaussian(7, n, seed=2)
    optimizer.step()
    expected = 0.03 * (1.0 if lr_scale == "none" else 1 / math.sqrt(n))
    assert torch.allclose((param.detach() - start).abs(), torch.full((7, n), expected, dtype=torch.float64),
                          rtol=1e-12, atol=0)


@pytest.mark.parametrize("shape", [(6, 9), (9, 6)])
def test_signmuon_exact_zero_direction_counts_as_plus_one(shape):
    """A zero row of G stays a zero row of polar(M); its sign is +1, so those entries step by −lr."""
    lr = 0.05
    param = gaussian(*shape, seed=3).requires_grad_()
    start = param.detach().clone()
    grad = gaussian(*shape, seed=4)
    grad[2] = 0
    optimizer = shardopt.SignMuon([param], lr=lr, ns_dtype="float64")
    param.grad = grad
    optimizer.step()
    delta = param.detach() - start
    assert torch.allclose(delta[2], torch.full((shape[1],), -lr, dtype=torch.float64), rtol=1e-12, atol=0)
    assert torch.allclose(delta.abs(), torch.full(shape, lr, dtype=torch.float64), rtol=1e-12, atol=0)


def test_signmuon_all_zero_gradient_does_not_move_the_matrix():
    """A zero momentum abstains (docs/design.md §2): sign(0) = +1 no longer moves every entry by −lr;
    only the decoupled weight decay applies."""
    param = gaussian(5, 4, seed=1).requires_grad_()
    start = param.detach().clone()
    optimizer = shardopt.SignMuon([param], lr=0.1, weight_decay=0.0)
    param.grad = torch.zeros_like(param)
    optimizer.step()
    assert torch.equal(param.detach(), start)


# ---- Dion's matmul precision (matmul_dtype; docs/tuning.md "Dion on a GPU") ------------------------------------

def dion_errors(matmul_dtype, shapes, steps, rank_fraction=0.25):
    """Worst per-step relative error of the update and of the momentum against DionReference, fp32 params."""
    params = [gaussian(*shape, seed=100 + i).float().requires_grad_() for i, shape in enumerate(shapes)]
    optimizer = shardopt.Dion(params, lr=0.02, rank_fraction=rank_fraction, weight_decay=0.1, seed=3,
                              matmul_dtype=matmul_dtype)
    references = [DionReference(p.detach().double(), reference_q0(m, n, reference_rank(m, n, rank_fraction, 1),
                                                                  per_param_seed(3, i)),
                                lr=0.02, mu=0.95, weight_decay=0.1, epsilon=1e-8)
                  for i, (p, (m, n)) in enumerate(zip(params, shapes))]
    worst_update = worst_momentum = 0.0
    for step in range(steps):
        before = [p.detach().double() for p in params]
        for i, p in enumerate(params):
            p.grad = gaussian(*p.shape, seed=1000 * step + i).float()
        optimizer.step()
        for p, start, reference in zip(params, before, references):
            ref_start = reference.X
            ref_update = reference.step(p.grad.double()) - ref_start
            worst_update = max(worst_update, relative_error(p.detach().double() - start, ref_update))
            worst_momentum = max(worst_momentum, relative_error(optimizer.state[p]["momentum"].double(), reference.M))
    return worst_update, worst_momentum


def test_dion_matmul_dtype_default_is_bf16_on_cuda_and_the_compute_dtype_elsewhere():
    resolve = shardopt.algorithms.lowrank.dion_matmul_dtype
    assert resolve(None, torch.float32, torch.device("cuda")) == torch.bfloat16
    assert resolve(None, torch.float32, torch.device("cpu")) == torch.float32
    assert resolve(None, torch.float64, torch.device("cuda")) == torch.float64
    assert resolve("float32", torch.float32, torch.device("cuda")) == torch.float32
    assert resolve("bfloat16", torch.float64, torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="Invalid matmul_dtype: 'float16'.*allowed: None, 'float32', 'bfloat16'"):
        shardopt.Dion([torch.nn.Parameter(torch.zeros(4, 4))], matmul_dtype="float16")


def test_dion_default_matmuls_on_cpu_are_the_float32_ones_bitwise():
    results = {}
    for matmul_dtype in (None, torch.float32):
        params = [gaussian(*shape, seed=i).float().requires_grad_() for i, shape in enumerate(DION_SHAPES)]
        optimizer = shardopt.Dion(params, rank_fraction=0.5, matmul_dtype=matmul_dtype)
        for step in range(2):
            for i, p in enumerate(params):
                p.grad = gaussian(*p.shape, seed=10 * step + i).float()
            optimizer.step()
        results[matmul_dtype] = [p.detach().clone() for p in params]
    assert all(torch.equal(a, b) for a, b in zip(results[None], results[torch.float32]))


def test_dion_bfloat16_matmuls_stay_within_their_documented_tolerance_of_the_float64_reference():
    """bf16 inputs to the four large products (the CUDA default), on a CPU (slow there: small shapes). Documented
    tolerance per step (docs/tuning.md): the update within 1e-2 of the float64 reference, the momentum 1e-3;
    fp32 matmuls are within 1e-4 and 1e-6 — and bf16 is really used: its error is far above fp32's."""
    shapes = [(128, 64), (64, 128), (96, 96)]
    bf16_update, bf16_momentum = dion_errors("bfloat16", shapes, steps=3)
    fp32_update, fp32_momentum = dion_errors("float32", shapes, steps=3)
    assert bf16_update <= 1e-2 and bf16_momentum <= 1e-3
    assert fp32_update <= 1e-4 and fp32_momentum <= 1e-6
    assert bf16_update > 10 * fp32_update
