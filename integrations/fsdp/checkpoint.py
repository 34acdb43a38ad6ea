"""Checkpoints of integrations/fsdp/train.py: DCP (torch.distributed.checkpoint) of the model, the
optimizer and the lr scheduler in <out-dir>/checkpoints/step_NNNNNN/. DCP reshards on load, so a
checkpoint resumes on another --replicate × --shard.

With local steps (shardopt.LocalSteps) every replica's weights, inner optimizer state and error
feedback are its own (DCP would keep one copy of what looks replicated), so each replica writes its
own checkpoint, step_NNNNNN/replica_R/, through the process group of its ranks (`replica`): a
kill-and-resume is then bit-exact at any step, on the same --replicate (--shard may change)."""

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def step_path(directory: Path, step: int, replica: tuple | None = None) -> Path:
    """step_NNNNNN, or its replica_R folder when `replica` = (R, its process group) is given."""
    path = directory / f"step_{step:06d}"
    return path / f"replica_{replica[0]}" if replica else path


def save(directory: Path, step: int, model, opt, scheduler, replica: tuple | None = None) -> None:
    """Every rank writes its shards of step `step`; the replicas' momenta are first made one
    (opt.synchronize_for_checkpoint; with `replica`, each replica writes its own instead), and the
    checkpoint's traffic is not counted as a step's."""
    if replica is None:
        opt.synchronize_for_checkpoint()   # the exact fp32 mean: a resume on another mesh follows the mean gradient
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()},
             checkpoint_id=step_path(directory, step, replica), process_group=replica[1] if replica else None)
    opt.reset_comm_stats()


def latest(directory: Path, replica: tuple | None = None) -> tuple[int, Path] | None:
    """(step, path) of the latest complete checkpoint in `directory` (one with DCP's .metadata; this
    replica's, with `replica`), or None."""
    done = [path for path in directory.glob("step_*") if (step_path(path.parent, int(path.name[5:]), replica)
                                                           / ".metadata").exists()]
    return max(((int(path.name[5:]), step_path(directory, int(path.name[5:]), replica)) for path in done),
               default=None)


def load(path: Path, model, opt, scheduler, replica: tuple | None = None) -> None:
    """Model, optimizer state (initialized first, as DCP loads in place) and scheduler from `path`."""
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()}
    dcp.load(state, checkpoint_id=path, process_group=replica[1] if replica else None)
    set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=optim_state)
    scheduler.load_state_dict(state["scheduler"])
    opt.reset_comm_stats()
