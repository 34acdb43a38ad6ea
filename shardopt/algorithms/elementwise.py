"""AdamW, the element-wise update for non-matrix parameters (pure, in place on lists); Lion, whose
signs are voted over the replicate axis, is in nonmatrix.py."""

import torch


def adamw_update(params, grads, exp_avgs, exp_avg_sqs, step: int, *, lr: float, betas, epsilon: float,
                 weight_decay: float) -> None:
    """AdamW (decoupled decay), one step t = `step` (≥ 1) on lists of same-length tensors.

        m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²
        x ← (1 − lr·wd)·x − lr · (m / (1−β₁ᵗ)) / (√(v / (1−β₂ᵗ)) + ε)
    """
    beta1, beta2 = betas
    bias1 = 1 - beta1 ** step
    bias2_sqrt = (1 - beta2 ** step) ** 0.5
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias2_sqrt)
    torch._foreach_add_(denom, epsilon)
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -lr / bias1)

