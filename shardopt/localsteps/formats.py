"""The outer exchange of local steps (docs/design.md §10): how the replicas combine their pseudo-gradients.

At a sync each replica holds x = Δ + e, flat (n,) fp32: its pseudo-gradient Δ = θ_start − θ plus its
error feedback e. A format sends x in its wire form and returns, identical on every replica,

    mean   = the replicas' mean of the decoded x          (n,) fp32, bitwise equal everywhere
    own    = this replica's own decoded x                 (n,) fp32 (e ← x − own where lossy)
    nonfinite = 0-d bool: x was non-finite on some replica (the round is then discarded)

The non-finite flag rides in the format's own collectives (a slot beside the scales), so a sync sends
nothing extra. Bytes one replica sends, n entries (padding included), M replicas, AR(s) = 2s(M−1)/M (what
traffic.py counts by running the exchange itself on a counting axis):

| format | wire | bytes |
|---|---|---|
| "mean" | fp32 all-reduce of x and the flag | AR(4(n+1)) |
| "mean_bf16" | bf16 all-reduce of x and the flag | AR(2(n+1)) |
| "int8", "int4" | x in blocks of `block`, absmax scale per block, codes of `bits` bits; all-to-all of each owner's chunk (codes, the scales, the flag), owners decode, average and requantize, all-gather of the owners' chunks | 2(M−1)·(n_p·bits/(8M) + 4·n_p/(block·M) + 4), n_p = n padded to block·M |
| "lowrank" | per matrix Dion's P (a×r) and R (b×r) means in bf16 (`LowRank`), the rest by "sign_vote" | Σ AR(2(a+b)·r) + the rest's |
| "sign_vote" | 1-bit vote of sign(x) in vote.py's format (zeros abstain, as Lion's) times the block's mean abs x averaged over the replicas | vote bytes + AR(4(⌈n/block⌉ + 1)) |
| "sign_mean" | every replica's 1-bit sign(x) and its own per-block mean abs x, all-gathered; the mean of the replicas' scaled signs | (M−1)·(⌈n/8⌉ + 4(⌈n/block⌉ + 1)) |
| "auto" | "sign_mean" at M ≤ 2, "sign_vote" from 3 (`ByReplicas`: the measured best at each M, chosen per exchange) | that format's |
| "topk" | per chunk of `block` the k = max(1, round(density·block)) largest abs x, each a packed (2 + ⌈log2 block⌉)-bit code (offset, sign, big), with the chunk's fp32 absmax and the flag, all-gathered; the mean of the replicas' decoded picks | (M−1)·(⌈n_c·k·(2 + ⌈log2 block⌉)/8⌉ + 4(n_c + 1)), n_c = ⌈n/block⌉ |

On one replica nothing is exchanged or rounded: mean = own = x.
"""

from __future__ import annotations

import torch

from ..wire.comm import Axis
from ..wire.signs import pack_signs, padded_length, unpack_signs
from ..wire.vote import VOTES, vote_format
from .codec import (absmax_scales, as_bytes, block_mean_abs, blocks_of, decode_picks, dequantize, encode_picks,
                    nonfinite_flag, offset_bits, pack_bits, pack_int4, picks_per_chunk, quantize, select_topk,
                    spread_blocks, unpack_bits, unpack_int4)

DEFAULT_BLOCK = 4096     # "int8", "int4", "topk": entries per scale (per chunk) unless `block` says otherwise
SIGN_BLOCK = 128         # "sign_vote", "sign_mean": a scale per 128 entries (block 4096 diverged at width 512:
                         # docs/tuning.md, "The defaults")
DEFAULT_DENSITY = 0.02   # "topk": the fraction of each chunk's entries sent
FLAG_SLOT = 1   # one fp32 beside the scales: 1.0 where x held a NaN/inf


