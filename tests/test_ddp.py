"""shardopt.ddp.keep_local_gradients: a DDP model whose all-reduce is off keeps each rank's own gradient
(docs/design.md §5), on 2 gloo processes."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shardopt.ddp import keep_local_gradients


def _gradients_stay_local():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    plain = torch.nn.Linear(4, 3)
    plain.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model)
    keep_local_gradients(ddp)
    keep_local_gradients(ddp)   # a second call does nothing
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    ddp(x).square().sum().backward()
    plain(x).square().sum().backward()
    return all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()))


def test_ddp_gradients_stay_local(pool2):
    assert pool2.run(_gradients_stay_local) == [True, True]


def test_a_model_that_is_not_ddp_is_refused():
    with pytest.raises(TypeError, match="takes a torch.nn.parallel.DistributedDataParallel, got Linear"):
        keep_local_gradients(torch.nn.Linear(2, 2))
