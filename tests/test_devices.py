"""Which device a rank's own small collectives use (issue 43 item 3), pinned on the CPU.

The construction-time agreement and the private groups of overlap_backward exchange a few integers.
On NCCL they go to the rank's params' GPU, not `torch.cuda.current_device()` (cuda:0 on every rank of
a script that never calls `torch.cuda.set_device`), and two ranks of one host on one GPU, or params
off the GPU, raise an error that names `torch.cuda.set_device` instead of a failed agreement. The
deciding functions (shardopt/wire/devices.py) are tested as functions; `Axis.agree` and `Axis.private`
on gloo workers, with the backend's name patched to NCCL's where the check applies only there.
"""

import pytest
import torch
import torch.distributed as dist

from shardopt.wire import comm
from shardopt.wire.devices import agreement_failure, check_distinct_devices, collective_device, host_device_key

CUDA = [torch.device("cuda", index) for index in range(4)]
CPU = torch.device("cpu")


@pytest.mark.parametrize("backend, device, expected", [
    ("nccl", CUDA[3], CUDA[3]),                       # the params' GPU, whatever the current device
    ("cpu:gloo,cuda:nccl", CUDA[1], CUDA[1]),
    ("cpu:gloo,cuda:nccl", CPU, CPU),                 # CPU params on a group with a CPU backend
    ("gloo", CUDA[1], CPU),
    ("gloo", None, CPU),
    ("fake", CPU, CPU),
])
def test_collective_device_is_the_params_gpu_on_nccl_and_the_cpu_elsewhere(backend, device, expected):
    assert collective_device(backend, device, "replicate") == expected


@pytest.mark.parametrize("device", [CPU, torch.device("meta"), None])
def test_params_off_the_gpu_on_a_nccl_group_raise_naming_set_device(device):
    with pytest.raises(ValueError, match=r"replicate axis is a NCCL process group, but this rank's parameters are "
                                         rf"on {device}.*torch\.cuda\.set_device\(local_rank\)"):
        collective_device("nccl", device, "replicate")


def test_two_ranks_of_one_host_on_one_gpu_raise_naming_set_device():
    with pytest.raises(ValueError, match=r"ranks 0 and 2 of the shard axis are on the same host and the same GPU, "
                                         r"cuda:0 .*torch\.cuda\.set_device\(local_rank\)"):
        check_distinct_devices([[7, 0], [7, 1], [7, 0]], "shard")
    check_distinct_devices([[7, 0], [8, 0], [7, 1]], "shard")      # other hosts may use the same index
    check_distinct_devices([[7, -1], [7, -1]], "shard")             # CPU ranks share no GPU
    host, index = host_device_key(CUDA[2])
    assert index == 2 and host == host_device_key(CPU)[0] and host_device_key(CPU)[1] == -1


def test_a_failed_agreement_on_nccl_also_names_set_device_and_this_ranks_device():
    error = RuntimeError("NCCL error: invalid usage, Duplicate GPU detected")
    nccl = agreement_failure("replicate", 300, error, "nccl", CUDA[0], "1")
    assert "same parameters" in nccl and "Duplicate GPU detected" in nccl
    assert "this rank's parameters are on cuda:0, LOCAL_RANK=1" in nccl and "torch.cuda.set_device(local_rank)" in nccl
    gloo = agreement_failure("replicate", 300, error, "gloo", CPU, None)
    assert "same parameters" in gloo and "set_device" not in gloo


def _agree(index_of_rank, backend):
    """Axis.agree over the world with this rank's params 'on' cuda:index_of_rank[rank]; the group's backend
    name reads `backend` (the tensors stay on the CPU: gloo moves them). Returns the rows, or the error."""
    axis = comm.Axis("replicate", dist.group.WORLD)
    device = torch.device("cuda", index_of_rank[dist.get_rank()])
    real = comm.collective_device
    comm.dist.get_backend, get_backend = (lambda group=None: backend), comm.dist.get_backend
    comm.collective_device = lambda backend, device, axis: torch.device("cpu")
    try:
        return axis.agree([10 + dist.get_rank(), 5], 30, device), axis.device
    except ValueError as error:
        return str(error), None
    finally:
        comm.dist.get_backend, comm.collective_device = get_backend, real


def test_agree_exchanges_each_ranks_gpu_and_refuses_two_ranks_on_one(pool2):
    for rows, device in pool2.run(_agree, [0, 1], "cpu:gloo,cuda:nccl"):
        assert rows == [[10, 5], [11, 5]] and device.type == "cuda"
    for error, _ in pool2.run(_agree, [0, 0], "cpu:gloo,cuda:nccl"):
        assert "ranks 0 and 1 of the replicate axis are on the same host and the same GPU, cuda:0" in error
        assert "torch.cuda.set_device(local_rank)" in error
    for rows, _ in pool2.run(_agree, [0, 0], "gloo"):          # gloo serves two ranks on one GPU
        assert rows == [[10, 5], [11, 5]]


def _private_groups():
    """An axis over the world's odd and even ranks, agreed on the CPU, then its private copy's groups."""
    rank = dist.get_rank()
    pairs, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    axis = comm.Axis("replicate", pairs)
    axis.agree([1], 30, torch.device("cpu"))
    private = axis.private()
    return sorted(axis._world_groups()), dist.get_process_group_ranks(private.group), private.rank == axis.rank, rank


def test_private_learns_every_ranks_group_on_the_params_device(pool4):
    for groups, ranks, same_rank, rank in pool4.run(_private_groups):
        assert groups == [(0, 2), (0, 2), (1, 3), (1, 3)]
        assert ranks == ([0, 2] if rank % 2 == 0 else [1, 3]) and same_rank
