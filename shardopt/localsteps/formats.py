"""The outer exchange of local steps (docs/design.md §10): how the replicas combine their pseudo-gradients.

At a sync each replica holds x = Δ + e, flat (n,) fp32: its pseudo-gradient Δ = θ_start − θ plus its
error feedback e. A format sends x in its wire form and returns, identical on every replica,

    mean   = the replicas' mean of the decoded x          (n,) fp32, bitwise equal everywhere
    own    = this replica's own decoded x                 (n,) fp32 (e ← x − own where lossy)
    nonfinite = 0-d bool: x was non-finite on some replica (the round is then discarded)

The non-finite flag rides in the format's own collectives (a slot beside the scales), so a sync sends
nothing extra. Bytes one replica sends, n entries (padding included), M replicas, AR(s) = 2s(M−1)/M:

| format | wire | bytes |
|---|---|---|
| "mean" | fp32 all-reduce of x and the flag | AR(4(n+1)) |
| "mean_bf16" | bf16 all-reduce of x and the flag | AR(2(n+1)) |
| "int8", "int4" | x in blocks of `block`, absmax scale per block, codes of `bits` bits; all-to-all of each owner's chunk (codes, the scales, the flag), owners decode, average and requantize, all-gather of the owners' chunks | 2(M−1)·(n_p·bits/(8M) + 4·n_p/(block·M) + 4), n_p = n padded to block·M |
| "lowrank" | per matrix Dion's P (a×r) and R (b×r) means in bf16 (`LowRank`), the rest by "sign_vote" | Σ AR(2(a+b)·r) + the rest's |
| "sign_vote" | 1-bit vote of sign(x) in vote.py's format (zeros abstain, as Lion's) times the block's mean abs x averaged over the replicas | vote bytes + AR(4(⌈n/block⌉ + 1)) |
| "sign_mean" | every replica's 1-bit sign(x) and its own per-block mean abs x, all-gathered; the mean of the replicas' scaled signs | (M−1)·(⌈n/8⌉ + 4(⌈n/block⌉ + 1)) |

On one replica nothing is exchanged or rounded: mean = own = x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..wire.comm import Axis, collective_bytes
from ..wire.signs import pack_signs, padded_length, unpack_signs
from ..wire.vote import VOTES, vote_format

DEFAULT_BLOCK = 4096
FLAG_SLOT = 1   # one fp32 beside the scales: 1.0 where x held a NaN/inf


# ---- pure math -----------------------------------------------------------------------------------
def nonfinite_flag(x: torch.Tensor) -> torch.Tensor:
    """(1,) fp32: 1.0 if x holds a NaN or inf, else 0.0 (no device sync)."""
    return (~torch.isfinite(x)).any().float().reshape(1)


def blocks_of(x: torch.Tensor, block: int, multiple: int = 1) -> torch.Tensor:
    """x (n,) zero-padded to a multiple of block·multiple and viewed as (n_p/block, block)."""
    padded = padded_length(x.numel(), block * multiple)
    return torch.nn.functional.pad(x, (0, padded - x.numel())).view(-1, block)


def absmax_scales(blocks: torch.Tensor, qmax: int) -> torch.Tensor:
    """s_b = max_i |x_bi| / qmax per block: blocks (nb, block) → (nb,) fp32."""
    return blocks.abs().amax(dim=1) / qmax


def quantize(blocks: torch.Tensor, scales: torch.Tensor, qmax: int) -> torch.Tensor:
    """q_bi = clamp(round(x_bi / s_b), −qmax, qmax) as int8 (0 where s_b = 0): (nb, block) → (nb, block)."""
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
    return torch.clamp(torch.round(blocks / safe), -qmax, qmax).to(torch.int8)


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x̂_bi = q_bi · s_b: codes (…, nb, block) int8, scales (…, nb) → (…, nb, block) fp32."""
    return codes.float() * scales.unsqueeze(-1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes in [−7, 7] (…, 2k) int8 → (…, k) uint8, entry 2j in the low nibble and 2j+1 in the high,
    each stored as q + 8."""
    nibbles = (codes.to(torch.int16) + 8).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: (…, k) uint8 → (…, 2k) int8."""
    low, high = (packed & 0x0F).to(torch.int8) - 8, (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).flatten(-2)


def block_mean_abs(x: torch.Tensor, block: int) -> torch.Tensor:
    """m_b = mean over the entries of block b of |x| (the last block may be short): (n,) → (⌈n/block⌉,)."""
    n = x.numel()
    sums = blocks_of(x.abs(), block).sum(dim=1)
    counts = torch.full_like(sums, block)
    counts[-1] = n - block * (sums.numel() - 1)
    return sums / counts


def spread_blocks(values: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Per-block values (…, nb) repeated over their blocks' entries, cut to (…, n)."""
    return values.repeat_interleave(block, dim=-1)[..., :n]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor (…, k) as uint8 (…, k·itemsize)."""
    return tensor.contiguous().view(torch.uint8)


# ---- the formats ---------------------------------------------------------------------------------
class OuterFormat:
    """One outer exchange format: `bytes(numel, replicas)` (what one replica sends, padding, scales and
    the flag included) and `exchange(x, replicate, seed)`, a generator of collectives (schedule.py)
    that returns (mean, own, nonfinite) as the module docstring says. `lossy`: own ≠ x in general, so
    the replica keeps an error feedback e."""

    name = ""
    lossy = True

    def bytes(self, numel: int, replicas: int) -> int:
        raise NotImplementedError

    def exchange(self, x: torch.Tensor, replicate: Axis, seed: int):
        raise NotImplementedError

    def commit(self) -> None:
        """Keep the state the last exchange prepared (LowRank's Q); called only when its round is kept."""


class Mean(OuterFormat):
    """The replicas' mean of x in `wire` (fp32: DiLoCo's, lossless; bf16: x rounded first, so the
    error feedback keeps what the rounding dropped), one all-reduce with the flag appended."""

    def __init__(self, name: str, wire: torch.dtype):
        self.name, self.wire, self.lossy = name, wire, wire != torch.float32

    def bytes(self, numel: int, replicas: int) -> int:
        return collective_bytes("all_reduce", (numel + FLAG_SLOT) * torch.empty(0, dtype=self.wire).element_size(),
                                replicas)

    def exchange(self, x, replicate, seed):
        if replicate.size == 1:
            return x, x, nonfinite_flag(x)[0] > 0
        wire = torch.cat([x, nonfinite_flag(x)]).to(self.wire)
        own = wire[:-1].float()
        mean = (yield replicate.all_reduce(wire, "mean", async_op=True)).float()
        return mean[:-1], own, mean[-1] > 0


class Quantized(OuterFormat):
    """x in blocks of `block` entries, each as `bits`-bit codes (int8: 127 levels each side, int4:
    7, two codes a byte) times its absmax scale. Owners: x padded to block·M entries is cut into M
    chunks of whole blocks; replica j owns chunk j. One all-to-all sends each owner its chunk (codes,
    scales, flag) from every replica; the owner decodes them, averages in replica order, requantizes
    the mean with its own absmax scales; one all-gather gives everyone every owner's chunk, which
    everyone decodes alike (so the mean is bitwise equal everywhere). own = decode(quantize(x)).
    The mean is quantized twice (the owners' requantization is not fed back: it is the same for every
    replica)."""

    def __init__(self, name: str, bits: int, block: int = DEFAULT_BLOCK):
        if block < 2 or block % 2:
            raise ValueError(f"block must be an even number of entries ≥ 2 (the int4 codes pack two a byte), "
                             f"got {block}")
        self.name, self.bits, self.block, self.qmax = name, bits, block, 2 ** (bits - 1) - 1

    def _chunk_bytes(self, numel: int, replicas: int) -> tuple[int, int, int]:
        """(code bytes, scales, bytes) of one owner's chunk: codes, scales and the flag."""
        entries = padded_length(numel, self.block * replicas) // replicas
        scales = entries // self.block
        codes = entries * self.bits // 8
        return codes, scales, codes + 4 * (scales + FLAG_SLOT)

    def bytes(self, numel: int, replicas: int) -> int:
        chunk = self._chunk_bytes(numel, replicas)[2]
        return collective_bytes("all_to_all", chunk * replicas, replicas) + collective_bytes("all_gather", chunk,
                                                                                             replicas)

    def _encode(self, blocks: torch.Tensor, flag: torch.Tensor, owners: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload (owners, chunk bytes) uint8, this encoding's decoded blocks) of blocks (nb, block)."""
        scales = absmax_scales(blocks, self.qmax)
        codes = quantize(blocks, scales, self.qmax)
        wire_codes = pack_int4(codes) if self.bits == 4 else codes.view(torch.uint8)
        slots = torch.cat([scales.view(owners, -1), flag.expand(owners, FLAG_SLOT)], dim=1)
        return torch.cat([wire_codes.reshape(owners, -1), as_bytes(slots)], dim=1), dequantize(codes, scales)

    def _decode(self, payload: torch.Tensor, code_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """payload (k, chunk bytes) → (decoded (k, blocks, block) fp32, flags (k,))."""
        wire_codes, slots = payload[:, :code_bytes], payload[:, code_bytes:].contiguous().view(torch.float32)
        codes = unpack_int4(wire_codes) if self.bits == 4 else wire_codes.view(torch.int8)
        scales = slots[:, :-FLAG_SLOT]
        return dequantize(codes.reshape(*scales.shape, self.block), scales), slots[:, -1]

    def exchange(self, x, replicate, seed):
        n, owners = x.numel(), replicate.size
        if owners == 1:
            return x, x, nonfinite_flag(x)[0] > 0
        flag = nonfinite_flag(x)
        code_bytes = self._chunk_bytes(n, owners)[0]
        payload, own = self._encode(blocks_of(torch.nan_to_num(x), self.block, owners), flag, owners)
        received = (yield replicate.all_to_all(payload.reshape(-1), async_op=True)).view(owners, -1)
        decoded, flags = self._decode(received, code_bytes)              # my chunk from every replica
        owned_mean = decoded.sum(dim=0) / replicate.contributors   # (torchft: a healing replica sent zeros)
        owned_flag = torch.maximum(flags.max(), nonfinite_flag(owned_mean)[0]).reshape(1)
        owned_payload, _ = self._encode(torch.nan_to_num(owned_mean), owned_flag, 1)
        gathered = (yield replicate.all_gather(owned_payload.reshape(-1), async_op=True)).view(owners, -1)
        mean, flags = self._decode(gathered, code_bytes)
        return mean.reshape(-1)[:n], own.reshape(-1)[:n], flags.max() > 0


class SignVote(OuterFormat):
    """V = sign(Σ_replicas sign(x)) in the 1-bit vote formats of vote.py (`vote`; "auto": the fewest
    bytes at this replica count), an exact zero abstaining (Lion's rule), times per block of `block`
    entries the replicas' mean of m_b = mean |x| over the block, sent with the flag in one fp32
    all-reduce. own = sign(x)·m_b (this replica's own scale: the scaled-sign compressor that the error
    feedback corrects). The vote's ties draw coins from `seed`, equal on every replica."""

    name = "sign_vote"

    def __init__(self, vote: str = "alltoall_1bit", block: int = DEFAULT_BLOCK):
        if vote not in VOTES:
            raise ValueError(f"vote must be one of {VOTES}, got {vote!r}")
        if block < 1:
            raise ValueError(f"block must be ≥ 1 entries, got {block}")
        self.vote, self.block = vote, block

    def bytes(self, numel: int, replicas: int) -> int:
        scales = -(-numel // self.block)
        vote = vote_format(self.vote, numel, replicas).bytes(numel, replicas) if numel else 0
        return vote + collective_bytes("all_reduce", 4 * (scales + FLAG_SLOT), replicas)

    def exchange(self, x, replicate, seed, flag: torch.Tensor | None = None):
        """As OuterFormat.exchange; `flag` (1,): the non-finite flag to send (default x's own). With no
        entries only the flag is sent."""
        n, flag = x.numel(), nonfinite_flag(x) if flag is None else flag
        if replicate.size == 1:
            return x, x, flag[0] > 0
        own_scale = block_mean_abs(torch.nan_to_num(x), self.block) if n else x
        own = torch.sign(x) * spread_blocks(own_scale, self.block, n)
        slots = yield replicate.all_reduce(torch.cat([own_scale, flag]), "mean", async_op=True)
        if not n:
            return x, own, slots[-1] > 0
        fmt = vote_format(self.vote, n, replicate.size)
        voted = yield from fmt.exchange(x > 0, replicate, seed, abstain=x == 0)
        return voted.float() * spread_blocks(slots[:-FLAG_SLOT], self.block, n), own, slots[-1] > 0


class SignMean(OuterFormat):
    """own = s·m_b, s = +1 where x > 0 else −1, m_b = mean |x| over the entry's block of `block` (the
    scaled sign, EF-signSGD's compressor); one all-gather of every replica's packed s, m and flag;
    mean = (1/M)·Σ_r own_r in replica order, bitwise equal everywhere. With each replica's error
    feedback e_r = x_r − own_r, mean + (1/M)·Σ_r e_r is exactly the replicas' mean x: everything the
    wire dropped is carried to the next sync. (A majority vote drops what it outvotes, and at even M
    its ties, for good: at M = 2 every entry the two replicas disagree on moves by a coin's ±m_b.)
    Bytes grow with M as an all-gather's: at M = 2 those of sign_vote, at M = 8 about 4× them."""

    name = "sign_mean"

    def __init__(self, block: int = DEFAULT_BLOCK):
        if block < 1:
            raise ValueError(f"block must be ≥ 1 entries, got {block}")
        self.block = block

    def _sign_bytes(self, numel: int) -> int:
        return padded_length(numel, 8) // 8

    def bytes(self, numel: int, replicas: int) -> int:
        payload = self._sign_bytes(numel) + 4 * (-(-numel // self.block) + FLAG_SLOT)
        return collective_bytes("all_gather", payload, replicas)

    def exchange(self, x, replicate, seed):
        n, flag = x.numel(), nonfinite_flag(x)
        if replicate.size == 1:
            return x, x, flag[0] > 0
        finite = torch.nan_to_num(x)
        scales = block_mean_abs(finite, self.block) if n else finite
        own = torch.where(finite > 0, 1.0, -1.0) * spread_blocks(scales, self.block, n)
        payload = torch.cat([pack_signs(finite > 0), as_bytes(torch.cat([scales, flag]))])
        rows = yield replicate.all_gather(payload, async_op=True)                  # (M, payload bytes)
        sign_bytes = self._sign_bytes(n)
        slots = rows[:, sign_bytes:].contiguous().view(torch.float32)              # (M, blocks + 1)
        positive = unpack_signs(rows[:, :sign_bytes], n)                           # (M, n)
        decoded = torch.where(positive, 1.0, -1.0) * spread_blocks(slots[:, :-FLAG_SLOT], self.block, n)
        return decoded.sum(dim=0) / replicate.contributors, own, slots[:, -1].max() > 0   # (torchft: see Axis)


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


class LowRank(OuterFormat):
    """Dion's power iteration on each matrix's x (its block B_ij in Dion's orientation, dion.py), the
    rest of x by `rest` (a SignVote, which also carries the flag of the whole x):

        P = orthonormalize(mean_replicas(Σ_b-axes B·Q))     exchange.FactorMean.basis (P in `wire`)
        R_j = Σ_a-axis Bᵀ·P,  R̄ = mean_replicas(R_j)        (R_j rounded to `wire`: what is sent)
        mean = P·R̄ᵀ,  own = P·R_jᵀ                          (so mean = mean_replicas(own): e telescopes)
        Q ← R̄ / (‖R̄[:, j]‖ + ε)                             at `commit`, when the round is kept

    `axes`: the shard and tensor axes (Axes-like, .shard and .tensor) that split the matrices."""

    name = "lowrank"

    def __init__(self, matrices: list[LowRankMatrix], rest: SignVote, axes, wire: torch.dtype = torch.bfloat16,
                 epsilon: float = 1e-8):
        self.matrices, self.rest, self.axes, self.wire, self.epsilon = matrices, rest, axes, wire, epsilon
        self._next_q: list[torch.Tensor] = []

    def _sides(self, matrix: LowRankMatrix):
        from ..algorithms.dion import oriented_axes, oriented_block, oriented_shape
        a_names, b_names = oriented_axes(matrix.layout)
        return (oriented_shape(matrix.layout), oriented_block(matrix.layout), [getattr(self.axes, n) for n in a_names],
                [getattr(self.axes, n) for n in b_names], a_names)

    def bytes(self, numel: int, replicas: int) -> int:
        """Per matrix: AR(P rows·r) + AR(b_j·r) in `wire` (P rows: a, a_i when an axis splits a, ⌈a/F⌉ when
        F shard ranks split b); the rest by `rest.bytes`."""
        itemsize, total, rest = torch.empty(0, dtype=self.wire).element_size(), 0, numel
        for matrix in self.matrices:
            (a, _), ((_, a_i), (_, b_j)), a_axes, b_axes, _ = self._sides(matrix)
            rows = a_i if a_axes else -(-a // b_axes[-1].size) if b_axes else a
            total += sum(collective_bytes("all_reduce", side * matrix.rank * itemsize, replicas) for side in (rows, b_j))
            rest -= torch.Size(matrix.shape).numel()
        return total + self.rest.bytes(rest, replicas)

    def exchange(self, x, replicate, seed):
        from ..wire.exchange import FactorMean, replicate_mean
        from ..algorithms.lowrank import column_normalize, orthonormalize
        self._next_q = []
        if replicate.size == 1:
            return x, x, nonfinite_flag(x)[0] > 0
        mean, own = x.clone(), x.clone()
        flag, covered = nonfinite_flag(x), torch.zeros(x.numel(), dtype=torch.bool, device=x.device)
        for matrix in self.matrices:
            (_, _), _, a_axes, b_axes, a_names = self._sides(matrix)
            numel = torch.Size(matrix.shape).numel()
            X = torch.nan_to_num(x[matrix.offset:matrix.offset + numel]).view(matrix.shape)
            B = (X.mT if matrix.layout.transpose else X).unsqueeze(0)                       # (1, a_i, b_j)
            Q = matrix.Q.float().unsqueeze(0)
            factors = FactorMean(low_rank=True, wire=self.wire, rank=matrix.rank)
            a_parts = matrix.layout.axis_parts(a_names[0]) if a_names else ()
            P = yield from factors.basis(B @ Q, a_axes, a_parts, b_axes, replicate, lambda P: orthonormalize(P))
            R = B.mT @ P
            for axis in a_axes:
                R = yield axis.all_reduce(R, "sum", async_op=True)
            R_sent = R.to(self.wire).float()
            R_mean = yield from replicate_mean(R, replicate, self.wire)
            col_sq_norms = (R_mean * R_mean).sum(dim=-2)
            for axis in b_axes:
                col_sq_norms = yield axis.all_reduce(col_sq_norms, "sum", async_op=True)
            self._next_q.append(column_normalize(R_mean, col_sq_norms, Q, self.epsilon)[0])
            for out, factor in ((mean, R_mean), (own, R_sent)):
                decoded = P[0] @ factor[0].mT                                             # (a_i, b_j)
                out[matrix.offset:matrix.offset + numel] = (decoded.mT if matrix.layout.transpose else decoded
                                                            ).reshape(-1)
            covered[matrix.offset:matrix.offset + numel] = True
        rest_mean, rest_own, nonfinite = yield from self.rest.exchange(x[~covered], replicate, seed, flag)
        mean[~covered], own[~covered] = rest_mean, rest_own
        return mean, own, nonfinite

    def commit(self) -> None:
        """Q ← the column-normalized R̄ of the exchange just finished (call only for a kept round)."""
        for matrix, Q in zip(self.matrices, self._next_q):
            matrix.Q.copy_(Q)


FORMATS = {"mean": lambda **_: Mean("mean", torch.float32),
           "mean_bf16": lambda **_: Mean("mean_bf16", torch.bfloat16),
           "int8": lambda block=DEFAULT_BLOCK, **_: Quantized("int8", 8, block),
           "int4": lambda block=DEFAULT_BLOCK, **_: Quantized("int4", 4, block),
           "sign_vote": lambda block=DEFAULT_BLOCK, vote="alltoall_1bit", **_: SignVote(vote, block),
           "sign_mean": lambda block=DEFAULT_BLOCK, **_: SignMean(block)}
EXCHANGES = (*FORMATS, "lowrank")   # lowrank: built per fragment by LocalSteps (it needs the matrices)


def outer_format(exchange: str, **options) -> OuterFormat:
    """The format named `exchange` (EXCHANGES), with its options (block, vote); for "lowrank" the
    sign_vote of its non-matrix entries (LocalSteps builds the LowRank around it)."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    return FORMATS["sign_vote" if exchange == "lowrank" else exchange](**options)