# ---- the formats ---------------------------------------------------------------------------------
class OuterFormat:
    """One outer exchange format: `exchange(x, replicate, seed)`, a generator of collectives (schedule.py)
    that returns (mean, own, nonfinite) as the module docstring says. `lossy`: own ≠ x in general, so
    the replica keeps an error feedback e."""

    name = ""
    lossy = True

    def exchange(self, x: torch.Tensor, replicate: Axis, seed: int):
        raise NotImplementedError

    def commit(self) -> None:
        """Keep the state the last exchange prepared (LowRank's Q); called only when its round is kept."""


class Mean(OuterFormat):
    """The replicas' mean of x in `wire` (fp32: DiLoCo's, lossless; bf16: x rounded first, so the
    error feedback keeps what the rounding dropped), one all-reduce with the flag appended."""

    def __init__(self, name: str, wire: torch.dtype):
        self.name, self.wire, self.lossy = name, wire, wire != torch.float32

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

    def _code_bytes(self, numel: int, owners: int) -> int:
        """Bytes of the codes in one owner's chunk (its scales and the flag follow them)."""
        return padded_length(numel, self.block * owners) // owners * self.bits // 8

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
        code_bytes = self._code_bytes(n, owners)
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

    def __init__(self, vote: str = "alltoall_1bit", block: int = SIGN_BLOCK):
        if vote not in VOTES:
            raise ValueError(f"vote must be one of {VOTES}, got {vote!r}")
        if block < 1:
            raise ValueError(f"block must be ≥ 1 entries, got {block}")
        self.vote, self.block = vote, block

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

    def __init__(self, block: int = SIGN_BLOCK):
        if block < 1:
            raise ValueError(f"block must be ≥ 1 entries, got {block}")
        self.block = block

    def _sign_bytes(self, numel: int) -> int:
        return padded_length(numel, 8) // 8

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


