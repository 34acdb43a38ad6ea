"""Gradient clipping by a norm every rank agrees on (so the replicas' weights stay bit-identical).

The one clipping path of shardopt: the optimizer's `max_grad_norm` and the DeepSpeed plugin's
"gradient_clipping" both come here, each naming its axes. Each rank holds its replica's local
gradient, or a piece of it: under FSDP2 its shard, under the DeepSpeed plugin's ZeRO 1/2 the
tensors it owns in its node. Clipping each rank by its own norm (torch.nn.utils.clip_grad_norm_ on
local gradients) would scale the replicas differently and break the exchange's promise that every
replica applies the same update. Here, with g_{r,s} the gradient pieces of replica r held on rank s
of its `split` axes:

    ν_r = √(Σ_s ‖g_{r,s}‖²)        the replica's full gradient norm (each split axis: a sum of one
                                   float; with a tensor axis of T ranks also summed over it, a
                                   gradient whole on every tensor rank counted 1/T on each)
    ν   = (1/R)·Σ_r ν_r             mean over the R replicas (replicate axis: mean of one float)
    g  ← g · min(1, max_norm / (ν + 1e-6))

As ν ≥ ‖(1/R)·Σ_r g_r‖ (triangle inequality), this clips at least as often as clipping the
averaged gradient would. Every rank computes the same factor from the same all-reduced float.
"""

from __future__ import annotations

import torch

from ..wire.comm import Axis


def agreed_grad_norm(grads: list[torch.Tensor], *, replicate: Axis, split: tuple[Axis, ...], device,
                     tensor: Axis | None = None, tensor_split: list[bool] | None = None) -> torch.Tensor:
    """ν (a 0-d float32 tensor on `device`, identical on every rank); no device sync.
    grads: this rank's local gradients (may be empty: the rank still joins the all-reduces);
    split: the axes whose ranks hold disjoint pieces of one replica's gradient (squares summed);
    tensor_split[i]: grads[i] is split over the tensor axis (else whole on each tensor rank)."""
    if grads:
        squares = torch.stack([norm.float() for norm in torch._foreach_norm(grads)]).square()
        if tensor is not None and tensor.size > 1:
            squares = squares * torch.tensor([1.0 if whole_split else 1 / tensor.size for whole_split in tensor_split],
                                             device=squares.device)
        squares = squares.sum().reshape(1)
    else:
        squares = torch.zeros(1, device=device)
    for axis in split:
        squares = axis.all_reduce(squares, "sum")
    if tensor is not None:
        squares = tensor.all_reduce(squares, "sum")
    return replicate.all_reduce(squares.sqrt(), "mean")[0]


def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float, *, replicate: Axis, split: tuple[Axis, ...], device,
                    tensor: Axis | None = None, tensor_split: list[bool] | None = None) -> torch.Tensor:
    """Scale `grads` in place by min(1, max_norm / (ν + 1e-6)) and return ν (see the module doc);
    max_norm 0: ν only, the gradients left as they are (for logging the norm)."""
    norm = agreed_grad_norm(grads, replicate=replicate, split=split, device=device, tensor=tensor,
                            tensor_split=tensor_split)
    if max_norm > 0:
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for dtype in dict.fromkeys(g.dtype for g in grads):
            torch._foreach_mul_([g for g in grads if g.dtype == dtype], factor.to(dtype))
    return norm
