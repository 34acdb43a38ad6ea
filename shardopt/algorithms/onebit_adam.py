"""1-bit Adam (Tang et al., arXiv 2102.02888), the optimizer of DeepSpeed's removed "OneBitAdam" config,
with the same meaning of its params, element-wise on every param of its group:

    warm-up, steps t = 1 … F (F = freeze_step; F = 0 acts as 1, as in DeepSpeed's): exact Adam
        ḡ = mean_replicas(g)                          replicate axis: full-precision all-reduce
        m ← β₁·m + (1−β₁)·ḡ;   v ← β₂·v + (1−β₂)·ḡ²
    compression, t > F: v frozen; the momentum crosses the replicas in 1 bit per entry
        m ← β₁·m + (1−β₁)·g                           this replica's own gradient
        m ← onebit_mean(m; e_worker, e_server)        replicate axis: wire/onebit.py, error-compensated
    every step:
        x ← x − lr·(m / (√v + ε) + wd·x)

As in DeepSpeed's (and the paper's Algorithm 1) there is no bias correction: DeepSpeed accepted
`bias_correction` and `eps_inside_sqrt` but its update was m/(√v + ε) either way. The weight decay is
added to the update (decoupled, AdamW-like), as DeepSpeed's did. After the exchange every replica
holds the same m, so the momentum is not decoupled; the errors e are each replica's own (state
keys "worker_error" and "server_error", like the param; of the server error a replica uses the
entries of the chunk it owns, wire/onebit.py). The exchange, per bucket of whole tensors of one dtype (at
most bucket_bytes unless one tensor is larger: optim/plan.py): one flat all-reduce in the warm-up, the 1-bit
mean after it (2·(M−1)·(n/(8M) + 4T) bytes for n entries in T tensors).
"""

from __future__ import annotations

import torch

from . import hyperparams as H
from .record import Algorithm, Hyperparameter
from ..layout.placement import local
from ..wire.exchange import MEAN, by_dtype
from ..wire.onebit import ONEBIT_MEAN

STATE_KEYS = ("exp_avg", "exp_avg_sq", "worker_error", "server_error")
DEFAULT_FREEZE_STEP = 100_000   # DeepSpeed's default


def init_state(param: torch.Tensor, group: dict, seed: int) -> dict:
    return {key: torch.zeros_like(param) for key in STATE_KEYS}


def state_shapes(param: torch.Tensor, group: dict) -> dict:
    return {key: (tuple(param.shape), tuple(local(param).shape)) for key in STATE_KEYS}


def options(group: dict) -> dict:
    return {"lr": group["lr"], "betas": group["betas"], "weight_decay": group["weight_decay"],
            "epsilon": group["epsilon"], "freeze_step": group["freeze_step"]}


def warming_up(step: float, freeze_step: int) -> bool:
    """Whether step t (1, 2, …) is a warm-up step of exact Adam: t ≤ max(1, freeze_step)."""
    return step <= max(1, freeze_step)


def step(params, grads, states, *, exchanges: dict, axes, seed: int, lr: float, betas, weight_decay: float,
         epsilon: float, freeze_step: int):
    """One 1-bit Adam step on the group's params (the module docstring; a generator of collectives)."""
    beta1, beta2 = betas
    warm = [i for i, state in enumerate(states) if warming_up(float(state["step"]), freeze_step)]
    frozen = sorted(set(range(len(params))) - set(warm))
    if warm:
        mean = yield from MEAN.tensors([grads[i] for i in warm], axes.replicate)
        for i, g in zip(warm, mean):
            states[i]["exp_avg"].lerp_(g, 1 - beta1)
            states[i]["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
    for indices in by_dtype([params[i] for i in frozen]).values():
        chosen = [frozen[k] for k in indices]
        for i in chosen:
            states[i]["exp_avg"].lerp_(grads[i], 1 - beta1)
        means = yield from exchanges[params[chosen[0]].dtype].tensors(
            [states[i]["exp_avg"] for i in chosen], [states[i]["worker_error"] for i in chosen],
            [states[i]["server_error"] for i in chosen], axes.replicate)
        for i, m in zip(chosen, means):
            states[i]["exp_avg"].copy_(m)
    for param, state in zip(params, states):
        update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + epsilon)
        param.mul_(1 - lr * weight_decay).sub_(update.to(param.dtype), alpha=lr)


def describe_exchange(group: dict) -> str:
    return (f"exact Adam, fp32 gradient mean for {max(1, group['freeze_step']):,} steps; then the momentum, "
            f"1 bit per entry + scales")


def phases(group: dict) -> tuple:
    """(label, a step in it) of each phase whose bytes differ: the warm-up, then the 1-bit exchange."""
    frozen = max(1, group["freeze_step"])
    return ((f"steps 1-{frozen:,}", 1), (f"after step {frozen:,}", frozen + 1))


FREEZE_STEP = Hyperparameter(DEFAULT_FREEZE_STEP, lambda group, key, index: H.integer(group, key, index, 0))

ONEBIT_ADAM = Algorithm(
    name="onebit_adam", matrix=False, state_keys=STATE_KEYS, init_state=init_state, state_shapes=state_shapes,
    step=step, options=options, exchange=lambda group, layout, numel, replicas: ONEBIT_MEAN,
    describe_exchange=describe_exchange, phases=phases, cuts_tensors=False,
    hyperparameters={"lr": H.LR, "weight_decay": H.WEIGHT_DECAY, "betas": H.BETAS, "epsilon": H.EPSILON,
                     "freeze_step": FREEZE_STEP})
