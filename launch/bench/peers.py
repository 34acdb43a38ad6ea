"""What users run today, set up on any model for the benchmarks: torch DistributedDataParallel with
torch's own communication hooks and optimizers, and signSGD with majority vote.

    ddp_adamw  DDP (bucketed all-reduce overlapped with backward) + torch.optim.AdamW
    ddp_muon   DDP + torch.optim.Muon on the 2-D weights (fp32 Newton–Schulz), AdamW on the rest
    powersgd   DDP + torch's PowerSGD hook (rank --powersgd-rank, error feedback, warm start) + AdamW
    localsgd   DDP + torch's post-local-SGD hook (no gradient exchange between nodes after
               --local-start steps) + PeriodicModelAverager every --local-period steps + AdamW
    signsgd    signSGD with majority vote (Bernstein et al. 2018, Signum form): each rank's sign of
               its own momentum m ← β·m + (1−β)·g, majority vote over all ranks (1 bit per entry),
               x ← (1 − lr·wd)·x − lr·V on every parameter; no DDP gradient mean. It is shardopt's
               "lion" group with betas (β, β) (Lion's direction sign(β·m + (1−β)·g) is then the sign
               of the new momentum) on every parameter, the world as replicate axis: no polar step

The parameters are split as `shardopt.param_groups` splits them: the 2-D weights get `lr`, the rest
(embeddings and tied head, output heads, norms, biases) AdamW at `nonmatrix_lr` without decay.
Bytes: the all-reduces torch's hooks and averager issue are counted by launch/bench/counting.py,
signsgd's vote by shardopt's comm layer; `Peer.sent()` gives both per kind of group.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook, post_localSGD_hook
from torch.distributed.algorithms.model_averaging import utils as averaging
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel

import shardopt
from shardopt.optim import guard
from shardopt.wire.comm import Axis
from counting import CountingAllReduce

METHODS = ("ddp_adamw", "ddp_muon", "powersgd", "localsgd", "signsgd")
ADAMW_BETAS = dict(betas=(0.9, 0.95), eps=1e-8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The methods' own options (the same in every entry point that runs them)."""
    parser.add_argument("--weight-decay", type=float, default=0.01, help="weight decay of the 2-D weights")
    parser.add_argument("--momentum", type=float, default=0.95, help="ddp_muon: momentum; signsgd: β of the local momentum")
    parser.add_argument("--powersgd-rank", type=int, default=1, help="powersgd: matrix_approximation_rank (torch default 1)")
    parser.add_argument("--powersgd-start", type=int, default=2, help="powersgd: plain all-reduce before this step "
                        "(torch's minimum with error feedback is 2)")
    parser.add_argument("--local-period", type=int, default=8, help="localsgd: average the models every N steps")
    parser.add_argument("--local-start", type=int, default=20, help="localsgd: steps of plain DDP before local SGD")


@dataclass
class Peer:
    """One method on one rank: `net` is what the forward runs through (DDP, or the model itself for
    signsgd), `step()` is the optimizer step after backward."""
    model: nn.Module
    net: nn.Module
    optimizers: list
    counter: CountingAllReduce | None = None     # torch's hooks' and averager's bytes
    averager: PeriodicModelAverager | None = None
    shardopt_optimizer: shardopt.ShardOptimizer | None = None   # its bytes: shardopt's comm layer (signsgd's vote)

    def step(self) -> None:
        """Every optimizer's step, the periodic model average (localsgd), then the gradients cleared."""
        for optimizer in self.optimizers:
            optimizer.step()
        if self.averager is not None:
            self.averager.average_parameters(self.model.parameters())
        self.model.zero_grad(set_to_none=True)

    def synchronize(self) -> None:
        """localsgd: average the replicas now (their models differ between periodic averages; this is the
        model to test or save), through the counted path. The other methods' replicas are equal after every step."""
        if self.averager is not None:
            averaging.average_parameters(iter(self.model.parameters()), dist.group.WORLD)

    def sent(self) -> tuple[int, int]:
        """(bytes between nodes, bytes within a node) this rank sent since the last call; resets both counts."""
        between, within = 0, 0
        if self.counter is not None:
            between, within = self.counter.between_nodes, self.counter.within_node
            self.counter.reset()
        if self.shardopt_optimizer is not None:
            between += self.shardopt_optimizer.comm_stats()["replicate"]["bytes_sent"]
            self.shardopt_optimizer.reset_comm_stats()
        return between, within

    def param_groups(self) -> list[dict]:
        """Every optimizer's param groups (for the lr schedule)."""
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def close(self) -> None:
        """Drop what holds process-group work (DDP's reducer and comm-hook state, the optimizers) before the
        groups are destroyed: left to interpreter finalization, gloo's worker threads sometimes aborted the
        process after the last step ("terminate called without an active exception")."""
        self.net = self.optimizers = self.averager = self.shardopt_optimizer = None
        gc.collect()


