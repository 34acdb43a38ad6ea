"""1-bit Adam (shardopt/algorithms/onebit_adam.py) and its compressed mean (shardopt/wire/onebit.py), against
float64 oracles written here from the paper's equations (arXiv 2102.02888), on 3 gloo ranks (an odd M: the
chunks' padding is exercised) and on one process:
- the compressed mean: every replica gets the oracle's result, its worker and server errors, over 4 rounds
  of error feedback; bytes equal 2·(M−1)·(C/8 + 4T); ≤ 1/25 of a float32 all-reduce on a 100k-entry model;
- OneBitAdam equals exact Adam (m/(√v+ε) with the replicas' mean gradient, no bias correction) over its
  freeze_step steps, then the oracle's 1-bit Adam; replicas bitwise identical; describe() reports both phases;
- bad input: freeze_step, amsgrad.
"""

import pytest
import torch
import torch.distributed as dist

import shardopt
from shardopt.optim.schedule import complete
from shardopt.optim import traffic
from shardopt.wire.comm import Axis, CountingAxis, collective_bytes
from shardopt.wire.onebit import ONEBIT_MEAN, onebit_mean_bytes
from workers import WorkerPool

M = 3
NUMELS = [5, 40, 1, 100, 24]
FREEZE, STEPS = 3, 7


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(M)
    yield p
    p.close()


# ---- the float64 oracle ----------------------------------------------------------------------------
def _compress(x: torch.Tensor) -> torch.Tensor:
    """s·sign(x), s = ‖x‖₂/√n, sign(0) = +1."""
    return torch.where(x >= 0, 1.0, -1.0).double() * (x.norm() / max(x.numel(), 1) ** 0.5)


