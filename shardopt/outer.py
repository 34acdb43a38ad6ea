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
| "sign_vote" | 1-bit vote of sign(x) in vote.py's format (zeros abstain, as Lion's) times the block's mean abs x averaged over the replicas | vote bytes + AR(4(⌈n/block⌉ + 1)) |

On one replica nothing is exchanged or rounded: mean = own = x.
"""

from __future__ import annotations

import torch

from .comm import Axis, collective_bytes
from .signs import padded_length
from .vote import VOTES, vote_format

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
    """A per-block value (nb,) repeated over its block's entries, cut to (n,)."""
    return values.repeat_interleave(block)[:n]


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
        owned_mean = decoded.sum(dim=0) / owners
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
        return (vote_format(self.vote, numel, replicas).bytes(numel, replicas)
                + collective_bytes("all_reduce", 4 * (scales + FLAG_SLOT), replicas))

    def exchange(self, x, replicate, seed):
        n = x.numel()
        own_scale = block_mean_abs(torch.nan_to_num(x), self.block)
        own = torch.sign(x) * spread_blocks(own_scale, self.block, n)
        if replicate.size == 1:
            return x, x, nonfinite_flag(x)[0] > 0
        slots = yield replicate.all_reduce(torch.cat([own_scale, nonfinite_flag(x)]), "mean", async_op=True)
        fmt = vote_format(self.vote, n, replicate.size)
        voted = yield from fmt.exchange(x > 0, replicate, seed, abstain=x == 0)
        return voted.float() * spread_blocks(slots[:-FLAG_SLOT], self.block, n), own, slots[-1] > 0


FORMATS = {"mean": lambda **_: Mean("mean", torch.float32),
           "mean_bf16": lambda **_: Mean("mean_bf16", torch.bfloat16),
           "int8": lambda block=DEFAULT_BLOCK, **_: Quantized("int8", 8, block),
           "int4": lambda block=DEFAULT_BLOCK, **_: Quantized("int4", 4, block),
           "sign_vote": lambda block=DEFAULT_BLOCK, vote="alltoall_1bit", **_: SignVote(vote, block)}
EXCHANGES = tuple(FORMATS)


def outer_format(exchange: str, **options) -> OuterFormat:
    """The format named `exchange` (EXCHANGES), with its options (block, vote)."""
    if exchange not in FORMATS:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    return FORMATS[exchange](**options)
