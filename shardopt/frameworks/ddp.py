"""Switch off DDP's gradient all-reduce, for frameworks that wrap the model in DDP themselves
(HF Trainer, Accelerate, Lightning): shardopt exchanges the gradients itself (docs/design.md §11).

DDP's reducer hands each bucket of local gradients to a communication hook and copies what the
hook's future returns back into the gradients. `keep_local_gradients` installs a hook that returns
the bucket as it came, so every replica keeps its own gradient: no bytes cross the data-parallel
axis in backward, and the optimizer's compressed exchange is the only one.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


def _local_bucket(state, bucket):
    """The bucket's local gradients, unchanged, in a completed torch.futures.Future (DDP's comm-hook
    signature; no return annotation: DDP accepts only the object torch.futures.Future[torch.Tensor]
    there, and `from __future__ import annotations` would make it a string)."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def keep_local_gradients(model, optimizer=None) -> None:
    """Install the no-exchange communication hook on `model`, a torch DistributedDataParallel
    (call before the first backward; DDP accepts one hook per model: a second call on the same
    model, e.g. from a second Trainer.train(), does nothing). `optimizer`: a shardopt optimizer,
    whose exchange during backward then waits out the micro-batches run under model.no_sync()."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"keep_local_gradients takes a torch.nn.parallel.DistributedDataParallel, got "
                        f"{type(model).__name__}; a model that is not DDP-wrapped has no all-reduce to switch off")
    if not getattr(model, "_shardopt_local_gradients", False):
        model.register_comm_hook(None, _local_bucket)
        model._shardopt_local_gradients = True
    if optimizer is not None:
        optimizer.accumulate_under_no_sync(model)
