"""A zero momentum abstains (issue 26, docs/design.md §2): a matrix whose Sign-Muon momentum is exactly
zero on a replica votes on none of its entries, and where every replica abstains it does not move,
in every vote format. sign(0) = +1 would otherwise move each of its entries by lr.

Checked on the vote formats themselves (every replica's signs and silence flags gathered by the
test, the majority formed here) at 2, 3 and 4 replicas, and through SignMuon on an MoE expert stack
with one expert that gets no tokens, on one process and on 2 replicas.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import reference
import shardopt
from shardopt.wire.comm import Axis
from shardopt.optim.schedule import complete
from shardopt.wire.vote import FORMATS, VOTE_FORMATS, vote_bytes

TIMEOUT_S = 120.0
EXPERTS, ROWS, COLS = 4, 12, 8
IDLE = 2           # the expert that receives no tokens
STEPS = 4


# ---- the vote formats ---------------------------------------------------------------------------
def _silent_vote(fmt, matrices, entries, seed):
    """Random signs and a random silence pattern per replica (replica r silent on matrix j when
    (r + j) % 3 == 0, and every replica on the last matrix): the format's V, the inputs, the bytes."""
    rank = dist.get_rank()
    n = matrices * entries
    positive = torch.rand(n, generator=torch.Generator().manual_seed(100 + rank)) > 0.5
    silent = torch.tensor([(rank + j) % 3 == 0 or j == matrices - 1 for j in range(matrices)])
    axis = Axis("replicate", dist.group.WORLD)
    V = complete(FORMATS[fmt].exchange(positive, axis, seed, silent=silent))
    return {"V": V, "positive": positive, "silent": silent, "bytes_sent": axis.stats()["bytes_sent"]}


@pytest.mark.parametrize("fmt", VOTE_FORMATS)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_silent_matrices_leave_the_vote_to_the_others_in_every_format(pools, world_size, fmt):
    """V = sign(Σ over the replicas voting on the matrix), a tie among them broken by the shared coin
    (1-bit) or 0 (int8), 0 where nobody votes; bytes = vote_bytes(fmt, n, M, k) = the table plus the
    1-bit formats' (M−1)·⌈k/8⌉ flag bytes. 5 matrices of 13 entries: n = 65 is padded."""
    matrices, entries, seed = 5, 13, 77
    results = pools(world_size).run(_silent_vote, fmt, matrices, entries, seed, timeout_s=TIMEOUT_S)
    n = matrices * entries
    signs = torch.stack([torch.where(r["positive"], 1, -1) for r in results])                       # (M, n)
    voting = torch.stack([~r["silent"] for r in results]).repeat_interleave(entries, dim=1)          # (M, n)
    total, voters = (signs * voting).sum(0), voting.sum(0)
    expected = torch.sign(total)
    tie = (total == 0) & (voters > 0)
    if fmt != "allreduce_int8":
        expected = torch.where(tie, reference.coins(seed, n), expected)
    assert tie.any()                    # the tie rule among fewer voters was exercised
    assert (voters == 0).any() and (expected[voters == 0] == 0).all()
    for result in results:
        assert torch.equal(result["V"].long(), expected)
        assert result["bytes_sent"] == vote_bytes(fmt, n, world_size, matrices)
    flags = 0 if fmt == "allreduce_int8" else (world_size - 1) * 1     # ⌈5/8⌉ = 1 byte per other replica
    assert vote_bytes(fmt, n, world_size, matrices) == vote_bytes(fmt, n, world_size) + flags


# ---- through SignMuon: an MoE expert with no tokens -------------------------------------------------
class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        self.experts = nn.Parameter(torch.randn(EXPERTS, ROWS, COLS, generator=generator))
        self.router = nn.Parameter(torch.randn(EXPERTS, COLS, generator=generator))


def _expert_gradients(replica, step, idle_everywhere):
    generator = torch.Generator().manual_seed(1000 * replica + step)
    experts = torch.randn(EXPERTS, ROWS, COLS, generator=generator)
    if idle_everywhere or replica == 0:
        experts[IDLE] = 0
    return experts, torch.randn(EXPERTS, COLS, generator=generator)


