"""Non-matrix parameters (embeddings, heads, norms, biases) over the replicate axis (DESIGN §3).

- "adamw": full-precision gradient mean (one flat all-reduce per dtype), then AdamW.
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
"""

from __future__ import annotations

import torch

from .comm import Axis
from .elementwise import adamw_update
from .vote import resolve_vote, vote_exchange


def init_state(param: torch.Tensor, algorithm: str) -> dict:
    state = {"exp_avg": torch.zeros_like(param)}
    if algorithm == "adamw":
        state["exp_avg_sq"] = torch.zeros_like(param)
    return state


def by_dtype(tensors: list[torch.Tensor]) -> dict:
    """dtype → the indices of `tensors` with that dtype, in order (one flat exchange per dtype)."""
    indices: dict = {}
    for i, tensor in enumerate(tensors):
        indices.setdefault(tensor.dtype, []).append(i)
    return indices


def mean_gradients(grads: list[torch.Tensor], replicate: Axis):
    """Replicate-axis mean of a list of tensors: one flat all-reduce per dtype (a generator of
    collectives). Returns new tensors (the .grad tensors are not modified)."""
    if replicate.size == 1:
        return grads
    out = [None] * len(grads)
    for indices in by_dtype(grads).values():
        flat = yield replicate.all_reduce(torch.cat([grads[i].reshape(-1) for i in indices]), "mean", async_op=True)
        for i, piece in zip(indices, flat.split([grads[i].numel() for i in indices])):
            out[i] = piece.view_as(grads[i])
    return out


def lion_vote_step(params, grads, exp_avgs, group: dict, replicate: Axis, seed: int):
    """Lion with the replicas' majority vote on the signs (a generator of collectives), one flat
    vote per dtype over all the group's tensors."""
    beta1, beta2 = group["betas"]
    lr, decay = group["lr"], 1 - group["lr"] * group["weight_decay"]
    for indices in by_dtype(params).values():
        direction = torch.cat([exp_avgs[i].reshape(-1).lerp(grads[i].reshape(-1), 1 - beta1) for i in indices])
        fmt = resolve_vote(group["vote"], direction.numel(), replicate.size)
        voted = yield from vote_exchange(direction > 0, replicate, fmt, seed, abstain=direction == 0)
        for i, V in zip(indices, voted.split([params[i].numel() for i in indices])):
            params[i].mul_(decay).add_(V.view_as(params[i]).to(params[i].dtype), alpha=-lr)
            exp_avgs[i].lerp_(grads[i], 1 - beta2)


def step(params, grads, states, group: dict, replicate: Axis, seed: int):
    """One AdamW (after the gradient mean) or Lion-vote step on local tensors (a generator)."""
    exp_avgs = [s["exp_avg"] for s in states]
    if group["algorithm"] == "lion":
        yield from lion_vote_step(params, grads, exp_avgs, group, replicate, seed)
        return
    grads = yield from mean_gradients(grads, replicate)
    by_step = {}
    for i, state in enumerate(states):
        by_step.setdefault(int(state["step"]), []).append(i)
    for step_count, idx in by_step.items():
        adamw_update([params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                     [states[i]["exp_avg_sq"] for i in idx], step_count, lr=group["lr"], betas=group["betas"],
                     epsilon=group["epsilon"], weight_decay=group["weight_decay"])
