import pytest
import torch
import torch.distributed as dist

from workers import WorkerPool


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(3)
    yield p
    p.close()


def _rank_sum():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom")
    return 1


def test_pool_runs_collectives_and_reports_errors(pool):
    assert pool.run(_rank_sum) == [3.0, 3.0, 3.0]
    with pytest.raises(RuntimeError, match="boom"):
        pool.run(_fail_on_rank_one)
    assert pool.run(_rank_sum) == [3.0, 3.0, 3.0]
