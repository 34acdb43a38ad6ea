"""The comm layer's counts against the kernel's loopback counters: what each collective really sends.

Two gloo workers on this machine talk over `lo`, whose tx_bytes counts what both send; each
collective runs a few times on a 4 MiB input between barriers, and (Δ tx_bytes / 2 ranks / repeats)
must be within 5 % of `Axis`'s count (TCP and gloo headers are the rest). A backend algorithm that
sends more than the standard volume (gloo's reduce-scatter is an all-reduce underneath) fails here.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
from netdev import interface_tx_bytes  # noqa: E402

NUMEL, REPEATS = 1 << 20, 4
pytestmark = pytest.mark.skipif("lo" not in (interface_tx_bytes() or {}),
                                reason="needs Linux's /proc/net/dev with a loopback interface")


def _loopback_tx() -> int:
    return interface_tx_bytes()["lo"]


def _sent_and_counted(kind: str):
    """(bytes each rank put on lo per call, bytes the Axis counted per call, the result on this rank)."""
    import torch.distributed as dist
    from shardopt.wire.comm import Axis
    axis = Axis("replicate", dist.group.WORLD)
    rank = dist.get_rank()
    tensor = torch.arange(NUMEL, dtype=torch.float32) + rank          # rank r: [r, 1 + r, …]
    dist.barrier()
    before = _loopback_tx()
    dist.barrier()
    for _ in range(REPEATS):
        result = getattr(axis, kind)(tensor.clone())
    dist.barrier()
    sent = (_loopback_tx() - before) / 2 / REPEATS
    return sent, axis.stats()["bytes_sent"] / REPEATS, result


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "all_to_all", "reduce_scatter"])
def test_each_collective_sends_what_the_comm_layer_counts(pool2, kind):
    results = pool2.run(_sent_and_counted, kind)
    for rank, (sent, counted, result) in enumerate(results):
        assert counted > 0
        assert counted <= sent <= 1.05 * counted, f"{kind}: {sent:.0f} B on the wire, {counted:.0f} B counted"
    if kind == "reduce_scatter":    # rank r holds half r of the sum: 2·arange + 1
        expected = 2 * torch.arange(NUMEL, dtype=torch.float32) + 1
        for rank, (_, _, result) in enumerate(results):
            torch.testing.assert_close(result, expected[rank * NUMEL // 2:(rank + 1) * NUMEL // 2])
