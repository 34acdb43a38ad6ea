"""Checkpoints of integrations/fsdp/train.py: DCP (torch.distributed.checkpoint) of the model, the
optimizer and the lr scheduler in <out-dir>/checkpoints/step_NNNNNN/. DCP reshards on load, so a
checkpoint resumes on another --replicate × --shard."""

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save(directory: Path, step: int, model, opt, scheduler) -> None:
    """Every rank writes its shards of step `step`; the replicas' momenta are first made one
    (opt.synchronize_for_checkpoint), and the checkpoint's traffic is not counted as a step's."""
    opt.synchronize_for_checkpoint()
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()},
             checkpoint_id=directory / f"step_{step:06d}")
    opt.reset_comm_stats()


def latest(directory: Path) -> tuple[int, Path] | None:
    """(step, path) of the latest complete checkpoint in `directory` (one with DCP's .metadata), or None."""
    done = [path for path in directory.glob("step_*") if (path / ".metadata").exists()]
    return max(((int(path.name[5:]), path) for path in done), default=None)


def load(path: Path, model, opt, scheduler) -> None:
    """Model, optimizer state (initialized first, as DCP loads in place) and scheduler from `path`."""
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=optim_state)
    scheduler.load_state_dict(state["scheduler"])
    opt.reset_comm_stats()
