"""The double-averaging guard (docs/design.md §9): replicas whose gradients something else already
averaged (DDP without no_sync(), FSDP2 HSDP's replicate all-reduce, the DeepSpeed engine's
all-reduce) hold bitwise identical gradients; the optimizer would average them again. Ranks that all
read the same batches look the same. One hash per rank over its local gradients, compared over the
replicate axis with one small all-reduce.
"""

from __future__ import annotations

import torch

from ..wire.comm import Axis

HASH_CHUNK = 1 << 20   # elements bit_hash widens to int64 at a time (24 MiB of temporaries)


class DoubleAveragingError(RuntimeError):
    """The replicas' gradients were averaged before the optimizer's own exchange (see
    ShardOptimizer's double_averaging_check_every)."""


def bit_hash(tensor: torch.Tensor) -> torch.Tensor:
    """A position-weighted int64 hash of the raw bits of `tensor` (equal bits ⇒ equal hash):
    Σ_i bits_i·(2654435761·i + 1) mod 2⁶⁴, summed over chunks of HASH_CHUNK elements so the
    temporaries stay O(HASH_CHUNK), not O(tensor)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    raw = tensor.detach().contiguous().view(bits).reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=raw.device)
    for start in range(0, raw.numel(), HASH_CHUNK):
        chunk = raw[start:start + HASH_CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=raw.device, dtype=torch.int64) * 2654435761 + 1
        total += (chunk * weights).sum()
    return total


def replicas_equal(tensors: list[torch.Tensor], axis: Axis) -> bool:
    """True when every tensor (local, any dtype) is bitwise equal on all ranks of `axis`: one
    all-gather of the (len(tensors),) int64 bit_hash vector; reading the answer is a device sync."""
    if axis.size == 1 or not tensors:
        return True
    gathered = axis.all_gather(torch.stack([bit_hash(tensor) for tensor in tensors]))
    return bool((gathered == gathered[0]).all())


def check_not_double_averaged(grads: list[torch.Tensor], replicate: Axis, other_axes: list[Axis],
                              device: torch.device, step: int,
                              switch_off: str = "double_averaging_check_every=0") -> bool:
    """Raise DoubleAveragingError, on every rank alike, when every replica's local `grads` are
    bitwise identical and not all zero; return whether there was evidence either way (False: zero
    or no gradients on every rank).

    Each rank hashes its gradients, h = bit_hash((bit_hash(g₁), …, bit_hash(g_n))) mod 2⁶² (a param
    without a gradient is left out, so a rank that lacks one hashes differently), and all-reduces
    (h, −h, any g ≠ 0) as 3 int64 with max over the replicate axis: identical ⇔ max h = min h. Each
    replicate group's verdict (different; identical and nonzero) is all-reduced (max, 2 uint8) over
    `other_axes` (a shard axis: each shard's replicas compare their own shards), and all ranks raise
    iff no group saw different gradients and some group saw identical nonzero ones. Bytes:
    `traffic.double_averaging_check_bytes`; one device sync (reading the verdict). Callers run it before
    their step changes anything; `switch_off`: the optimizer's argument that turns the check off."""
    summary = torch.zeros(3, dtype=torch.int64, device=device)
    if grads:
        summary[0] = bit_hash(torch.stack([bit_hash(g) for g in grads])) & (2**62 - 1)
        summary[1] = -summary[0]
        summary[2] = torch.stack([g.any() for g in grads]).any()
    replicate.all_reduce(summary, "max")
    identical = summary[0] == -summary[1]
    verdict = torch.stack([~identical, identical & summary[2].bool()]).to(torch.uint8)
    for axis in other_axes:
        axis.all_reduce(verdict, "max")
    different, identical_nonzero = verdict.tolist()
    if identical_nonzero and not different:
        raise DoubleAveragingError(
            f"shardopt: at step {step} the local gradients of all {replicate.size} replicas are bitwise identical: "
            f"something averaged them over the data-parallel ranks already, and this optimizer would average them "
            f"again (double averaging: unanimous votes, twice the bytes), or every rank received the same batches "
            f"(a data loader not split across ranks: give each rank its own shard, e.g. a DistributedSampler). "
            f"shardopt exchanges the gradients itself; turn the other all-reduce off: HF Trainer: "
            f"Trainer(callbacks=[shardopt.hf.ShardoptCallback()]); Accelerate: "
            f"shardopt.accelerate.attach(accelerator, model, optimizer) after accelerator.prepare; Lightning: "
            f"Trainer(callbacks=[shardopt.lightning.ShardoptCallback()]); "
            f"DDP: run every forward and backward inside model.no_sync(); FSDP2 HSDP: "
            f"shard over the shard axis only, fully_shard(model, mesh=mesh['shard']), and pass "
            f"replicate_mesh=mesh['replicate'] (fully_shard on the 2-D mesh all-reduces over the replicate axis "
            f"unless model.set_requires_all_reduce(False)); DeepSpeed: engine.enable_backward_allreduce = False "
            f"(shardopt.deepspeed.initialize does it). No optimizer state was changed. If every replica "
            f"legitimately gets the same gradients, pass {switch_off} to turn this check off.")
    return bool(different or identical_nonzero)
