"""The replicate-axis exchange stage: every way shardopt's steps combine the replicas (docs/design.md §1-§3).

A step computes its local contribution, then hands it to the exchange its plan chose once per
bucket layout (plan.py), then applies the result. The exchanges:

| exchange | used by | what crosses the replicate axis (M replicas) |
|---|---|---|
| `Mean` | "adamw", "muon", Dion's fallback, `synchronize_for_checkpoint` | the tensors, one flat all-reduce per dtype |
| `FactorMean` (algorithms/factors.py) | "dion" | P (a×r) and R (b×r) in `wire` dtype; layouts whole / split / gathered |
| `Vote(fmt)` | "signmuon", "lion" | signs in a wire format of vote.py (1 bit per entry) |

Each is a generator of collectives (schedule.py): `P = yield axis.all_reduce(P, async_op=True)`.
Bytes are what the communication layer counts; traffic.py runs the same code on a counting axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout.buckets import stack_as
from .comm import Axis
from .vote import VoteFormat


def by_dtype(tensors: list[torch.Tensor]) -> dict:
    """dtype → the indices of `tensors` with that dtype, in order (one flat exchange per dtype)."""
    indices: dict = {}
    for i, tensor in enumerate(tensors):
        indices.setdefault(tensor.dtype, []).append(i)
    return indices


class Mean:
    """The full-precision mean over the replicate axis."""

    def tensors(self, tensors: list[torch.Tensor], replicate: Axis):
        """mean_replicas of each tensor: one flat all-reduce per dtype. Returns new tensors (the
        inputs, e.g. the .grad tensors, are not modified); the inputs themselves on one replica."""
        if replicate.size == 1:
            return tensors
        out = [None] * len(tensors)
        for indices in by_dtype(tensors).values():
            flat = yield replicate.all_reduce(torch.cat([tensors[i].reshape(-1) for i in indices]), "mean",
                                              async_op=True)
            for i, piece in zip(indices, flat.split([tensors[i].numel() for i in indices])):
                out[i] = piece.view_as(tensors[i])
        return out

    def stacked(self, tensors: list[torch.Tensor], dtype: torch.dtype, replicate: Axis):
        """mean_replicas of a bucket's tensors stacked into one (k, …) tensor in `dtype`."""
        return (yield replicate.all_reduce(stack_as(tensors, dtype), "mean", async_op=True))

    def starting_at(self, first: int) -> Mean:
        """This exchange for a bucket of a group's entries from `first` on (a mean depends on no index)."""
        return self


MEAN = Mean()


@dataclass(frozen=True)
class Vote:
    """The majority vote of the replicas' signs, in wire format `fmt` (vote.py); `first`: the index of its
    entry 0 in the coins' numbering (a bucket of an element-wise group's entries: the group's one vote, cut)."""

    fmt: VoteFormat
    first: int = 0

    def signs(self, positive: torch.Tensor, replicate: Axis, seed: int, abstain: torch.Tensor | None = None,
              silent: torch.Tensor | None = None):
        """V = sign(Σ_replicas sᵢ), int8 (n,) (see VoteFormat.exchange: `abstain` per entry, `silent`
        per matrix)."""
        return (yield from self.fmt.exchange(positive, replicate, seed, abstain, silent, self.first))

    def starting_at(self, first: int) -> Vote:
        """This vote for a bucket of a group's entries from `first` on: their coins are the group's."""
        return Vote(self.fmt, first)
