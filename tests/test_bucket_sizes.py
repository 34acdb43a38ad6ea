"""Bucket sizes (issue 43 item 6). The default cap is the device's (shardopt/layout/buckets.py:
default_bucket_bytes, a pure function of the device type, so the CUDA default is pinned on a CPU).

Element-wise groups ("adamw", "lion", "onebit_adam") step in buckets of at most bucket_bytes of entries
(shardopt/layout/buckets.py: flat_buckets; shardopt/optim/plan.py: entry_buckets), so a step's transient memory
is O(bucket_bytes), not O(group) (issue 43 item 6: an 8B model's embedding and head under Lion or AdamW).

Pinned here: the cutting rule; bucketed steps give bitwise the params and state of one bucket per dtype, on
2 and 4 gloo replicas with ties and abstentions (the vote's coins are numbered within the group); and the
largest temporary a step allocates, and the peak of the temporaries alive at once, measured on every aten op's
output (a TorchDispatchMode), follow bucket_bytes, not the group's size.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch._dynamo  # noqa: F401  torch.optim imports it on first use; once, before the pools fork
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import shardopt
from shardopt.layout.buckets import DEFAULT_BUCKET_BYTES, default_bucket_bytes, flat_buckets

TIMEOUT_S = 120
ONE_BUCKET = 2**40


def test_default_bucket_bytes_is_chosen_by_device_type():
    assert default_bucket_bytes("cpu") == DEFAULT_BUCKET_BYTES == 16 * 2**20
    assert default_bucket_bytes("cuda") == 128 * 2**20
    assert default_bucket_bytes("meta") == default_bucket_bytes("mps") == DEFAULT_BUCKET_BYTES


def test_optimizer_resolves_bucket_bytes_from_the_params_device_and_keeps_an_explicit_one():
    param = torch.nn.Parameter(torch.zeros(4, 4))
    assert shardopt.SignMuon([param], lr=0.01).bucket_bytes == default_bucket_bytes("cpu")
    assert shardopt.Dion([param], bucket_bytes=12345).bucket_bytes == 12345
    for bad in (0, -1, 1.5, True, "16MiB"):
        with pytest.raises(ValueError, match="bucket_bytes must be a positive integer.*or None for the device's "
                                             "default \\(cuda: 128 MiB, else 16 MiB\\)"):
            shardopt.Dion([param], bucket_bytes=bad)


def test_flat_buckets_cut_one_run_of_entries_under_the_cap():
    assert flat_buckets([5, 3, 9], [False] * 3, 4) == [[(0, 0, 4)], [(0, 4, 5), (1, 0, 3)], [(2, 0, 4)], [(2, 4, 8)],
                                                       [(2, 8, 9)]]
    # a whole tensor is never cut: it closes the bucket before it, and one over the cap is a bucket of its own
    assert flat_buckets([3, 6, 2, 0], [False, True, False, False], 4) == [[(0, 0, 3)], [(1, 0, 6)],
                                                                         [(2, 0, 2), (3, 0, 0)]]
    assert flat_buckets([7], [False], ONE_BUCKET) == [[(0, 0, 7)]]
    for sizes, cap in (([97, 1, 40, 300], 13), ([8, 8, 8], 8), ([1000], 999)):
        buckets = flat_buckets(sizes, [False] * len(sizes), cap)
        assert all(sum(stop - start for _, start, stop in bucket) <= cap for bucket in buckets)
        runs = [entry for bucket in buckets for entry in bucket]
        for index, size in enumerate(sizes):   # each tensor's runs tile it, in order
            pieces = [(start, stop) for i, start, stop in runs if i == index]
            assert pieces[0][0] == 0 and pieces[-1][1] == size
            assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


SHAPES = [(37, 11), (5,), (64, 33), (3, 7), (129,)]   # odd sizes: cuts fall inside params, off multiples of 8


def _params(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype))
              for shape in SHAPES]
    params.append(torch.nn.Parameter(torch.randn(7, 5, generator=generator).t()))   # not contiguous: stays whole
    return params


def _bucketed_run(algorithm, vote, bucket_bytes, steps=3):
    """Three steps of one element-wise group on this replica's own gradients; param 1 gets a zero gradient on
    every replica (Lion: every replica abstains there). Returns the params and state, flat."""
    rank = dist.get_rank()
    params = _params()[:-1] if algorithm == "onebit_adam" else _params()   # (its exchange views its state flat)
    group = {"params": params, "algorithm": algorithm, "lr": 0.01, "weight_decay": 0.1}
    if algorithm == "lion":
        group["vote"] = vote
    if algorithm == "onebit_adam":
        group["freeze_step"] = 1   # steps 2 and 3 send the 1-bit momentum
    opt = shardopt.SignMuon([group], lr=0.01, replicate_mesh=dist.group.WORLD, seed=5, bucket_bytes=bucket_bytes)
    for step in range(steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        for index, param in enumerate(params):
            param.grad = torch.zeros_like(param) if index == 1 else torch.randn(param.shape, generator=generator)
        opt.step()
    buckets = len(opt._plans.get(0, shardopt.algorithms.registry.algorithm(algorithm), opt.param_groups[0], params,
                                 dist.get_world_size(), bucket_bytes, lambda p: 0).buckets)
    return {"params": [p.detach().clone() for p in params], "buckets": buckets,
            "state": [{k: v.clone() for k, v in opt.state[p].items()} for p in params]}


CASES = [(world_size, "lion", vote) for world_size in (2, 4) for vote in ("alltoall_1bit", "allgather_1bit",
                                                                      "allreduce_int8")]
CASES += [(2, "adamw", None), (4, "adamw", None), (2, "onebit_adam", None)]


@pytest.mark.parametrize("world_size, algorithm, vote", CASES)
def test_bucketed_elementwise_step_equals_one_bucket_bitwise(pools, world_size, algorithm, vote):
    """bucket_bytes = 4·97 (97 fp32 entries a bucket, cuts inside params) against one bucket: the same params and
    state, bit for bit, on every replica; even M and a zero gradient give ties and abstentions (the coins).
    1-bit Adam's buckets hold whole tensors (its scales are per tensor). AdamW's fp32 mean at M ≥ 3 is the one
    exception: a ring all-reduce (gloo's, NCCL's) sums an entry's M values in an order set by where the entry
    sits in its message, so another cut may round the mean differently in the last bit (docs/design.md §9);
    there it is pinned to fp32 rounding, and the replicas equal each other. (1-bit Adam's warm-up mean has the
    same last-bit freedom at M ≥ 3, and its frozen-variance steps divide by √v + ε: 1e-5 apart after 3 steps
    at M = 4, measured; it is pinned at M = 2.)"""
    pool = pools(world_size)
    cut = pool.run(_bucketed_run, algorithm, vote, 4 * 97, timeout_s=TIMEOUT_S)
    whole = pool.run(_bucketed_run, algorithm, vote, ONE_BUCKET, timeout_s=TIMEOUT_S)
    assert whole[0]["buckets"] == 1 and cut[0]["buckets"] >= 5
    same = torch.equal if algorithm == "lion" or world_size <= 2 else \
        (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-7))
    for mine, theirs in zip(cut, whole):
        assert all(same(a, b) for a, b in zip(mine["params"], theirs["params"]))
        for a, b in zip(mine["state"], theirs["state"]):
            assert a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    assert all(torch.equal(a, b) for r in cut for a, b in zip(r["params"], cut[0]["params"]))   # replicas equal


class Temporaries(TorchDispatchMode):
    """Every aten op's fresh outputs (storage no input shares): the largest one, and the peak of the bytes of those
    still referenced (freed when their tensor is collected)."""

    def __init__(self):
        super().__init__()
        self.largest = self.live = self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                nbytes = tensor.untyped_storage().nbytes()
                self.largest = max(self.largest, nbytes)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._free, nbytes)
        return out


def _measured_step(algorithm: str, bucket_bytes: int) -> Temporaries:
    """A second step (the first makes the state) of one element-wise group holding a 1024×512 "embedding"
    (2 MiB fp32) and small params, on one process, measured."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((1024, 512), (512,), (77, 3))]
    opt = shardopt.SignMuon([{"params": params, "algorithm": algorithm, "lr": 0.01}], lr=0.01,
                            bucket_bytes=bucket_bytes)
    for step in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        if step == 0:
            opt.step()
            continue
        with Temporaries() as temporaries:
            opt.step()
    return temporaries


@pytest.mark.parametrize("algorithm", ["lion", "adamw"])
def test_elementwise_step_temporaries_follow_bucket_bytes_not_the_group(algorithm):
    group_bytes = (1024 * 512 + 512 + 77 * 3) * 4
    small, large, whole = (_measured_step(algorithm, b) for b in (32 * 2**10, 128 * 2**10, ONE_BUCKET))
    assert whole.largest >= 1024 * 512 * 4        # one bucket: a temporary as large as the embedding
    for measured, cap in ((small, 32 * 2**10), (large, 128 * 2**10)):
        assert measured.largest <= cap            # the working copy of a bucket is at most the cap
        assert measured.peak <= 8 * cap < group_bytes   # two buckets in flight, a few copies each
    assert large.peak >= 2 * small.peak           # 4× the cap: the peak grows with it
