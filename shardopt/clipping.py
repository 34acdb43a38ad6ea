"""Gradient clipping by a norm every rank agrees on (so the replicas' weights stay bit-identical).

Each rank holds its replica's local gradient, and under FSDP2 only its shard of it. Clipping
each rank by its own norm (torch.nn.utils.clip_grad_norm_ on local gradients) would scale the
replicas differently and break the exchange's promise that every replica applies the same
update. Here, with g_{r,s} the gradients of replica r held on shard rank s:

    ν_r = √(Σ_s ‖g_{r,s}‖²)        the replica's full gradient norm (shard axis: sum of one float;
                                   with a tensor axis of T ranks also summed over it, a gradient
                                   whole on every tensor rank counted 1/T on each)
    ν   = (1/R)·Σ_r ν_r             mean over the R replicas (replicate axis: mean of one float)
    g  ← g · min(1, max_norm / (ν + 1e-6))

As ν ≥ ‖(1/R)·Σ_r g_r‖ (triangle inequality), this clips at least as often as clipping the
averaged gradient would. Every rank computes the same factor from the same all-reduced float.
"""

from __future__ import annotations

import torch

from .comm import Axis


def agreed_grad_norm(grads: list[torch.Tensor], replicate: Axis, shard: Axis, device, tensor: Axis | None = None,
                     tensor_split: list[bool] | None = None) -> torch.Tensor:
    """ν (a 0-d float32 tensor on `device`, identical on every rank); no device sync.
    grads: this rank's local gradients (may be empty: the rank still joins the all-reduces);
    tensor_split[i]: grads[i] is split over the tensor axis (else whole on each tensor rank)."""
    if grads:
        squares = torch.stack([norm.float() for norm in torch._foreach_norm(grads)]).square()
        if tensor is not None and tensor.size > 1:
            squares = squares * torch.tensor([1.0 if split else 1 / tensor.size for split in tensor_split],
                                             device=squares.device)
        squares = squares.sum().reshape(1)
    else:
        squares = torch.zeros(1, device=device)
    squares = shard.all_reduce(squares, "sum")
    if tensor is not None:
        squares = tensor.all_reduce(squares, "sum")
    return replicate.all_reduce(squares.sqrt(), "mean")[0]


def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float, replicate: Axis, shard: Axis,
                    device, tensor: Axis | None = None, tensor_split: list[bool] | None = None) -> torch.Tensor:
    """Scale `grads` in place by min(1, max_norm / (ν + 1e-6)) and return ν (see the module doc)."""
    norm = agreed_grad_norm(grads, replicate, shard, device, tensor, tensor_split)
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for dtype in dict.fromkeys(g.dtype for g in grads):
        torch._foreach_mul_([g for g in grads if g.dtype == dtype], factor.to(dtype))
    return norm
