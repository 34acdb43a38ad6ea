"""Single-process checks on a CUDA device (launch/gpu_check.py runs them; skipped without CUDA).

Pinned here, on the GPU: Newton–Schulz in bf16 (the CUDA default) close to the float64
reference; Dion (Householder and randomized Cholesky-QR; bf16 matmul inputs, the CUDA default, and fp32)
against the float64 reference;
Dion's orthonormalization (every qr_method) makes no host sync that torch's sync debug mode sees;
Sign-Muon moves every entry by exactly lr; fp32 state for bf16 params; compiled Newton–Schulz
equal to eager; every state tensor stays on the parameter's device; the tie coins are the CPU's bits.
"""

import pytest
import torch

import reference
import shardopt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device (torch.cuda.is_available() is False)")
CUDA = torch.device("cuda")


def test_polar_bf16_default_on_cuda_close_to_float64_reference():
    G = torch.randn(4, 256, 512, generator=torch.Generator().manual_seed(0))
    U = shardopt.polar(G.to(CUDA), 5)
    assert U.dtype == torch.bfloat16 and U.device.type == "cuda"
    want = torch.stack([reference.newton_schulz(g) for g in G])
    assert ((U.double().cpu() - want).norm() / want.norm()).item() <= 5e-2   # bf16: ~2.5e-2 measured on CPU


@pytest.mark.parametrize("qr_method", ["qr", "cholesky", "rcqr"])
def test_orthonormalize_on_cuda_makes_no_host_sync(qr_method):
    """torch.cuda.set_sync_debug_mode("error") raises on every sync torch makes (a device value read back, a
    blocking copy): none for a Gaussian, a rank-deficient (zero columns) and an all-zero P. A sync inside
    cuSOLVER or MAGMA is not seen by it."""
    P = torch.randn(3, 768, 64, generator=torch.Generator().manual_seed(0)).to(CUDA)
    P[1, :, ::3] = 0
    P[2] = 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        Q = shardopt.algorithms.lowrank.orthonormalize(P, qr_method, seed=1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eye = torch.eye(64, device=CUDA)
    assert torch.allclose(Q[:2].mT @ Q[:2], eye.expand(2, 64, 64), atol=1e-5)
    assert torch.equal(Q[2], torch.zeros_like(Q[2]))


# Dion's params after 5 steps against the float64 reference, relative (docs/tuning.md "Dion on a GPU"): fp32
# matmuls 1.6e-7 and their bf16 inputs (the CUDA default) 2.5e-5 measured on a CPU with these shapes and seeds
DION_TOLERANCE = {"float32": 1e-5, None: 1e-4}


@pytest.mark.parametrize("matmul_dtype", [None, "float32"])
@pytest.mark.parametrize("qr_method", ["qr", "rcqr"])
def test_dion_on_cuda_matches_float64_reference(qr_method, matmul_dtype):
    hyper = dict(lr=0.02, mu=0.9, weight_decay=0.1, matmul_dtype=matmul_dtype)
    generator = torch.Generator().manual_seed(1)
    shapes = [(96, 64), (64, 96), (96, 64)]
    initial = [torch.randn(*s, generator=generator, dtype=torch.float64) for s in shapes]
    params = [torch.nn.Parameter(x.float().to(CUDA)) for x in initial]
    opt = shardopt.Dion(params, rank_fraction=0.25, qr_method=qr_method, seed=2, **hyper)
    loops = []
    for index, X in enumerate(initial):
        r = shardopt.algorithms.lowrank.dion_rank(*X.shape, 0.25, 1)
        loops.append([X, torch.zeros_like(X), reference.initial_q(min(X.shape), r,
                                                                   reference.optimizer_param_seed(2, index))])
    for _ in range(5):
        for index, param in enumerate(params):
            G = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            param.grad = G.float().to(CUDA)
            X, M, Q = loops[index]
            loops[index] = list(reference.dion_step(X, G.float().double(), M, Q, transpose=X.shape[0] < X.shape[1],
                                                    lr=0.02, mu=0.9, weight_decay=0.1))
        opt.step()
    for param, loop in zip(params, loops):
        assert ((param.double().cpu() - loop[0]).norm() / loop[0].norm()).item() <= DION_TOLERANCE[matmul_dtype]
        assert all(value.device.type == "cuda" for key, value in opt.state[param].items() if key != "step")


def test_signmuon_on_cuda_moves_every_entry_by_lr_with_fp32_state_for_bf16_params():
    params = [torch.nn.Parameter(torch.zeros(128, 256, device=CUDA, dtype=torch.bfloat16))]
    opt = shardopt.SignMuon(params, lr=0.5, state_dtype="float32")
    params[0].grad = torch.randn(128, 256, device=CUDA).bfloat16()
    opt.step()
    assert params[0].abs().eq(0.5).all()
    momentum = opt.state[params[0]]["momentum"]
    assert momentum.dtype == torch.float32 and momentum.device.type == "cuda"


def test_compiled_newton_schulz_on_cuda_equals_eager():
    G = torch.randn(4, 256, 512, device=CUDA)
    eager = shardopt.polar(G, 5)
    compiled = shardopt.polar(G, 5, compile=True)
    assert "failed" not in __import__("sys").modules["shardopt.algorithms.polar"]._compiled
    assert ((compiled.float() - eager.float()).norm() / eager.float().norm()).item() <= 5e-2


def test_tie_coins_on_cuda_are_the_same_bits_as_on_the_cpu_and_the_reference():
    """The coins are integer hashes (docs/design.md §2), not a device generator: the same on any device."""
    from shardopt.wire.vote import tie_coins
    for seed, start, n in ((0, 0, 1 << 20), (2**63 - 1, 8 * 12345, 4099)):
        on_cuda = tie_coins(seed, start, n, CUDA)
        assert on_cuda.device.type == "cuda"
        assert torch.equal(on_cuda.cpu(), tie_coins(seed, start, n, torch.device("cpu")))
        assert torch.equal(on_cuda.cpu().long(), reference.coins(seed, n, start))
