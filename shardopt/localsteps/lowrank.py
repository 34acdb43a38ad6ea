"""The outer "lowrank" exchange (docs/design.md §10): Dion's power iteration on each matrix's pseudo-gradient,
the rest by sign_vote. Built per fragment, around the warm-start Q of its matrices (the outer state)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..algorithms.dion import compressed, init_state, next_q, power_iteration, q_shape, rank_of
from ..algorithms.lowrank import orthonormalize
from ..layout.placement import local, matrix_layout
from ..wire.comm import Axes
from ..wire.seeds import mix_seed
from ..algorithms.factors import FactorMean
from .codec import nonfinite_flag
from .formats import OuterFormat, SignVote


def dion_group(rank_fraction: float) -> dict:
    """The Dion param group the outer power iteration runs as: r = ⌈rank_fraction·min(m, n)⌉, fp32 Q."""
    return {"rank_fraction": rank_fraction, "rank_multiple_of": 1, "state_dtype": "float32", "split": None,
            "algorithm": "dion"}


def is_low_rank(param: torch.Tensor, rank_fraction: float) -> bool:
    """A 2-D param whose factors are fewer bytes than itself ((a+b)·r < a·b): exchanged by its factors."""
    return param.ndim == 2 and compressed(matrix_layout(param), dion_group(rank_fraction))


def initial_q(param: torch.Tensor, rank_fraction: float, seed: int) -> torch.Tensor | None:
    """Q₀ (b×r, this rank's rows of b; N(0, 1) from `seed`, the same on every replica), as Dion's own; None
    for a param not exchanged by its factors."""
    return init_state(param, dion_group(rank_fraction), seed)["Q"] if is_low_rank(param, rank_fraction) else None


@dataclass
class LowRankMatrix:
    """One matrix of a "lowrank" exchange: where its local block sits in x (`offset`, `shape`, the
    param's local shape), its layout (placement.py), its rank r and its warm-start Q (b_j × r, the
    local rows of b; updated at commit)."""

    offset: int
    shape: tuple[int, ...]
    layout: object
    rank: int
    Q: torch.Tensor

    @property
    def numel(self) -> int:
        return torch.Size(self.shape).numel()


def _matrices(params: list, rank_fraction: float, q_of) -> list[LowRankMatrix]:
    """The low-rank matrices among `params` (their local tensors laid end to end in x), with Q = q_of(param)."""
    matrices, offset = [], 0
    for param in params:
        if is_low_rank(param, rank_fraction):
            layout = matrix_layout(param)
            matrices.append(LowRankMatrix(offset, tuple(local(param).shape), layout,
                                          rank_of(layout, dion_group(rank_fraction)), q_of(param)))
        offset += local(param).numel()
    return matrices


def _meta_q(param: torch.Tensor, rank_fraction: float) -> torch.Tensor:
    """A Q of the right local shape on the meta device (traffic.py's counting run)."""
    return torch.empty(q_shape(param, dion_group(rank_fraction))[1], device="meta")


class LowRank(OuterFormat):
    """Dion's power iteration on each matrix's x (its block B_ij in Dion's orientation, dion.py), the
    rest of x by `rest` (a SignVote, which also carries the flag of the whole x):

        P = orthonormalize(mean_replicas(Σ_b-axes B·Q))     dion.power_iteration (P in `wire`)
        R_j = Σ_a-axis Bᵀ·P,  R̄ = mean_replicas(R_j)        (R_j rounded to `wire`: what is sent)
        mean = P·R̄ᵀ,  own = P·R_jᵀ                          (so mean = mean_replicas(own): e telescopes)
        Q ← R̄ / (‖R̄[:, j]‖ + ε)                             dion.next_q, at `commit` (a kept round)

    `axes`: the shard and tensor axes (Axes-like, .shard and .tensor) that split the matrices."""

    name = "lowrank"

    def __init__(self, matrices: list[LowRankMatrix], rest: SignVote, axes, wire: torch.dtype = torch.bfloat16,
                 epsilon: float = 1e-8):
        self.matrices, self.rest, self.axes, self.wire, self.epsilon = matrices, rest, axes, wire, epsilon
        self._next_q: list[torch.Tensor] = []

    def _rest(self, n: int) -> list[slice]:
        """The pieces of x (n,) between and after the matrices, in order (some may be empty)."""
        pieces, start = [], 0
        for matrix in self.matrices:
            pieces.append(slice(start, matrix.offset))
            start = matrix.offset + matrix.numel
        return [*pieces, slice(start, n)]

    def exchange(self, x, replicate, seed):
        self._next_q = []
        if replicate.size == 1:
            return x, x, nonfinite_flag(x)[0] > 0
        mean, own, flag = x.clone(), x.clone(), nonfinite_flag(x)
        axes = Axes(replicate, self.axes.shard, self.axes.tensor)
        for matrix in self.matrices:
            covered = slice(matrix.offset, matrix.offset + matrix.numel)
            X = torch.nan_to_num(x[covered]).view(matrix.shape)
            B = (X.mT if matrix.layout.transpose else X).unsqueeze(0)                       # (1, a_i, b_j)
            Q = matrix.Q.float().unsqueeze(0)
            factors = FactorMean(low_rank=True, wire=self.wire, rank=matrix.rank)
            P, R, R_mean = yield from power_iteration(B, Q, layout=matrix.layout, exchange=factors, axes=axes,
                                                      orthonormalize_share=orthonormalize)
            Q_next = yield from next_q(R_mean, Q, layout=matrix.layout, axes=axes, epsilon=self.epsilon)
            self._next_q.append(Q_next[0])
            for out, factor in ((mean, R_mean), (own, R.to(self.wire).float())):   # R as sent, rounded to wire
                decoded = P[0] @ factor[0].mT                                             # (a_i, b_j)
                out[covered] = (decoded.mT if matrix.layout.transpose else decoded).reshape(-1)
        rest = self._rest(x.numel())
        sizes = [piece.stop - piece.start for piece in rest]
        rest_mean, rest_own, nonfinite = yield from self.rest.exchange(torch.cat([x[piece] for piece in rest]),
                                                                       replicate, seed, flag)
        for piece, piece_mean, piece_own in zip(rest, rest_mean.split(sizes), rest_own.split(sizes)):
            mean[piece], own[piece] = piece_mean, piece_own
        return mean, own, nonfinite

    def commit(self) -> None:
        """Q ← the column-normalized R̄ of the exchange just finished (call only for a kept round)."""
        for matrix, Q in zip(self.matrices, self._next_q):
            matrix.Q.copy_(Q)


def lowrank_format(params: list, rank_fraction: float, rest: SignVote, axes, states=None) -> LowRank:
    """The "lowrank" format of a fragment's params, over the Q of its matrices in `states` (param →
    OuterState; None: meta Qs, a format to count bytes with)."""
    q_of = (lambda param: _meta_q(param, rank_fraction)) if states is None else (lambda param: local(states[param].Q))
    return LowRank(_matrices(params, rank_fraction, q_of), rest, axes)


class FragmentFormats:
    """The format each fragment of a LocalSteps exchanges by: `base` (formats.outer_format) for every
    fragment; for "lowrank" (`rank_fraction` set) a LowRank per fragment over its matrices' warm-start Q,
    `base` (a SignVote) exchanging the rest."""

    def __init__(self, base: OuterFormat, rank_fraction: float | None, seed: int):
        self.base, self.rank_fraction, self.seed = base, rank_fraction, seed

    def initial_q(self, param: torch.Tensor, slot: int) -> torch.Tensor | None:
        """The outer state's Q of the param at `slot` (initial_q, seeded by slot; None without "lowrank")."""
        return None if self.rank_fraction is None else initial_q(param, self.rank_fraction, mix_seed(self.seed, slot))

    def of(self, params: list, axes: Axes, states=None) -> OuterFormat:
        """The format of a fragment's `params` (lowrank_format over `states`' Qs, or meta Qs to count bytes)."""
        return self.base if self.rank_fraction is None else lowrank_format(params, self.rank_fraction, self.base,
                                                                          axes, states)