def oracle_mean(xs: list[list[torch.Tensor]], worker: list[list[torch.Tensor]], server: list[list[torch.Tensor]]):
    """xs[j][t]: replica j's tensor t. The errors are updated in place; returns the result (per tensor)."""
    replicas = len(xs)
    result = []
    for t in range(len(xs[0])):
        n = xs[0][t].numel()
        chunk = -(-n // (8 * replicas)) * 8
        sent = []
        for j in range(replicas):
            compensated = xs[j][t] + worker[j][t]
            sent.append(_compress(compensated))
            worker[j][t].copy_(compensated - sent[-1])
        pieces = []
        for owner in range(replicas):
            lo, hi = min(owner * chunk, n), min((owner + 1) * chunk, n)
            y = sum(s[lo:hi] for s in sent) / replicas + server[owner][t][lo:hi]
            pieces.append(_compress(y))
            server[owner][t][lo:hi] = y - pieces[-1]
        result.append(torch.cat(pieces))
    return result


def _inputs(rank: int, round_: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * round_ + rank)
    return [torch.randn(n, generator=generator, dtype=torch.float64) for n in NUMELS]


def _mean_rounds(rounds: int):
    axis = Axis("replicate", dist.group.WORLD)
    worker = [torch.zeros(n) for n in NUMELS]
    server = [torch.zeros(n) for n in NUMELS]
    results = [complete(ONEBIT_MEAN.tensors([x.float() for x in _inputs(dist.get_rank(), r)], worker, server, axis))
               for r in range(rounds)]
    return results, worker, server, axis.stats()["bytes_sent"]


def test_compressed_mean_matches_the_float64_oracle(pool):
    rounds = 4
    got = pool.run(_mean_rounds, rounds)
    worker = [[torch.zeros(n, dtype=torch.float64) for n in NUMELS] for _ in range(M)]
    server = [[torch.zeros(n, dtype=torch.float64) for n in NUMELS] for _ in range(M)]
    for r in range(rounds):
        expected = oracle_mean([_inputs(j, r) for j in range(M)], worker, server)
        for rank in range(M):
            for mine, want in zip(got[rank][0][r], expected):
                torch.testing.assert_close(mine.double(), want, atol=1e-5, rtol=1e-5)
            assert all(torch.equal(a, b) for a, b in zip(got[rank][0][r], got[0][0][r]))   # bitwise equal replicas
    for rank in range(M):
        for mine, want in zip(got[rank][1], worker[rank]):
            torch.testing.assert_close(mine.double(), want, atol=1e-5, rtol=1e-5)
        for mine, want, n in zip(got[rank][2], server[rank], NUMELS):   # only the owned chunk is used
            chunk = -(-n // (8 * M)) * 8
            torch.testing.assert_close(mine.double()[rank * chunk:(rank + 1) * chunk],
                                       want[rank * chunk:(rank + 1) * chunk], atol=1e-5, rtol=1e-5)
    chunks = sum(-(-n // (8 * M)) * 8 for n in NUMELS)
    formula = 2 * (M - 1) * (chunks // 8 + 4 * len(NUMELS))
    assert [g[3] for g in got] == [rounds * formula] * M
    assert onebit_mean_bytes(NUMELS, M) == formula


@pytest.mark.parametrize("replicas", [2, 3, 8, 64])
def test_compressed_mean_bytes_are_at_most_1_25_of_fp32_allreduce(replicas):
    numels = [768 * 256, 256 * 256, 256, 256 * 1024, 1024 * 256, 256] * 2   # a 1M-entry model in 12 tensors
    axis = CountingAxis("replicate", replicas)
    xs = [torch.empty(n, device="meta") for n in numels]
    complete(ONEBIT_MEAN.tensors(xs, [torch.empty(n, device="meta") for n in numels],
                                 [torch.empty(n, device="meta") for n in numels], axis))
    assert axis.bytes_sent == onebit_mean_bytes(numels, replicas)
    assert axis.bytes_sent <= collective_bytes("all_reduce", 4 * sum(numels), replicas) / 25


# ---- OneBitAdam ------------------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def _grads(rank: int, step: int, params) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(p.shape, generator=generator, dtype=torch.float64) for p in params]


def oracle_onebit_adam(replicas: int, steps: int, lr=0.01, betas=(0.9, 0.99), eps=1e-8, wd=0.1):
    """Each replica's params after `steps` steps (float64; the gradients of `_grads`)."""
    params = [p.detach().clone() for p in _model().parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    worker = [[torch.zeros(p.numel(), dtype=torch.float64) for p in params] for _ in range(replicas)]
    server = [[torch.zeros(p.numel(), dtype=torch.float64) for p in params] for _ in range(replicas)]
    history = []
    for step in range(1, steps + 1):
        grads = [_grads(j, step, params) for j in range(replicas)]
        if step <= FREEZE:
            mean = [sum(g[i] for g in grads) / replicas for i in range(len(params))]
            m = [betas[0] * a + (1 - betas[0]) * g for a, g in zip(m, mean)]
            v = [betas[1] * b + (1 - betas[1]) * g * g for b, g in zip(v, mean)]
        else:
            local = [[(betas[0] * a + (1 - betas[0]) * g).reshape(-1) for a, g in zip(m, grads[j])]
                     for j in range(replicas)]
            m = [x.view_as(p) for x, p in zip(oracle_mean(local, worker, server) if replicas > 1 else local[0], params)]
        params = [p - lr * (a / (b.sqrt() + eps) + wd * p) for p, a, b in zip(params, m, v)]
        history.append(params)
    return history


def _train(steps: int):
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = _model()
    params = list(model.parameters())
    replicate = dist.group.WORLD if dist.is_initialized() else None
    optimizer = shardopt.OneBitAdam(params, lr=0.01, freeze_step=FREEZE, betas=(0.9, 0.99), eps=1e-8,
                                    weight_decay=0.1, replicate_mesh=replicate)
    history, sent = [], []
    for step in range(1, steps + 1):
        for p, g in zip(params, _grads(rank, step, params)):
            p.grad = g
        before = optimizer.comm_stats()["replicate"]["bytes_sent"]
        optimizer.step()
        sent.append(optimizer.comm_stats()["replicate"]["bytes_sent"] - before)
        history.append([p.detach().clone() for p in params])
    return history, sent, optimizer.describe(), optimizer.replicas_consistent()


def test_onebit_adam_is_exact_adam_during_freeze_then_the_oracle(pool):
    got = pool.run(_train, STEPS)
    expected = oracle_onebit_adam(M, STEPS)
    worst_freeze = max((a - b).abs().max().item() for step in range(FREEZE)
                       for a, b in zip(got[0][0][step], expected[step]))
    assert worst_freeze < 1e-12        # float64, the same equations: rounding only
    for step in range(STEPS):
        for a, b in zip(got[0][0][step], expected[step]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for rank in range(1, M):
            assert all(torch.equal(a, b) for a, b in zip(got[rank][0][step], got[0][0][step]))
    assert all(result[3] for result in got)
    numels = [p.numel() for p in _model().parameters()]
    mean_bytes = collective_bytes("all_reduce", 8 * sum(numels), M)   # float64 params: the gradient mean
    checks = collective_bytes("all_reduce", 4, M)                     # the agreed non-finite flag
    sent = got[0][1]
    assert sent[1:FREEZE] == [mean_bytes + checks] * (FREEZE - 1)
    assert sent[FREEZE:] == [onebit_mean_bytes(numels, M) + checks] * (STEPS - FREEZE)
    assert f"B/step steps 1-{FREEZE}" in got[0][2] and f"after step {FREEZE}" in got[0][2]


def test_one_replica_is_adam_without_bias_correction_throughout():
    history, sent, _, _ = _train(STEPS)
    expected = oracle_onebit_adam(1, STEPS)
    for mine, want in zip(history, expected):
        for a, b in zip(mine, want):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert set(sent) == {0}


def test_describe_counts_the_phase_after_freeze():
    group = {**shardopt.OneBitAdam(_model().parameters(), freeze_step=5).param_groups[0]}
    numels = [p.numel() for p in group["params"]]
    assert traffic.group_bytes(group, 4, step=1) == collective_bytes("all_reduce", 8 * sum(numels), 4)
    assert traffic.group_bytes(group, 4, step=6) == onebit_mean_bytes(numels, 4)


@pytest.mark.parametrize("options, message", [
    ({"freeze_step": -1}, "Invalid freeze_step: -1"),
    ({"freeze_step": 2.5}, "Invalid freeze_step: 2.5"),
    ({"lr": -1.0}, "Invalid lr"),
])
def test_bad_options_name_the_parameter(options, message):
    with pytest.raises(ValueError, match=message):
        shardopt.OneBitAdam(_model().parameters(), **options)
