"""Soak (marked slow, CI runs it in its own step): 2,000 steps on 4 processes, replicas
bit-identical throughout, checked every 100 steps."""

import pytest
import torch
import torch.distributed as dist

import shardopt
from workers import WorkerPool

pytestmark = pytest.mark.slow


def _soak(algorithm, steps, check_every):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.LayerNorm(24),
                                torch.nn.Linear(24, 10))
    fully_shard(model, mesh=mesh["shard"])
    groups = shardopt.param_groups(model, algorithm, nonmatrix_options={"lr": 3e-3})
    if algorithm == "dion":
        opt = shardopt.Dion(groups, lr=0.02, rank_fraction=0.25, replicate_mesh=mesh["replicate"])
    else:
        opt = shardopt.SignMuon(groups, lr=3e-3, vote="alltoall_1bit", replicate_mesh=mesh["replicate"])
    generator = torch.Generator().manual_seed(dist.get_rank())
    target = torch.randn(16, 10, generator=torch.Generator().manual_seed(99))
    checks, losses = 0, []
    for step in range(1, steps + 1):
        x = torch.randn(32, 16, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), x @ target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % check_every == 0:
            if not opt.replicas_consistent():
                return {"diverged_at": step}
            checks += 1
            losses.append(loss.item())
    return {"diverged_at": None, "checks": checks, "first_loss": losses[0], "last_loss": losses[-1]}


@pytest.mark.parametrize("algorithm", ["dion", "signmuon"])
def test_soak_2000_steps_replicas_bit_identical(algorithm):
    pool = WorkerPool(4)
    try:
        results = pool.run(_soak, algorithm, 2000, 100, timeout_s=900)
    finally:
        pool.close()
    for result in results:
        assert result["diverged_at"] is None, result
        assert result["checks"] == 20
        assert result["last_loss"] < result["first_loss"]
