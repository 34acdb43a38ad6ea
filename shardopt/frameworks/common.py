"""What the adapters of frameworks that own the training loop share (docs/design.md §11): finding shardopt's
optimizer inside the framework's wrapper, checking that it exchanges over the framework's data-parallel
processes, and readying it for the framework's checkpoint."""

from __future__ import annotations

from ..localsteps.optimizer import LocalSteps
from ..optim.optimizer import ShardOptimizer
from ..optim.checkpoint_momenta import checkpoint_exchange


def shardopt_optimizer(optimizer, fix: str) -> ShardOptimizer:
    """The shardopt optimizer inside `optimizer` (Accelerate's AcceleratedOptimizer holds it as .optimizer);
    TypeError saying `fix` if there is none."""
    inner = optimizer
    while not isinstance(inner, ShardOptimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    if isinstance(inner, LocalSteps):
        raise TypeError("shardopt: LocalSteps runs under HF Trainer and Accelerate through a DeepSpeed config "
                        "(\"shardopt\": {\"local_steps\": {...}}, docs/trainers.md), not as the optimizer of their DDP, "
                        "and not under Lightning; in your own loop, wrap the model yourself (LocalSteps' docstring)")
    if not isinstance(inner, ShardOptimizer):
        raise TypeError(f"shardopt: the framework holds a {type(optimizer).__name__}, not a shardopt optimizer; {fix}")
    return inner


def local_steps_inside(optimizer) -> LocalSteps | None:
    """The LocalSteps inside `optimizer` (Accelerate's wrapper → DeepSpeed's fp16/bf16 wrapper → the client
    optimizer, each holding the next as .optimizer), or None."""
    while not isinstance(optimizer, LocalSteps) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, LocalSteps) else None


def check_replicas(optimizer: ShardOptimizer, processes: int, framework: str) -> None:
    """ValueError unless the optimizer's replicate axis is the framework's `processes` data-parallel ranks
    (with fewer, the gradients of the others would never be exchanged and the replicas would drift)."""
    replicas = optimizer.replicate.size
    if replicas != processes:
        raise ValueError(f"shardopt: {framework} runs {processes} data-parallel process(es) but the optimizer exchanges "
                         f"gradients over {replicas} replica(s); build it with "
                         f"replicate_mesh=torch.distributed.group.WORLD (None on one process)")


def prepare_checkpoint(optimizer: ShardOptimizer, saver: str) -> None:
    """Before `saver` writes rank 0's state as everyone's: average the decoupled momenta over the replicas
    (synchronize_for_checkpoint) and check that the replicas' weights are bitwise equal (RuntimeError if not)."""
    optimizer.synchronize_for_checkpoint(checkpoint_exchange(optimizer))
    if not optimizer.replicas_consistent():
        raise RuntimeError(f"shardopt: the replicas' weights differ before {saver} (rank 0's checkpoint would not be "
                           f"every rank's state); something changed them outside the optimizer's step")