def _experts_run(vote, weight_decay, idle_everywhere=True, as_replica=0):
    """STEPS SignMuon steps on 2 replicas, or on one process fed replica `as_replica`'s gradients;
    expert IDLE gets zero gradients on every replica (idle_everywhere) or on replica 0 only."""
    replicated = dist.is_initialized()
    rank = dist.get_rank() if replicated else as_replica
    model = Experts()
    start = model.experts.detach().clone()
    opt = shardopt.SignMuon(model.parameters(), lr=0.05, weight_decay=weight_decay, vote=vote,
                            replicate_mesh=dist.group.WORLD if replicated else None)
    for step in range(STEPS):
        model.experts.grad, model.router.grad = _expert_gradients(rank, step, idle_everywhere)
        opt.step()
    decayed = start[IDLE].clone()
    for _ in range(STEPS):
        decayed.mul_(1 - 0.05 * weight_decay)          # the optimizer's own decoupled decay, op for op
    return {"experts": model.experts.detach().clone(), "start": start, "decayed": decayed,
            "momentum": opt.state[model.experts]["momentum"].clone(),
            "bytes_sent": opt.comm_stats()["replicate"]["bytes_sent"] if replicated else 0,
            "consistent": opt.replicas_consistent()}


def _check_idle_expert(result, weight_decay):
    experts, start = result["experts"], result["start"]
    assert torch.equal(result["momentum"][IDLE], torch.zeros(ROWS, COLS))
    if weight_decay == 0:
        assert torch.equal(experts[IDLE], start[IDLE])            # bitwise unchanged
    else:
        assert torch.equal(experts[IDLE], result["decayed"])      # decays as torch.optim's decoupled decay does, no more
    busy = [e for e in range(EXPERTS) if e != IDLE]
    assert all(not torch.equal(experts[e], start[e]) for e in busy)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_expert_with_zero_momentum_does_not_move_on_one_process(weight_decay):
    _check_idle_expert(_experts_run("auto", weight_decay), weight_decay)


@pytest.mark.parametrize("vote", VOTE_FORMATS)
def test_expert_with_zero_momentum_stays_bitwise_unchanged_on_2_replicas(pools, vote):
    """Every format; the replicas stay identical; bytes per step do not depend on who abstains (the
    flags have a fixed size), = vote_bytes with one flag per matrix block."""
    results = pools(2).run(_experts_run, vote, 0.0, timeout_s=TIMEOUT_S)
    busy = pools(2).run(_experts_run, vote, 0.0, False, timeout_s=TIMEOUT_S)
    for result in results:
        _check_idle_expert(result, 0.0)
        assert result["consistent"]
    assert torch.equal(results[0]["experts"], results[1]["experts"])
    assert results[0]["bytes_sent"] == busy[0]["bytes_sent"]


@pytest.mark.parametrize("vote", VOTE_FORMATS)
def test_expert_idle_on_one_replica_follows_the_other_replica(pools, vote):
    """Replica 0 abstains on expert IDLE; replica 1 alone decides it: that expert moves bitwise as it
    does on one process that sees replica 1's gradients only (V = replica 1's own sign: no tie coin
    with one voter)."""
    results = pools(2).run(_experts_run, vote, 0.0, False, timeout_s=TIMEOUT_S)
    alone = _experts_run(vote, 0.0, False, as_replica=1)
    assert torch.equal(results[0]["experts"], results[1]["experts"])
    assert torch.equal(results[0]["experts"][IDLE], alone["experts"][IDLE])
    assert not torch.equal(results[0]["experts"][IDLE], results[0]["start"][IDLE])


def test_split_block_with_zero_gradient_does_not_move():
    """A fused QKV param with split=(0, sizes): the block whose gradient is zero keeps its values, the
    other blocks move."""
    qkv = nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(2)))
    start = qkv.detach().clone()
    opt = shardopt.SignMuon([{"params": [qkv], "split": (0, (8, 4, 4))}], lr=0.05, weight_decay=0.0)
    for step in range(3):
        grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        grad[8:12] = 0
        qkv.grad = grad
        opt.step()
    assert torch.equal(qkv[8:12], start[8:12])
    assert not torch.equal(qkv[:8], start[:8]) and not torch.equal(qkv[12:], start[12:])
