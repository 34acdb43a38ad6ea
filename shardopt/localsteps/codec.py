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
