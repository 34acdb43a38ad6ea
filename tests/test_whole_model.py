"""Whole-model compression (docs/design.md §3): with Lion's 1-bit vote for the embeddings, head and norms,
nothing crosses the replicate axis at full precision.

An LM whose 8192×256 embedding and untied 256×8192 head are 2/3 of its parameters, four 256↔1024
MLP blocks, 2 replicas (gloo processes), each on its own tokens of a learnable next-token map:
- Sign-Muon + Lion-vote sends ≤ 1/25 of a float32 all-reduce of every parameter per step, Dion 1/4
  (bf16 wire) + Lion-vote ≤ 1/10; the counted bytes equal `shardopt.optim.traffic`'s formula;
- the replicas' weights stay bit-identical and the loss goes down.
"""

import pytest
import torch
import torch._dynamo  # noqa: F401  imported once before the pool forks (torch.optim loads it on first use)
import torch.distributed as dist
from torch import nn

import reference
import shardopt
from shardopt.optim import traffic
from workers import WorkerPool

VOCAB, WIDTH, HIDDEN, BLOCKS, STEPS = 8192, 256, 1024, 4, 12


class MLPLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, HIDDEN, bias=False), nn.GELU(),
                                                  nn.Linear(HIDDEN, WIDTH, bias=False)) for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embedding(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


@pytest.fixture(scope="module")
def pool():
    made = WorkerPool(2)
    yield made
    made.close()


def _train(matrix_algorithm):
    torch.manual_seed(0)
    model = MLPLM()
    groups = shardopt.param_groups(model, matrix_algorithm, "lion", nonmatrix_options={"lr": 3e-3})
    if matrix_algorithm == "dion":
        opt = shardopt.Dion(groups, lr=0.05, rank_fraction=0.25, wire_dtype=torch.bfloat16,
                            replicate_mesh=dist.group.WORLD)
    else:
        opt = shardopt.SignMuon(groups, lr=0.01, replicate_mesh=dist.group.WORLD)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())   # each replica its own tokens
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB // 8, (64,), generator=generator)   # a learnable map on 1,024 tokens
        loss = nn.functional.cross_entropy(model(tokens), (7 * tokens + 3) % VOCAB)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    numel = sum(p.numel() for p in model.parameters())
    formula = sum(opt.replicate_bytes_per_step()) + traffic.nonfinite_check_bytes(2)
    checks = reference.double_averaging_checks(STEPS) * traffic.double_averaging_check_bytes(2)   # step 1's
    return {"bytes_per_step": (opt.comm_stats()["replicate"]["bytes_sent"] - checks) / STEPS, "formula": formula,
            "fp32_allreduce": traffic.allreduce_bytes(numel, torch.float32, 2), "losses": losses,
            "consistent": opt.replicas_consistent(), "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "non_matrix_share": sum(p.numel() for g in groups if g["algorithm"] == "lion" for p in g["params"]) / numel}


@pytest.mark.parametrize("matrix_algorithm, bound", [("signmuon", 1 / 25), ("dion", 1 / 10)])
def test_lion_vote_compresses_the_whole_model_and_replicas_stay_identical(pool, matrix_algorithm, bound):
    results = pool.run(_train, matrix_algorithm, timeout_s=300)
    first = results[0]
    assert first["non_matrix_share"] > 0.6                       # the embedding and head dominate
    assert first["bytes_per_step"] == first["formula"]           # counted = traffic.py's formula
    assert first["bytes_per_step"] <= bound * first["fp32_allreduce"], first["bytes_per_step"] / first["fp32_allreduce"]
    assert all(r["consistent"] for r in results)
    assert torch.equal(results[0]["params"], results[1]["params"])
    for result in results:
        losses = result["losses"]
        assert sum(losses[-3:]) / 3 < 0.9 * losses[0], losses
