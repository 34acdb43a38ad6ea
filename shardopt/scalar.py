"""Non-matrix parameters (embeddings, heads, norms, biases): full-precision gradient mean over
the replicate axis (they are small), then AdamW or Lion."""

from __future__ import annotations

import torch

from .comm import Axis
from .elementwise import adamw_update, lion_update


def init_state(param: torch.Tensor, algorithm: str) -> dict:
    state = {"exp_avg": torch.zeros_like(param)}
    if algorithm == "adamw":
        state["exp_avg_sq"] = torch.zeros_like(param)
    return state


def mean_gradients(grads: list[torch.Tensor], replicate: Axis):
    """Replicate-axis mean of a list of tensors: one flat all-reduce per dtype (a generator of
    collectives). Returns new tensors (the .grad tensors are not modified)."""
    if replicate.size == 1:
        return grads
    out = [None] * len(grads)
    for dtype in dict.fromkeys(g.dtype for g in grads):
        indices = [i for i, g in enumerate(grads) if g.dtype == dtype]
        flat = yield replicate.all_reduce(torch.cat([grads[i].reshape(-1) for i in indices]), "mean", async_op=True)
        for i, piece in zip(indices, flat.split([grads[i].numel() for i in indices])):
            out[i] = piece.view_as(grads[i])
    return out


def step(params, grads, states, group: dict, replicate: Axis):
    """One AdamW or Lion step on local tensors, after the replicate-axis gradient mean (a generator)."""
    grads = yield from mean_gradients(grads, replicate)
    exp_avgs = [s["exp_avg"] for s in states]
    if group["algorithm"] == "lion":
        lion_update(params, grads, exp_avgs, lr=group["lr"], betas=group["betas"],
                    weight_decay=group["weight_decay"])
        return
    by_step = {}
    for i, state in enumerate(states):
        by_step.setdefault(int(state["step"]), []).append(i)
    for step_count, idx in by_step.items():
        adamw_update([params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                     [states[i]["exp_avg_sq"] for i in idx], step_count, lr=group["lr"], betas=group["betas"],
                     epsilon=group["epsilon"], weight_decay=group["weight_decay"])
