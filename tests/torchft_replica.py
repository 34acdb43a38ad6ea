"""One replica group of the torchft tests (tests/test_torchft.py): a small MLP trained by LocalSteps (or a
per-step Sign-Muon / Dion) over a torchft Manager; each rank of the group is a process started with
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. Writes one JSON line per round to --out: the optimizer's
step count, whether the round committed, its replica count M, and a hash of this rank's params."""

import argparse
import datetime
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shardopt  # noqa: E402
import shardopt.torchft  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--mode", default="localsteps", choices=["localsteps", "signmuon", "dion"])
    p.add_argument("--exchange", default="sign_mean")
    p.add_argument("--min-replicas", type=int, default=2)
    p.add_argument("--kill-at-step", type=int, default=-1)
    p.add_argument("--kill-in-round", type=int, default=-1, help="SIGKILL at this round's 2nd collective")
    p.add_argument("--error-in-round", type=int, default=-1, help="report an error inside this round's exchange")
    p.add_argument("--stall-at-step", type=int, default=-1, help="sleep --stall-seconds at this step (a straggler)")
    p.add_argument("--stall-seconds", type=float, default=8.0)
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--groups", type=int, default=None, help="replica groups a fresh start waits for")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--join-timeout", type=float, default=600.0, help="shardopt.torchft.join's timeout_s")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (a restart must meet a sync)")
    p.add_argument("--sync-now", action="store_true", help="LocalSteps.sync_now after the last step, twice")
    p.add_argument("--out", required=True)
    return p.parse_args()


def model_and_params(fsdp: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model


def build(args, model, manager):
    params = list(model.parameters())
    if args.mode == "localsteps":
        inner = torch.optim.AdamW(params, lr=1e-2)
        return shardopt.LocalSteps(inner, replicate_mesh=manager, sync_every=args.sync_every, exchange=args.exchange,
                                   block=64)
    cls = shardopt.SignMuon if args.mode == "signmuon" else shardopt.Dion
    groups = [{"params": [p for p in params if p.ndim == 2]},
              {"params": [p for p in params if p.ndim != 2], "algorithm": "lion"}]
    return cls(groups, lr=1e-2, replicate_mesh=manager) if args.mode == "dion" else \
        cls(groups, lr=1e-2, momentum=0.9, replicate_mesh=manager)


def param_hash(model) -> str:
    from shardopt.layout.placement import local
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(local(p).detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def main():
    if os.environ.get("FT_LOG"):
        import logging
        logging.basicConfig(level=logging.INFO)
    args = parse()
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    from torchft import Manager, ProcessGroupGloo
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=args.min_replicas, use_async_quorum=False, timeout=timeout,
                      quorum_timeout=datetime.timedelta(seconds=60), connect_timeout=timeout,
                      rank=dist.get_rank(), world_size=dist.get_world_size(), replica_id=f"replica_{args.replica_id}",
                      lighthouse_addr=args.lighthouse, init_sync=True)
    model = model_and_params(args.fsdp)
    opt = build(args, model, manager)
    axis = opt.replicate
    rounds = 0

    def hook(axis_, call):
        if rounds == args.kill_in_round and call == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if rounds == args.error_in_round and call == 2:
            manager.report_error(RuntimeError("injected by the test"))
    axis.fail_hook = hook
    shardopt.torchft.join(opt, replica_groups=args.groups, timeout_s=args.join_timeout)
    out = open(args.out, "a")
    steps = opt.steps if args.mode == "localsteps" else None
    step = steps if steps is not None else 0
    while step < args.steps:
        generator = torch.Generator().manual_seed(1000 * args.replica_id + step)
        x = torch.randn(32, 16, generator=generator)
        loss = (model(x) - x[:, :8].sin()).pow(2).mean()
        loss.backward()
        short = args.groups and axis.rounds and axis.rounds[-1]["replicas"] < args.groups
        time.sleep(0.5 if short else args.step_sleep)   # slower while a group is missing: the restart can meet us
        if step == args.stall_at_step:
            time.sleep(args.stall_seconds)
        if step == args.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        rounds_before = len(axis.rounds)
        opt.step()
        opt.zero_grad()
        step = opt.steps if args.mode == "localsteps" else step + 1
        if len(axis.rounds) > rounds_before:
            rounds += 1
            entry = axis.rounds[-1]
            if args.mode != "localsteps":
                step = int(max((float(s["step"]) for s in opt.state.values() if "step" in s), default=step))
            out.write(json.dumps({"replica": args.replica_id, "rank": dist.get_rank(), "step": step,
                                  "committed": entry["committed"], "M": entry["replicas"],
                                  "contributors": entry["contributors"], "healed": entry["healed"],
                                  "bytes": entry["bytes_sent"], "hash": param_hash(model),
                                  "loss": float(loss.detach())}) + "\n")
            out.flush()
    if args.sync_now:   # the end of a run off the schedule: one more round; a second call finds nothing due
        before = len(axis.rounds)
        due, again = opt.sync_now(), opt.sync_now()
        out.write(json.dumps({"replica": args.replica_id, "rank": dist.get_rank(), "final": True, "due": due,
                              "again": again, "hash": param_hash(model), "rounds": len(axis.rounds) - before,
                              "committed": axis.rounds[-1]["committed"]}) + "\n")
    summary = shardopt.torchft.summary(opt)
    out.write(json.dumps({"replica": args.replica_id, "rank": dist.get_rank(), "done": True, **{
        k: (v if not isinstance(v, dict) else {str(a): b for a, b in v.items()}) for k, v in summary.items()}}) + "\n")
    out.close()
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
