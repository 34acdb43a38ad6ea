"""Non-matrix parameters (embeddings, heads, norms, biases) over the replicate axis (docs/design.md §3).

- "adamw": full-precision gradient mean (one flat all-reduce per bucket), then AdamW.
- "lion": Lion with a 1-bit majority vote (Distributed Lion, arXiv 2404.00438). Each
  replica forms its own direction from its own gradient and its own (decoupled) momentum,
  the replicas vote on the signs with Sign-Muon's wire formats, and every replica applies
  the voted sign:

      d ← β₁·m + (1−β₁)·g                    local (n,)
      V ← sign(Σ_replicas sign(d))           replicate axis: `vote` format, 1 bit per entry
      x ← (1 − lr·wd)·x − lr·V
      m ← β₂·m + (1−β₂)·g                    local, replicas may differ

  sign(0) = 0 (Lion's own rule): an exact-zero direction abstains (see vote.py). On one
  replica this is exactly Lion.

Both step a bucket at a time: runs of the group's entries of one dtype, at most bucket_bytes (optim/plan.py
`entry_buckets`), one exchange per bucket; the numbers are those of the whole group in one bucket.
"""

from __future__ import annotations

import torch

from . import hyperparams as H
from .record import Algorithm
from .elementwise import adamw_update
from ..wire.exchange import MEAN, Vote, by_dtype
from ..layout.placement import local
from ..wire.vote import vote_format


def init_state(param: torch.Tensor, group: dict, seed: int) -> dict:
    state = {"exp_avg": torch.zeros_like(param)}
    if group["algorithm"] == "adamw":
        state["exp_avg_sq"] = torch.zeros_like(param)
    return state


def _like_param(*keys):
    return lambda param, group: {key: (tuple(param.shape), tuple(local(param).shape)) for key in keys}


def options(group: dict) -> dict:
    return {"lr": group["lr"], "betas": group["betas"], "weight_decay": group["weight_decay"],
            "epsilon": group["epsilon"]}


def lion_step(params, grads, states, *, exchanges: dict, axes, seed: int, lr: float, betas, weight_decay: float,
              epsilon: float):
    """Lion with the replicas' majority vote on the signs (a generator of collectives), one flat
    vote per dtype over the bucket's tensors (`exchanges`: dtype → its Vote)."""
    beta1, beta2 = betas
    exp_avgs = [s["exp_avg"] for s in states]
    for dtype, indices in by_dtype(params).items():
        direction = torch.cat([exp_avgs[i].reshape(-1).lerp(grads[i].reshape(-1), 1 - beta1) for i in indices])
        voted = yield from exchanges[dtype].signs(direction > 0, axes.replicate, seed, abstain=direction == 0)
        for i, V in zip(indices, voted.split([params[i].numel() for i in indices])):
            params[i].mul_(1 - lr * weight_decay).add_(V.view_as(params[i]).to(params[i].dtype), alpha=-lr)
            exp_avgs[i].lerp_(grads[i], 1 - beta2)


def adamw_step(params, grads, states, *, exchanges: dict, axes, seed: int, lr: float, betas, weight_decay: float,
               epsilon: float):
    """AdamW after the replicate-axis gradient mean (a generator of collectives)."""
    grads = yield from MEAN.tensors(grads, axes.replicate)
    by_step = {}
    for i, state in enumerate(states):
        by_step.setdefault(int(state["step"]), []).append(i)
    for step_count, idx in by_step.items():
        adamw_update([params[i] for i in idx], [grads[i] for i in idx], [states[i]["exp_avg"] for i in idx],
                     [states[i]["exp_avg_sq"] for i in idx], step_count, lr=lr, betas=betas, epsilon=epsilon,
                     weight_decay=weight_decay)


_COMMON = dict(matrix=False, init_state=init_state, options=options)

ADAMW = Algorithm(
    name="adamw", state_keys=("exp_avg", "exp_avg_sq"), state_shapes=_like_param("exp_avg", "exp_avg_sq"),
    step=adamw_step, hyperparameters={"lr": H.LR, "weight_decay": H.WEIGHT_DECAY, "betas": H.BETAS,
                                      "epsilon": H.EPSILON},
    exchange=lambda group, layout, numel, replicas: MEAN,
    describe_exchange=lambda group: "full-precision gradient mean", **_COMMON)

LION = Algorithm(
    name="lion", state_keys=("exp_avg",), state_shapes=_like_param("exp_avg"), step=lion_step,
    hyperparameters={"lr": H.LR, "weight_decay": H.WEIGHT_DECAY, "betas": H.BETAS, "vote": H.VOTE},
    plan_keys=("vote",), exchange=lambda group, layout, numel, replicas: Vote(vote_format(group["vote"], numel, replicas)),
    describe_exchange=lambda group: f"1-bit vote ({group['vote']})", decoupled_momentum="exp_avg", **_COMMON)
