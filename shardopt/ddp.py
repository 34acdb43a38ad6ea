"""Switch off DDP's gradient all-reduce, for frameworks that wrap the model in DDP themselves
(HF Trainer, Accelerate, Lightning): shardopt exchanges the gradients itself (docs/design.md §5).

DDP's reducer hands each bucket of local gradients to a communication hook and copies what the
hook's future returns back into the gradients. `keep_local_gradients` installs a hook that returns
the bucket as it came, so every replica keeps its own gradient: no bytes cross the data-parallel
axis in backward, and the optimizer's compressed exchange is the only one.
"""

import torch

# (no `from __future__ import annotations`: DDP's register_comm_hook reads the hook's return
# annotation and refuses a string)


def _local_bucket(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket's local gradients, unchanged (DDP comm-hook signature)."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def keep_local_gradients(model) -> None:
    """Install the no-exchange communication hook on `model`, a torch DistributedDataParallel
    (call before the first backward; DDP accepts one hook per model)."""
    from torch.nn.parallel import DistributedDataParallel
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"keep_local_gradients takes a torch.nn.parallel.DistributedDataParallel, got "
                        f"{type(model).__name__}; a model that is not DDP-wrapped has no all-reduce to switch off")
    model.register_comm_hook(None, _local_bucket)
