"""The pure math of the outer exchange formats (formats.py): blocks, per-block scales, integer codes, the
non-finite flag. Local tensors only; x is flat (n,) fp32 (docs/design.md §10)."""

from __future__ import annotations

import torch

from ..wire.signs import padded_length


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


# ---- "topk": per chunk the k largest |x|, 2-bit values, packed within-chunk offsets ----------------
def picks_per_chunk(block: int, density: float) -> int:
    """k = max(1, round(density·block)): the entries "topk" sends per chunk of `block`."""
    return max(1, min(block, round(density * block)))


def offset_bits(block: int) -> int:
    """⌈log2 block⌉: the bits of a within-chunk offset (0 for a chunk of one entry)."""
    return (block - 1).bit_length()


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes in [0, 2^bits) (…, m) → (…, ⌈m·bits/8⌉) uint8: code j's bit i is stream bit j·bits + i,
    stream bit t in byte t // 8 at position t % 8 (least significant first), the last byte zero-padded."""
    shifts = torch.arange(bits, device=codes.device)
    stream = ((codes.unsqueeze(-1) >> shifts) & 1).flatten(-2).to(torch.uint8)
    stream = torch.nn.functional.pad(stream, (0, -stream.shape[-1] % 8))
    weights = (1 << torch.arange(8, device=codes.device)).to(torch.uint8)
    return (stream.unflatten(-1, (-1, 8)) * weights).sum(dim=-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of pack_bits: (…, bytes) uint8 → the first `count` codes (…, count) int64."""
    positions = torch.arange(8, device=packed.device)
    stream = ((packed.unsqueeze(-1).long() >> positions) & 1).flatten(-2)[..., :count * bits]
    return (stream.unflatten(-1, (count, bits)) << torch.arange(bits, device=packed.device)).sum(dim=-1)


def select_topk(blocks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk the k entries of largest |x| (ties as torch.topk breaks them): blocks (nc, block) →
    (offsets (nc, k) int64 within the chunk, values (nc, k))."""
    offsets = blocks.abs().topk(k, dim=1).indices
    return offsets, blocks.gather(1, offsets)


def encode_picks(offsets: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A pick as one (2 + offset_bits) code: offset·4 + 2·big + positive, positive = x > 0, big = |x| ≥ ¾·s_c
    (s_c the chunk's absmax, `scales` (nc,)): the 2-bit value decodes to ±s_c (big) or ±s_c/2."""
    big = values.abs() >= 0.75 * scales.unsqueeze(-1)
    return offsets * 4 + big.long() * 2 + (values > 0).long()


def decode_picks(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """Codes (…, nc, k) and scales (…, nc) → the dense chunks (…, nc, block) fp32: x̂ = ±s_c·(1 + big)/2 at
    each pick's offset, 0 elsewhere."""
    sign = torch.where(codes & 1 > 0, 1.0, -1.0)
    values = sign * scales.unsqueeze(-1) * (0.5 * (1 + ((codes >> 1) & 1))).float()
    dense = scales.new_zeros((*codes.shape[:-1], block))
    return dense.scatter_(-1, codes >> 2, values)
