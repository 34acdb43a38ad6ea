"""Single-process unit tests of the pure math stages: signs and bit packing, majority, the low-rank
pieces of Dion, Newton–Schulz polar, and the element-wise AdamW/Lion updates."""

import math

import pytest
import torch
import torch.utils._python_dispatch

import reference
from reference import newton_schulz
from shardopt.wire.comm import Axes, Axis
from shardopt.algorithms.elementwise import adamw_update
from shardopt.wire.exchange import Vote
from shardopt.algorithms.lowrank import column_normalize, dion_rank, dither_size, orthonormalize
from shardopt.algorithms.nonmatrix import lion_step
from shardopt.algorithms.polar import polar
from shardopt.optim.schedule import complete
from shardopt.wire.signs import count_positive, majority, pack_signs, padded_length, positive_signs, unpack_signs
from shardopt.wire.vote import VOTE_FORMATS, tie_coins, vote_bytes, vote_format

A, B, C = 3.4445, -4.7750, 2.0315


def gaussian(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def random_bools(n, seed=0):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.5


# ---- signs and bit packing ---------------------------------------------------------------------

def test_positive_signs_maps_exact_zero_to_plus_one():
    U = torch.tensor([-1.0, -0.0, 0.0, 1e-30, -1e-30, 2.0])
    assert positive_signs(U).tolist() == [False, True, True, True, False, True]


@pytest.mark.parametrize("n", [0, 1, 5, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 1001])
def test_pack_unpack_round_trip_any_length(n):
    positive = random_bools(n, seed=n)
    packed = pack_signs(positive)
    assert packed.dtype == torch.uint8
    assert packed.shape == (padded_length(n, 8) // 8,)
    assert torch.equal(unpack_signs(packed, n), positive)


@pytest.mark.parametrize("n", [1, 7, 9, 33])
def test_pack_pads_with_minus_one_bits(n):
    positive = torch.ones(n, dtype=torch.bool)
    unpacked = unpack_signs(pack_signs(positive))
    assert unpacked.shape == (padded_length(n, 8),)
    assert unpacked[:n].all()
    assert not unpacked[n:].any()


@pytest.mark.parametrize("n, pad_to", [(1, 16), (17, 16), (32, 32), (33, 32), (100, 64)])
def test_pack_pad_to_rounds_length_up_to_multiple(n, pad_to):
    positive = random_bools(n, seed=3)
    packed = pack_signs(positive, pad_to=pad_to)
    assert packed.numel() * 8 == padded_length(n, pad_to)
    assert packed.numel() * 8 % pad_to == 0
    assert torch.equal(unpack_signs(packed, n), positive)
    assert not unpack_signs(packed)[n:].any()


def test_pack_bit_order_entry_8k_plus_i_is_bit_i_of_byte_k():
    for k in range(3):
        for i in range(8):
            positive = torch.zeros(24, dtype=torch.bool)
            positive[8 * k + i] = True
            expected = torch.zeros(3, dtype=torch.uint8)
            expected[k] = 1 << i
            assert torch.equal(pack_signs(positive), expected), (k, i)
    assert pack_signs(torch.tensor([True, True, False, True, False, False, False, True])).item() == 0b10001011


def test_unpack_works_on_leading_batch_dims():
    rows = [random_bools(20, seed=s) for s in range(3)]
    packed = torch.stack([pack_signs(r) for r in rows])          # (3, 3)
    unpacked = unpack_signs(packed, 20)
    assert unpacked.shape == (3, 20)
    for r, row in enumerate(rows):
        assert torch.equal(unpacked[r], row)


def test_pack_signs_accepts_non_flat_input_in_row_major_order():
    positive = random_bools(24, seed=5)
    assert torch.equal(pack_signs(positive.view(4, 6)), pack_signs(positive))


# ---- majority -----------------------------------------------------------------------------------

def test_majority_odd_voters_is_sign_of_vote_sum():
    voters = 5
    counts = torch.arange(voters + 1)                             # number of +1 votes
    expected = [1 if 2 * c - voters > 0 else -1 for c in counts.tolist()]
    V = majority(counts, voters, None)
    assert V.dtype == torch.int8
    assert V.tolist() == expected


def test_majority_even_voters_tie_abstains_without_tie_break():
    V = majority(torch.tensor([0, 1, 2, 3, 4]), 4, None)
    assert V.tolist() == [-1, -1, 0, 1, 1]


def test_majority_tie_break_applies_only_at_ties():
    counts = torch.tensor([0, 2, 2, 4, 1, 3])
    tie_break = torch.tensor([1, 1, -1, -1, 1, -1], dtype=torch.int8)
    V = majority(counts, 4, tie_break)
    assert V.tolist() == [-1, 1, -1, 1, -1, 1]


def test_majority_single_voter_returns_own_sign():
    positive = random_bools(50, seed=1)
    V = majority(positive.to(torch.int32), 1, torch.ones(50, dtype=torch.int8))
    assert torch.equal(V, torch.where(positive, 1, -1).to(torch.int8))


@pytest.mark.parametrize("replicas", [1, 2, 5, 64, 300])
def test_count_positive_counts_set_bits_per_entry_over_rows(replicas):
    rows = torch.stack([random_bools(37, seed=s) for s in range(replicas)])            # (M, 37)
    counts = count_positive(torch.stack([pack_signs(r) for r in rows]), 37)
    assert counts.dtype == (torch.uint8 if replicas <= 255 else torch.int16)
    assert torch.equal(counts.long(), rows.long().sum(0))


# ---- tie coins (docs/design.md §2) ---------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 77, 12345, 2**63 - 1])
def test_tie_coins_are_the_documented_hash_of_seed_and_entry(seed):
    assert torch.equal(tie_coins(seed, 0, 1001, torch.device("cpu")).long(), reference.coins(seed, 1001))
    assert torch.equal(tie_coins(seed, 8 * 999, 64, torch.device("cpu")).long(), reference.coins(seed, 64, 8 * 999))


def test_tie_coins_of_owner_chunks_are_the_whole_votes_coins_and_fair():
    """An owner draws only its chunk; the chunks in order are every entry's coins (so "allgather_1bit" and
    "alltoall_1bit" break a tie alike, at any replica count); about half are +1 at every bit position."""
    n = 1 << 16
    whole = tie_coins(5, 0, n, torch.device("cpu"))
    for voters in (2, 4, 64):
        chunk = padded_length(n, 8 * voters) // voters
        assert torch.equal(torch.cat([tie_coins(5, owner * chunk, chunk, torch.device("cpu"))
                                      for owner in range(voters)])[:n], whole)
    heads = (whole > 0).view(-1, 8).double().mean(0)
    assert ((heads - 0.5).abs() < 0.02).all(), heads
    assert not torch.equal(whole, tie_coins(6, 0, n, torch.device("cpu")))


@pytest.mark.parametrize("fmt", VOTE_FORMATS)
def test_vote_bytes_counted_from_the_exchange_equal_the_documented_table(fmt):
    """vote_bytes runs the format's own exchange on a counting axis; tests/reference.py's table is the oracle."""
    for n in (1, 37, 96, 768, 4099):
        for voters in (1, 2, 3, 4, 8, 63, 64, 128, 300):
            for matrices in (0, 1, 5, 9):
                if matrices and n % matrices:
                    continue
                assert vote_bytes(fmt, n, voters, matrices) == reference.vote_bytes(fmt, n, voters, matrices), \
                    (n, voters, matrices)


# ---- orthonormalize, column_normalize, dion_rank -------------------------------------------------

@pytest.mark.parametrize("method", ["qr", "cholesky", "rcqr"])
@pytest.mark.parametrize("shape", [(40, 5), (40, 40), (3, 17, 6)])
def test_orthonormalize_gives_orthonormal_basis_of_same_span(method, shape):
    P = gaussian(*shape, seed=11)
    Q = orthonormalize(P, method)
    r = shape[-1]
    eye = torch.eye(r, dtype=P.dtype).expand(Q.mT.shape[:-2] + (r, r))
    assert torch.allclose(Q.mT @ Q, eye, atol=1e-10)
    assert torch.allclose(Q @ (Q.mT @ P), P, atol=1e-10)          # P lies in span(Q)


@pytest.mark.parametrize("method", ["qr", "cholesky", "rcqr"])
def test_orthonormalize_zero_matrix_stays_zero_in_batch(method):
    P = gaussian(3, 12, 4, seed=2)
    P[1] = 0
    Q = orthonormalize(P, method)
    assert torch.equal(Q[1], torch.zeros(12, 4, dtype=P.dtype))
    assert torch.allclose(Q[0].T @ Q[0], torch.eye(4, dtype=P.dtype), atol=1e-10)
    assert torch.isfinite(Q).all()


def rank_deficient(kind, a, r, dtype):
    """Stacks of 2 P (a, r) that an unguarded Cholesky-QR cannot factor: zero columns, repeated columns, an exact
    low-rank product made in `dtype` (as a first step's B·Q from a small batch), and P = U·diag(σ)·Vᵀ with
    σ from 1 down to 1e-12."""
    P = gaussian(2, a, r, seed=4, dtype=dtype)
    if kind == "zero columns":
        P[..., ::3] = 0
    elif kind == "repeated columns":
        P[..., 1::2] = P[..., 0::2][..., :r // 2]
    elif kind == "low rank":
        P = gaussian(2, a, 2, seed=5, dtype=dtype) @ gaussian(2, 2, r, seed=6, dtype=dtype)
    else:
        U, V = torch.linalg.qr(gaussian(2, a, r, seed=7)).Q, torch.linalg.qr(gaussian(2, r, r, seed=8)).Q
        P = ((U * torch.logspace(0, -12, r, dtype=torch.float64)) @ V.mT).to(dtype)
    return P


@pytest.mark.parametrize("method", ["cholesky", "rcqr"])
@pytest.mark.parametrize("kind", ["zero columns", "repeated columns", "low rank", "condition 1e12"])
@pytest.mark.parametrize("dtype, a, r, tol", [(torch.float64, 40, 8, 1e-10), (torch.float32, 768, 64, 1e-5)])
def test_orthonormalize_cholesky_variants_complete_a_rank_deficient_p_to_an_orthonormal_basis(method, kind, dtype,
                                                                                            a, r, tol):
    """No host fallback: the dither makes the factorizations succeed, Q is orthonormal with P in its span (the
    docs/tuning.md tolerances), and it has full rank r, as Householder's, so Dion's Q keeps rank r."""
    P = rank_deficient(kind, a, r, dtype)
    Q = orthonormalize(P, method, seed=3)
    eye = torch.eye(r, dtype=dtype)
    assert (torch.linalg.matrix_norm(Q.mT @ Q - eye, ord=2) <= tol).all()
    residual = torch.linalg.matrix_norm(P - Q @ (Q.mT @ P)) / torch.linalg.matrix_norm(P)
    assert (residual <= tol + 2 * dither_size(method, P)).all(), residual     # span(P) turns by about δ


@pytest.mark.parametrize("method", ["cholesky", "rcqr"])
def test_orthonormalize_cholesky_variants_give_every_rank_the_same_q_for_the_same_seed(method):
    P = rank_deficient("zero columns", 64, 8, torch.float32)
    assert torch.equal(orthonormalize(P, method, seed=9), orthonormalize(P.clone(), method, seed=9))


@pytest.mark.parametrize("method", ["cholesky", "rcqr"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_orthonormalize_cholesky_variants_zero_a_non_finite_p_and_leave_the_others(method, bad):
    """The device-side guard: a matrix whose factorization cannot succeed maps to zeros (a zero Dion update for
    it), the other matrices of the stack are untouched."""
    finite = gaussian(3, 30, 5, seed=12, dtype=torch.float32)
    P = finite.clone()
    P[1, 4, 2] = bad
    Q, Q_finite = orthonormalize(P, method), orthonormalize(finite, method)
    assert torch.equal(Q[1], torch.zeros(30, 5))
    for i in (0, 2):
        assert torch.equal(Q[i], Q_finite[i])
        assert torch.allclose(Q[i].T @ Q[i], torch.eye(5), atol=1e-5)


def test_orthonormalize_cholesky_equals_qr_up_to_column_signs():
    P = gaussian(64, 8, seed=9)
    Qq, Qc = orthonormalize(P, "qr"), orthonormalize(P, "cholesky")
    signs = torch.sign((Qq * Qc).sum(0))
    assert torch.allclose(Qq * signs, Qc, atol=1e-10)


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that hand a tensor's value to Python (a device sync on a GPU), as step_ops.py does."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += str(func.overloadpacket) in ("aten._local_scalar_dense", "aten.equal", "aten.is_nonzero")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["qr", "cholesky", "rcqr"])
def test_orthonormalize_reads_nothing_back_to_the_host(method):
    """What docs/tuning.md says: no method hands a value to Python (a device sync on a GPU), whether its
    factorization succeeds (Gaussian P), needs the dither (zero columns) or the guard (all-zero P)."""
    for P in (gaussian(4, 40, 6, seed=1), rank_deficient("zero columns", 40, 6, torch.float64),
              torch.zeros(2, 40, 6, dtype=torch.float64)):
        with HostReads() as counted:
            orthonormalize(P, method)
        assert counted.reads == 0


def test_orthonormalize_rejects_unknown_method():
    with pytest.raises(ValueError, match="qr_method"):
        orthonormalize(gaussian(4, 2), "svd")


def test_column_normalize_gives_unit_columns_and_keeps_previous_q_for_zero_columns():
    R = gaussian(10, 4, seed=5)
    R[:, 1] = 0
    Q_prev = gaussian(10, 4, seed=6)
    eps = 1e-8
    Q = column_normalize(R, (R * R).sum(0), Q_prev, eps)
    norms = R.norm(dim=0)
    for j in (0, 2, 3):
        assert torch.allclose(Q[:, j], R[:, j] / (norms[j] + eps), rtol=1e-14, atol=0)
        assert abs(Q[:, j].norm().item() - 1) < 1e-7
    assert torch.equal(Q[:, 1], Q_prev[:, 1])


def test_column_normalize_uses_the_given_squared_norms():
    """Under the shard axis the norms are summed over row blocks, not taken from the local R."""
    R = gaussian(6, 3, seed=7)
    col_sq = torch.tensor([4.0, 9.0, 16.0], dtype=torch.float64)
    Q = column_normalize(R, col_sq, torch.zeros_like(R), 0.0)
    assert torch.allclose(Q, R / torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64))


@pytest.mark.parametrize("m, n, rank_fraction, multiple, expected", [
    (64, 32, 1.0, 1, 32),
    (32, 64, 1.0, 1, 32),
    (64, 32, 0.5, 1, 16),
    (64, 32, 0.125, 1, 4),
    (64, 30, 0.1, 1, 3),       # ceil(3.0)
    (64, 31, 0.1, 1, 4),       # ceil(3.1)
    (64, 40, 0.1, 8, 8),       # ceil(0.5)·8
    (64, 40, 0.3, 8, 16),      # ceil(1.5)·8
    (64, 20, 0.9, 16, 20),     # capped by min(m, n)
    (5, 3, 0.01, 1, 1),        # at least 1
])
def test_dion_rank_formula(m, n, rank_fraction, multiple, expected):
    assert dion_rank(m, n, rank_fraction, multiple) == expected


# ---- Newton–Schulz polar ------------------------------------------------------------------------

# Aspect ratio ≥ 4/3 (measured over 20 seeds: σ ∈ [0.6818, 1.1344]). For square and near-square
# Gaussian matrices the claim is false: σ_min(G)/‖G‖_F is O(n^-1.5) and 5 quintic steps lift it by at
# most ~3.4445⁵; measured σ_min after 5 steps: 8×8 0.470, 16×16 0.661, 32×32 0.027, 64×64 0.012,
# 128×128 0.0045, 256×256 0.0030; σ_max reaches 1.2024 (the quintic's peak) for square, 128×120
# (1.2023) and 100×90 (1.1947, in range).
NS_SHAPES = [(64, 48), (48, 64), (256, 64), (64, 256), (512, 128), (128, 32), (300, 200)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", NS_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
def test_polar_singular_values_of_gaussian_tall_and_wide_lie_in_0_6_to_1_2(shape, dtype):
    for seed in range(3):
        U = polar(gaussian(*shape, seed=seed), steps=5, dtype=dtype)
        assert U.dtype == dtype and U.shape == shape
        s = torch.linalg.svdvals(U.double())
        assert s.min() >= 0.6 and s.max() <= 1.2, (shape, dtype, seed, s.min().item(), s.max().item())


def quintic_maximum():
    """max over x ≥ 0 of a·x + b·x³ + c·x⁵ (at the smaller root of the derivative), ≈ 1.2024."""
    x2 = (-3 * B - math.sqrt(9 * B * B - 20 * A * C)) / (10 * C)
    x = math.sqrt(x2)
    return A * x + B * x ** 3 + C * x ** 5


@pytest.mark.parametrize("n", [16, 64, 128])
def test_polar_square_well_conditioned_lies_in_0_6_to_quintic_maximum(n):
    """Square shapes where the bound honestly holds: condition number ≤ 10 (Gaussian square
    matrices do not satisfy it, see NS_SHAPES). The upper bound is the quintic's peak ≈ 1.2024."""
    U0 = torch.linalg.qr(gaussian(n, n, seed=1)).Q
    V0 = torch.linalg.qr(gaussian(n, n, seed=2)).Q
    G = U0 @ torch.diag(torch.linspace(1.0, 10.0, n, dtype=torch.float64)) @ V0.T
    s = torch.linalg.svdvals(polar(G, 5, torch.float32).double())
    assert s.min() >= 0.6 and s.max() <= quintic_maximum() + 1e-4
    assert abs(quintic_maximum() - 1.2024) < 1e-3


@pytest.mark.parametrize("shape", [(24, 10), (10, 24), (16, 16)])
@pytest.mark.parametrize("steps", [1, 5])
def test_polar_float64_matches_reference_quintic(shape, steps):
    G = gaussian(*shape, seed=8)
    assert torch.allclose(polar(G, steps, torch.float64), newton_schulz(G, steps), rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(5, 24, 10), (5, 10, 24), (2, 3, 12, 12)])
def test_polar_on_batch_equals_polar_per_matrix(shape):
    G = gaussian(*shape, seed=10)
    batched = polar(G, 5, torch.float64)
    for index in torch.cartesian_prod(*[torch.arange(s) for s in shape[:-2]]).reshape(-1, len(shape) - 2):
        index = tuple(index.tolist())
        assert torch.allclose(batched[index], polar(G[index], 5, torch.float64), rtol=0, atol=1e-12)


def test_polar_batch_with_one_zero_matrix_keeps_it_zero_and_others_unaffected():
    G = gaussian(3, 8, 6, seed=12)
    G[1] = 0
    U = polar(G, 5, torch.float32)
    assert torch.equal(U[1], torch.zeros(8, 6))
    assert torch.allclose(U[0], polar(G[0], 5, torch.float32), atol=1e-6)


def test_polar_default_dtype_on_cpu_is_float32():
    assert polar(gaussian(6, 4), 2).dtype == torch.float32


def test_polar_rejects_vectors():
    with pytest.raises(ValueError, match="matrix"):
        polar(torch.ones(5))


# ---- AdamW and Lion -----------------------------------------------------------------------------

def test_adamw_update_matches_torch_adamw_over_steps():
    lr, betas, eps, wd = 3e-3, (0.8, 0.95), 1e-6, 0.1
    shapes = [(7, 5), (11,), (3, 2, 4)]
    params = [gaussian(*s, seed=i) for i, s in enumerate(shapes)]
    torch_params = [p.clone().requires_grad_() for p in params]
    reference = torch.optim.AdamW(torch_params, lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    for step in range(1, 8):
        grads = [gaussian(*s, seed=100 * step + i) for i, s in enumerate(shapes)]
        for p, g in zip(torch_params, grads):
            p.grad = g.clone()
        reference.step()
        adamw_update(params, grads, exp_avgs, exp_avg_sqs, step, lr=lr, betas=betas, epsilon=eps, weight_decay=wd)
        for mine, theirs in zip(params, torch_params):
            assert torch.allclose(mine, theirs.detach(), rtol=0, atol=1e-13), step
    for i, p in enumerate(torch_params):
        assert torch.allclose(exp_avgs[i], reference.state[p]["exp_avg"], atol=1e-14)
        assert torch.allclose(exp_avg_sqs[i], reference.state[p]["exp_avg_sq"], atol=1e-14)


def reference_lion(x, g, m, lr, betas, wd):
    """Lion (Chen et al. 2023): c = β₁m + (1−β₁)g; x ← x·(1 − lr·wd) − lr·sign(c); m ← β₂m + (1−β₂)g."""
    beta1, beta2 = betas
    direction = torch.sign(beta1 * m + (1 - beta1) * g)
    x = x * (1 - lr * wd) - lr * direction
    m = beta2 * m + (1 - beta2) * g
    return x, m


def lion_on_one_replica(params, grads, exp_avgs, lr, betas, wd, vote="auto"):
    """shardopt's Lion-vote step on a replicate axis of size 1 (no exchange)."""
    states = [{"exp_avg": m} for m in exp_avgs]
    exchanges = {dtype: Vote(vote_format(vote, sum(p.numel() for p in params if p.dtype == dtype), 1))
                 for dtype in {p.dtype for p in params}}
    complete(lion_step(params, grads, states, exchanges=exchanges, axes=Axes(Axis("replicate"), Axis("shard"),
                                                                             Axis("tensor")),
                       seed=0, lr=lr, betas=betas, weight_decay=wd, epsilon=1e-8))


def test_lion_update_matches_hand_written_lion_over_steps():
    lr, betas, wd = 1e-3, (0.9, 0.99), 0.5
    shapes = [(6, 4), (9,)]
    params = [gaussian(*s, seed=i) for i, s in enumerate(shapes)]
    exp_avgs = [torch.zeros_like(p) for p in params]
    ref_x = [p.clone() for p in params]
    ref_m = [torch.zeros_like(p) for p in params]
    for step in range(6):
        grads = [gaussian(*s, seed=50 * step + i) for i, s in enumerate(shapes)]
        lion_on_one_replica(params, grads, exp_avgs, lr, betas, wd)
        for i in range(len(shapes)):
            ref_x[i], ref_m[i] = reference_lion(ref_x[i], grads[i], ref_m[i], lr, betas, wd)
            assert torch.allclose(params[i], ref_x[i], rtol=0, atol=1e-14)
            assert torch.allclose(exp_avgs[i], ref_m[i], rtol=0, atol=1e-14)


def test_lion_zero_direction_does_not_move_param():
    x = torch.ones(4, dtype=torch.float64)
    lion_on_one_replica([x], [torch.zeros(4, dtype=torch.float64)], [torch.zeros(4, dtype=torch.float64)],
                        0.1, (0.9, 0.99), 0.0)
    assert torch.equal(x, torch.ones(4, dtype=torch.float64))
