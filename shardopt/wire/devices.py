"""Which device a rank's own small collectives use, and the errors that name the fix when it is wrong.

The construction-time agreement (`Axis.agree`) and the private groups (`Axis.private`) exchange a
few integers. On a NCCL group those must be CUDA tensors, and on the GPU this rank's parameters are
on: `torch.cuda.current_device()` is cuda:0 on every rank of a script that never calls
`torch.cuda.set_device`, which puts two ranks of a node on one GPU (NCCL then fails, or waits) even
when the model itself went to `cuda:{local_rank}`. So the device comes from the params; and the
agreement also exchanges (host, GPU index) per rank, so that two ranks of one host on one GPU, which
NCCL cannot serve, get an error that names `torch.cuda.set_device` instead of a failed agreement.
"""

from __future__ import annotations

import socket
import zlib

import torch

SET_DEVICE = ("give each rank its own GPU before building the model: torch.cuda.set_device(local_rank) "
              "(local_rank = int(os.environ['LOCAL_RANK']) under torchrun), then model.to('cuda')")


def collective_device(backend: str, device: torch.device | None, axis: str) -> torch.device:
    """Where a rank's small collectives on a group with `backend` (its `dist.get_backend` string) put
    their tensors: on a NCCL group the rank's params' `device` (CUDA); a CPU backend's groups (gloo,
    or "cpu:gloo,cuda:nccl" for CPU params) the CPU. NCCL moves CUDA tensors only: other params on a
    NCCL-only group raise ValueError naming torch.cuda.set_device."""
    if "nccl" not in backend:
        return torch.device("cpu")
    if device is not None and device.type == "cuda":
        return device
    if "cpu:" in backend:
        return torch.device("cpu")
    raise ValueError(f"shardopt: the {axis} axis is a NCCL process group, but this rank's parameters are on "
                     f"{device}; NCCL moves CUDA tensors only: {SET_DEVICE}")


def host_device_key(device: torch.device | None) -> list[int]:
    """[hash of this host's name, CUDA index of `device` or −1]: what `check_distinct_devices` compares."""
    index = device.index if device is not None and device.type == "cuda" and device.index is not None else -1
    return [zlib.crc32(socket.gethostname().encode()), index]


def check_distinct_devices(keys: list[list[int]], axis: str) -> None:
    """ValueError when two ranks of `axis` are on one host and one GPU (keys: per axis rank, in order,
    its `host_device_key`): NCCL serves one rank per GPU."""
    first = {}
    for rank, (host, index) in enumerate(keys):
        if index >= 0 and (host, index) in first:
            raise ValueError(f"shardopt: ranks {first[host, index]} and {rank} of the {axis} axis are on the same "
                             f"host and the same GPU, cuda:{index} (a script that never calls torch.cuda.set_device "
                             f"puts every rank on cuda:0); NCCL needs one GPU per rank: {SET_DEVICE}")
        first.setdefault((host, index), rank)


def agreement_failure(axis: str, timeout_s: float, error: Exception, backend: str, device: torch.device | None,
                      local_rank: str | None) -> str:
    """The message when the construction-time agreement fails or times out: what every rank must
    pass alike, and on NCCL the other cause, two ranks on one GPU (`device`: this rank's params';
    `local_rank`: the LOCAL_RANK environment variable, if set)."""
    message = (f"shardopt: ranks of the {axis} axis failed or timed out ({timeout_s:g} s) in the optimizer's "
               f"construction-time agreement check; every rank must construct the optimizer with the same "
               f"parameters ({error})")
    if "nccl" not in backend:
        return message
    where = f"this rank's parameters are on {device}" + (f", LOCAL_RANK={local_rank}" if local_rank is not None else "")
    return (f"{message}. On NCCL it also fails when two ranks of a node share a GPU ({where}; a script that "
            f"never calls torch.cuda.set_device puts every rank on cuda:0): {SET_DEVICE}")
