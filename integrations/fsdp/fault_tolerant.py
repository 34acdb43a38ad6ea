"""train.py --fault-tolerant: this torchrun world is one replica group of a torchft job
(docs/design.md §13). FSDP2 shards over the group's own ranks; the replicate axis is a torchft Manager
across groups, reconfigured at every round's quorum; a group that dies is restarted (launch/torchft_local.sh,
launch/slurm/torchft.sbatch) and heals from a live one.

    torchft_lighthouse --min_replicas 2 --join_timeout_ms 10000 --bind [::]:29510 &
    torchrun --nproc_per_node 1 --master_port 29600 integrations/fsdp/train.py --fault-tolerant \\
        --replica-id 0 --lighthouse http://localhost:29510 --min-replicas 2 --replica-groups 3 --local-steps 10

A round is a local-steps sync (--local-steps H), or every step of the per-step optimizers (Dion, Sign-Muon, and
the baselines). The loop's steps follow the optimizer's committed step count (`Steps`): a per-step round that is
not committed (a group died in it, or one heals) is rolled back everywhere (shardopt/torchft/steps.py), and the
same step runs again with the lr schedule put back, so every group stays on one schedule and a restarted group
finishes the same --steps.
"""

import datetime
import os


def add_arguments(parser) -> None:
    group = parser.add_argument_group("fault tolerance (torchft)")
    group.add_argument("--fault-tolerant", action="store_true", help="this torchrun world is one replica group; "
                       "the replicate axis is a torchft Manager across groups (pip install -e '.[torchft]')")
    group.add_argument("--replica-id", type=int, default=0, help="this group's id (stable across its restarts)")
    group.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"), help="the torchft lighthouse URL")
    group.add_argument("--min-replicas", type=int, default=1, help="groups a round needs to commit")
    group.add_argument("--replica-groups", type=int, default=None, help="groups of the job (a fresh start waits "
                       "for all of them; --min-replicas must not exceed it)")
    group.add_argument("--quorum-timeout", type=float, default=600.0, help="seconds a round waits for its quorum")


def check(args, parser) -> None:
    if not args.fault_tolerant:
        return
    import shardopt.torchft
    try:
        shardopt.torchft.check_min_replicas(args.min_replicas, args.replica_groups)
    except ValueError as error:
        parser.error(str(error))
    if not args.lighthouse:
        parser.error("--fault-tolerant needs --lighthouse URL (or TORCHFT_LIGHTHOUSE): start one with "
                     "torchft_lighthouse --min_replicas N --bind [::]:PORT")
    if args.resume or args.outer_overlap or args.fragments != 1 or args.overlap_backward == "on":
        parser.error("--fault-tolerant heals a restarted group from a live one: drop --resume, --outer-overlap, "
                     "--fragments and --overlap-backward")
    args.replicate, args.check_replicas_every = 1, 0   # the torchrun world is one replica; the manager spans groups


def manager(args):
    """The group's torchft Manager: gloo process group across groups with the collective timeout
    --timeout, synchronous quorum (a joiner heals before the round's exchange)."""
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    timeout = datetime.timedelta(seconds=args.timeout)
    return Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                   min_replica_size=args.min_replicas, use_async_quorum=False, init_sync=True, timeout=timeout,
                   quorum_timeout=datetime.timedelta(seconds=args.quorum_timeout), connect_timeout=timeout,
                   rank=dist.get_rank(), world_size=dist.get_world_size(), replica_id=f"replica_{args.replica_id}",
                   lighthouse_addr=args.lighthouse)


def join(opt, scheduler, args, log) -> int:
    """Meet the other groups (heal from one if they are ahead); returns the step to continue after."""
    import shardopt.torchft
    shardopt.torchft.join(opt, replica_groups=args.replica_groups)
    step = committed_steps(opt)
    healing = opt.replicate.healing
    if healing.heals:
        log(f"torchft: healed from a live group at step {step}: {healing.received_bytes:,} B received")
    follow_schedule(scheduler, step)
    return step


def committed_steps(opt) -> int:
    """The optimizer's committed step count: LocalSteps' `steps`; a per-step optimizer's state "step" (rolled
    back with a discarded round, copied when healing)."""
    if hasattr(opt, "steps"):
        return opt.steps
    return int(max((float(state["step"]) for state in opt.state.values() if "step" in state), default=0))


def follow_schedule(scheduler, step: int) -> None:
    """Put the lr schedule at `step` steps taken (the next step runs at lr_multiplier(step + 1))."""
    if scheduler.last_epoch != step:
        scheduler.last_epoch = step - 1
        scheduler.step()


class Steps:
    """The loop's steps first + 1 … last under --fault-tolerant: after each, the next is the committed count + 1
    (module docstring). `kept(step)`: whether `step` was committed (else the loop takes it again)."""

    def __init__(self, opt, scheduler, first: int, last: int):
        self.opt, self.scheduler, self.first, self.last = opt, scheduler, first, last
        self.repeated = 0   # steps run again (a round not committed, or a heal that moved the count)

    def __iter__(self):
        step = self.first
        while step < self.last:
            yield step + 1
            committed = committed_steps(self.opt)
            if committed != step + 1:
                self.repeated += 1
                follow_schedule(self.scheduler, committed)
            step = committed

    def kept(self, step: int) -> bool:
        return committed_steps(self.opt) == step


def summary(opt, steps: Steps) -> dict:
    """For summary.json: the rounds (replicas, committed, bytes, seconds), heals and the steps run again."""
    import shardopt.torchft
    return {**shardopt.torchft.summary(opt), "steps_repeated": steps.repeated, "rounds": opt.replicate.rounds}
