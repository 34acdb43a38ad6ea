"""Checkpoints of integrations/fsdp/train.py: DCP (torch.distributed.checkpoint) of the model, the
optimizer and the lr scheduler in <out-dir>/checkpoints/step_NNNNNN/. DCP reshards on load, so a
checkpoint resumes on another --replicate × --shard.

With local steps (shardopt.LocalSteps) every replica's weights, inner optimizer state and error
feedback are its own (DCP would keep one copy of what looks replicated), so each replica writes its
own checkpoint, step_NNNNNN/replica_R/, through the process group of its ranks (`replica`): a
kill-and-resume is then bit-exact at any step, on the same --replicate (--shard may change; another
--replicate is refused, naming the fix). --checkpoint-momenta own does the same for Dion / Sign-Muon's
decoupled momenta: nothing crosses the replicas and the training goes on unchanged."""

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def step_path(directory: Path, step: int, replica: tuple | None = None) -> Path:
    """step_NNNNNN, or its replica_R folder when `replica` = (R, its process group) is given."""
    path = directory / f"step_{step:06d}"
    return path / f"replica_{replica[0]}" if replica else path


def save(directory: Path, step: int, model, opt, scheduler, replica: tuple | None = None,
         momenta: str = "mean") -> int:
    """Every rank writes its shards of step `step`; the replicas' momenta are first made one through
    opt.synchronize_for_checkpoint(momenta) ("mean": the exact fp32 mean, with which a resume on another mesh
    follows the mean gradient; "sign_vote", "sign_mean": a 1-bit agreement); with `replica`, each replica
    writes its own instead. Returns the replicate-axis bytes this rank sent for it (comm_stats, reset first:
    what the loop sent since the step, e.g. its replicas check, is not the checkpoint's), not counted as a step's."""
    opt.reset_comm_stats()
    if replica is None:
        opt.synchronize_for_checkpoint(momenta)
    sent = opt.comm_stats()["replicate"]["bytes_sent"]
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()},
             checkpoint_id=step_path(directory, step, replica), process_group=replica[1] if replica else None)
    opt.reset_comm_stats()
    return sent


def latest(directory: Path, replica: tuple | None = None, replicas: int | None = None) -> tuple[int, Path] | None:
    """(step, path) of the latest complete checkpoint in `directory` (one with DCP's .metadata; this
    replica's, with `replica`), or None. With `replicas` (resuming): SystemExit, naming the fix, where the
    latest step was saved per replica by another number of replicas, or the other way round (a per-replica
    checkpoint does not reshard over the replicas)."""
    steps = sorted(directory.glob("step_*"))
    saved = len(list(steps[-1].glob("replica_*"))) if steps else 0
    if replicas is not None and steps and saved != (replicas if replica else 0):
        raise SystemExit(f"{steps[-1]} holds {f'{saved} per-replica checkpoints' if saved else 'one checkpoint of all replicas'}"
                         f"; this run {f'saves one per replica for {replicas} replicas' if replica else 'saves one for all replicas'}"
                         f": resume with the saving run's --replicate and --checkpoint-momenta (or --local-steps), or "
                         f"use another --out-dir")
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
