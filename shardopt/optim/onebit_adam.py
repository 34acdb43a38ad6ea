"""`OneBitAdam`: 1-bit Adam (arXiv 2102.02888) as a shardopt optimizer, every param in one "onebit_adam"
group (shardopt/algorithms/onebit_adam.py has the equations): exact Adam over the replicate axis for
`freeze_step` steps, then the variance frozen and the momentum exchanged in 1 bit per entry with
error feedback (shardopt/wire/onebit.py). The DeepSpeed plugin builds it from a `"type": "OneBitAdam"`
config (shardopt/deepspeed/onebit.py)."""

from __future__ import annotations

from ..algorithms.onebit_adam import DEFAULT_FREEZE_STEP
from .optimizer import ShardOptimizer


class OneBitAdam(ShardOptimizer):
    """1-bit Adam. lr, freeze_step, betas, eps (the group key "epsilon"), weight_decay: DeepSpeed's
    OneBitAdam params with its defaults (no bias correction, the decay added to the update). Param groups
    without an "algorithm" are "onebit_adam"; "adamw" and "lion" groups may sit beside them.
    `options`: replicate_mesh, shard_mesh, seed, nonfinite, max_grad_norm, maximize, … (see ShardOptimizer)."""

    matrix_algorithm = "onebit_adam"   # the algorithm of a group that names none

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = DEFAULT_FREEZE_STEP, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, replicate_mesh=None, shard_mesh=None,
                 tensor_mesh=None, **options):
        defaults = dict(lr=lr, freeze_step=freeze_step, betas=tuple(betas), epsilon=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, replicate_mesh=replicate_mesh, shard_mesh=shard_mesh,
                         tensor_mesh=tensor_mesh, **options)