def build(model: nn.Module, method: str, lr: float, nonmatrix_lr: float, options: argparse.Namespace,
          local_world: int, seed: int) -> Peer:
    """`method` (one of METHODS) on `model` in this process group; `options` holds add_arguments' values.
    local_world: ranks per node (a node is rank // local_world): which all-reduces count as between nodes
    and localsgd's groups of ranks that keep averaging every step."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    matrices, nonmatrix = shardopt.param_groups(model, "muon", "adamw")   # the split shardopt uses
    counter = CountingAllReduce(local_world).install()
    if method == "signsgd":
        signum = dict(algorithm="lion", betas=(options.momentum, options.momentum), lr=lr)
        voted = shardopt.ShardOptimizer([matrices | signum | {"weight_decay": options.weight_decay},
                                         nonmatrix | signum | {"weight_decay": 0.0}], {},
                                        replicate_mesh=dist.group.WORLD, seed=seed)
        return Peer(model, model, [voted], counter, shardopt_optimizer=voted)
    device = next(model.parameters()).device
    # PowerSGD gets one bucket: with several, torch's hook issues each bucket's P/Q all-reduces from
    # callbacks of the bucket's earlier ones, so the buckets' collectives interleave differently on
    # different ranks, which gloo aborts ("collective mismatch") at the first compressed step.
    net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  bucket_cap_mb=1024 if method == "powersgd" else None)
    averager = None
    if method == "powersgd":
        net.register_comm_hook(powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=options.powersgd_rank,
                                                           start_powerSGD_iter=options.powersgd_start,
                                                           random_seed=seed), powerSGD_hook.powerSGD_hook)
    elif method == "localsgd":
        node_group, _ = dist.new_subgroups(group_size=local_world)
        net.register_comm_hook(post_localSGD_hook.PostLocalSGDState(None, node_group, options.local_start),
                               post_localSGD_hook.post_localSGD_hook)
        averager = PeriodicModelAverager(period=options.local_period, warmup_steps=options.local_start)
    else:
        net.register_comm_hook(None, default_hooks.allreduce_hook)  # DDP's own all-reduce, through the counted path
    nonmatrix_opt = torch.optim.AdamW(nonmatrix["params"], lr=nonmatrix_lr, weight_decay=0.0, **ADAMW_BETAS)
    if method == "ddp_muon":
        matrix_opt = torch.optim.Muon(matrices["params"], lr=lr, weight_decay=options.weight_decay,
                                      momentum=options.momentum, nesterov=False)
    else:
        matrix_opt = torch.optim.AdamW(matrices["params"], lr=lr, weight_decay=options.weight_decay, **ADAMW_BETAS)
    return Peer(model, net, [matrix_opt, nonmatrix_opt], counter, averager)


def replicas_equal(model: nn.Module) -> bool:
    """Whether every rank holds the same weights (shardopt's guard.replicas_equal over the world: one
    all-gather of a hash per parameter, through the comm layer, counted on an axis of its own)."""
    return guard.replicas_equal([p.detach() for p in model.parameters()], Axis("replicate", dist.group.WORLD))
