"""What a checkpoint needs the replicas to agree on: the momenta each replica keeps for itself.

A record's `decoupled_momentum` (Dion's M, Sign-Muon's and Lion's momentum) is the replica's own; a
checkpoint saved on one replica would restore that replica's only. Before saving, every replica replaces its
momenta by one value every replica agrees on, so the checkpoint holds that value and the run that goes on
after the save continues from it too (a resume is bit-exact; DCP reshards it as any replicated state).
AdamW's moments come from averaged gradients and are alike already.

How the agreed value is computed (`exchange`; M replicas, n decoupled momentum entries on this rank):

| exchange | agreed value | bytes one replica sends (`checkpoint_bytes`) |
|---|---|---|
| "mean" | the fp32 mean, exact (exchange.MEAN, one all-reduce per dtype) | 8n(M−1)/M: 32× a Sign-Muon step's vote |
| "sign_vote" ("auto" from 3 replicas up) | the 1-bit majority vote of sign(m) (vote.py, "auto": the fewest bytes at M) times the replicas' mean of mean \\|m\\| per block of CHECKPOINT_BLOCK (localsteps/formats.SignVote) | the vote of n entries + 8(⌈n/block⌉+1)(M−1)/M: at most a Sign-Muon step's vote of the same entries + 0.2 % |
| "sign_mean" ("auto" at 2 replicas) | the mean of the replicas' scaled signs (SignMean): at M = 2 the vote's bytes, finer; grows as an all-gather | (M−1)(⌈n/8⌉ + 4(⌈n/block⌉+1)) |
| "int8", "int4" | per-block absmax codes, owners average (Quantized) | ≈ 2n(M−1)/M, n(M−1)/M |

"auto" (CHECKPOINT_EXCHANGE, the framework adapters' default) is the agreement that kept the most quality
within one compressed step's bytes, measured side by side (results/checkpoint_momenta.csv: Sign-Muon + Lion,
2 replicas, 200 steps, a checkpoint every 20; final val loss 2.0734 without checkpoints, 2.0430 "mean" at 32×
a step's bytes, 2.0884 "sign_mean" and 2.1407 "sign_vote" at 1.002× a step): "sign_mean" at 2 replicas,
"sign_vote" from 3 up, where sign_mean's all-gather (M−1 signs per entry) exceeds a step's vote.
A checkpoint that leaves the momenta alone (each replica saving its own, integrations/fsdp/train.py
--checkpoint-momenta own) sends nothing and keeps the training as it was, but needs every rank's own file,
which the framework adapters that save rank 0's state do not write.

The adapters of frameworks that save for the user (shardopt.frameworks, shardopt.deepspeed) use the
optimizer's `checkpoint_exchange` attribute (`checkpoint_exchange(optimizer)`: CHECKPOINT_EXCHANGE unless set
on the optimizer); `synchronize_for_checkpoint()` called without an exchange takes the exact "mean".
"""

from __future__ import annotations

import torch

from ..algorithms import registry
from ..algorithms.hyperparams import state_dtype
from ..layout.placement import local
from ..localsteps.formats import OUTER_FORMATS, outer_format
from ..wire.comm import Axis, CountingAxis, complete
from ..wire.exchange import MEAN
from ..wire.seeds import mix_seed

CHECKPOINT_EXCHANGE = "auto"   # what the framework adapters' checkpoints send (≤ one Sign-Muon step's vote)
CHECKPOINT_EXCHANGES = tuple(OUTER_FORMATS)
CHECKPOINT_BLOCK = 16384   # entries per magnitude of "sign_vote" / "sign_mean" / "int8" / "int4"


def checkpoint_exchange(optimizer) -> str:
    """The exchange the framework adapters' checkpoints use for `optimizer`: its `checkpoint_exchange`
    attribute where a user set one ("mean": the exact fp32 mean), else CHECKPOINT_EXCHANGE."""
    return getattr(optimizer, "checkpoint_exchange", CHECKPOINT_EXCHANGE)


def decoupled_momenta(groups: list[dict], state: dict) -> list[torch.Tensor]:
    """The local `decoupled_momentum` tensors of every param with state in `groups`, in group and param order."""
    return [local(state[p][key]) for group in groups
            if (key := registry.algorithm(group["algorithm"]).decoupled_momentum)
            for p in group["params"] if state.get(p)]


def _format(exchange: str):
    if exchange not in CHECKPOINT_EXCHANGES:
        raise ValueError(f"checkpoint exchange must be one of {CHECKPOINT_EXCHANGES}, got {exchange!r}")
    return outer_format(exchange, block=CHECKPOINT_BLOCK, vote="auto")


def average_decoupled_momenta(groups: list[dict], state: dict, replicate: Axis, exchange: str = "mean",
                              seed: int = 0) -> None:
    """In place: each record's `decoupled_momentum` of every param with state in `groups` ← the value the
    replicas agree on through `exchange` (module docstring), bitwise equal on every replica; `seed`: the
    vote's tie coins (equal on every replica). "mean": one all-reduce per dtype (exchange.MEAN); the others:
    one flat fp32 x of every momentum through the localsteps format ("auto": formats.ByReplicas, at this M)."""
    momenta = decoupled_momenta(groups, state)
    fmt = _format(exchange) if exchange != "mean" else None
    if not momenta or replicate.size == 1:
        return
    if fmt is None:
        agreed = complete(MEAN.tensors(momenta, replicate))
    else:
        x = torch.cat([momentum.reshape(-1).float() for momentum in momenta])
        mean, _, _ = complete(fmt.exchange(x, replicate, seed))
        agreed = mean.split([momentum.numel() for momentum in momenta])
    for momentum, value in zip(momenta, agreed):
        momentum.copy_(value.view_as(momentum))


def synchronize(optimizer, exchange: str = "mean") -> None:
    """ShardOptimizer.synchronize_for_checkpoint: its decoupled momenta agreed over its replicate axis, the
    vote's coins drawn from its seed and the step count kept in its state (a resumed run draws the same)."""
    steps = max((int(record["step"]) for record in optimizer.state.values() if "step" in record), default=0)
    average_decoupled_momenta(optimizer.param_groups, optimizer.state, optimizer.replicate, exchange,
                              mix_seed(optimizer.seed, steps))


def checkpoint_bytes(groups: list[dict], replicas: int, exchange: str) -> int:
    """Replicate-axis bytes one rank sends in one checkpoint's agreement at `replicas` replicas: the exchange's
    own code run on meta tensors against a counting axis (the decoupled momenta's shapes from the records)."""
    numels = {}
    for group in groups:
        record = registry.algorithm(group["algorithm"])
        if record.decoupled_momentum:
            for p in group["params"]:
                shape = record.state_shapes(p, group)[record.decoupled_momentum][1]
                numels.setdefault(state_dtype(group, p), []).append(torch.Size(shape).numel())
    axis, total = CountingAxis("replicate", replicas), sum(sum(values) for values in numels.values())
    if not total or replicas <= 1:
        return 0
    if exchange == "mean":
        for dtype, values in numels.items():   # one all-reduce per dtype
            complete(MEAN.tensors([torch.empty(sum(values), dtype=dtype, device="meta")], axis))
    else:
        complete(_format(exchange).exchange(torch.empty(total, device="meta"), axis, 0))
    return axis.bytes_sent