class TopK(OuterFormat):
    """Sparse top-k with error feedback. x is cut into chunks of `block` entries (the last zero-padded);
    per chunk c the k = max(1, round(density·block)) entries of largest |x| (codec.select_topk) are sent
    as one (2 + ⌈log2 block⌉)-bit code each: the within-chunk offset, positive = x > 0 and big = |x| ≥ ¾·s_c,
    decoding to ±s_c (big) or ±s_c/2, s_c = max |x| over the chunk (fp32, one per chunk). One all-gather
    of every replica's packed codes, scales and flag (codec.pack_bits: one bit stream, least significant
    bit first); every replica decodes every row alike and sums them in replica order, so the mean
    (1/M)·Σ_r own_r is bitwise equal everywhere. own = the decoded own picks (0 off them): the error
    feedback e = x − own keeps every entry not sent, and each sent one's rounding."""

    name = "topk"

    def __init__(self, block: int = DEFAULT_BLOCK, density: float = DEFAULT_DENSITY):
        if block < 1:
            raise ValueError(f"block must be ≥ 1 entries, got {block}")
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1] (the fraction of each chunk that \"topk\" sends), "
                             f"got {density!r}")
        self.block, self.k, self.code_bits = block, picks_per_chunk(block, density), 2 + offset_bits(block)

    def _decode(self, rows: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """rows (R, payload bytes) → (decoded chunks (R, chunks, block) fp32, flags (R,))."""
        code_bytes = rows.shape[1] - 4 * (chunks + FLAG_SLOT)
        slots = rows[:, code_bytes:].clone(memory_format=torch.contiguous_format).view(torch.float32)   # (R, chunks+1)
        codes = unpack_bits(rows[:, :code_bytes], self.code_bits, chunks * self.k).view(len(rows), chunks, self.k)
        return decode_picks(codes, slots[:, :-FLAG_SLOT], self.block), slots[:, -1]

    def exchange(self, x, replicate, seed):
        n, flag = x.numel(), nonfinite_flag(x)
        if replicate.size == 1:
            return x, x, flag[0] > 0
        blocks = blocks_of(torch.nan_to_num(x), self.block)                       # (chunks, block)
        scales = blocks.abs().amax(dim=1)
        offsets, values = select_topk(blocks, self.k)
        codes = pack_bits(encode_picks(offsets, values, scales).reshape(-1), self.code_bits)
        payload = torch.cat([codes, as_bytes(torch.cat([scales, flag]))])
        own, _ = self._decode(payload.unsqueeze(0), blocks.shape[0])
        rows = yield replicate.all_gather(payload, async_op=True)                 # (M, payload bytes)
        decoded, flags = self._decode(rows, blocks.shape[0])
        mean = decoded.sum(dim=0) / replicate.contributors                        # (torchft: see Axis)
        return mean.reshape(-1)[:n], own.reshape(-1)[:n], flags.max() > 0


def by_replicas(replicas: int) -> str:
    """The 1-bit format "auto" names at M = `replicas`: "sign_mean" up to 2 (there it sends sign_vote's bytes,
    and measured 0.05–0.15 lower val loss with Muon, Sign-Muon and Dion inside: docs/tuning.md), "sign_vote"
    from 3 (sign_mean's all-gather grows as M − 1 signs per entry; at M = 4 it sends 2.3× the vote's, and at
    M = 3 and 8 sign_vote synced more often for the same bytes ended level and lower: docs/tuning.md)."""
    return "sign_mean" if replicas <= 2 else "sign_vote"


def resolve(exchange: str, replicas: int) -> str:
    """The format `exchange` runs among `replicas` replicas: "auto" → `by_replicas`; any other name as it is."""
    return by_replicas(replicas) if exchange == "auto" else exchange


class ByReplicas(OuterFormat):
    """"auto": each exchange through `by_replicas(M)` of the exchange's own M, so under torchft, whose M is
    the round's quorum, the format follows the quorum round by round. Both are scaled signs with error
    feedback, e = x − own, which carries over from one to the other unchanged."""

    name = "auto"

    def __init__(self, vote: str = "alltoall_1bit", block: int = SIGN_BLOCK):
        self.formats = {"sign_mean": SignMean(block), "sign_vote": SignVote(vote, block)}
        self.block = block

    def at(self, replicas: int) -> OuterFormat:
        """The format an exchange among `replicas` replicas runs."""
        return self.formats[by_replicas(replicas)]

    def exchange(self, x, replicate, seed):
        return (yield from self.at(replicate.size).exchange(x, replicate, seed))


OUTER_FORMATS = {"mean": lambda **_: Mean("mean", torch.float32),
                 "mean_bf16": lambda **_: Mean("mean_bf16", torch.bfloat16),
                 "int8": lambda block=DEFAULT_BLOCK, **_: Quantized("int8", 8, block),
                 "int4": lambda block=DEFAULT_BLOCK, **_: Quantized("int4", 4, block),
                 "sign_vote": lambda block=SIGN_BLOCK, vote="alltoall_1bit", **_: SignVote(vote, block),
                 "sign_mean": lambda block=SIGN_BLOCK, **_: SignMean(block),
                 "topk": lambda block=DEFAULT_BLOCK, density=DEFAULT_DENSITY, **_: TopK(block, density),
                 "auto": lambda block=SIGN_BLOCK, vote="alltoall_1bit", **_: ByReplicas(vote, block)}
EXCHANGES = (*OUTER_FORMATS, "lowrank")   # lowrank: built per fragment by LocalSteps (it needs the matrices)


def outer_format(exchange: str, **options) -> OuterFormat:
    """The format named `exchange` (EXCHANGES), with its options (block, vote, density; one that is None: the
    format's own default); for "lowrank" the sign_vote of its non-matrix entries (LocalSteps builds the LowRank
    around it)."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    given = {name: value for name, value in options.items() if value is not None}
    return OUTER_FORMATS["sign_vote" if exchange == "lowrank" else exchange](**given)
