"""The process group and device mesh of integrations/fsdp/train.py."""

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def init_mesh(replicate: int, shard: int, tp: int, timeout_s: float) -> tuple[DeviceMesh, torch.device]:
    """The (replicate, shard, tensor) mesh over this world, on NCCL (one GPU per process: LOCAL_RANK)
    or gloo, and this rank's device. Under torchrun each attempt (torchrun --max-restarts) rendezvouses
    under its own store prefix, as an earlier attempt's keys stay in the store; without torchrun
    (plain `python train.py`) the world is this one process. A collective that waits `timeout_s` for
    another rank fails (a dead rank then stops the job instead of hanging it)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ:
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend="nccl" if cuda else "gloo", store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    else:
        dist.init_process_group(backend="nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (replicate, shard, tp), mesh_dim_names=("replicate", "shard", "tensor"))
    return mesh, device
