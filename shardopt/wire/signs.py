"""Signs as bits: the 1-bit wire format of Sign-Muon's vote.

A sign tensor is a bool tensor `positive` (True ⇔ +1, False ⇔ −1): exact zeros
count as positive so the map is deterministic. Every function here issues a fixed number of
ops whatever the number of rows (replicas) it reads: no Python loop over rows or bits of data.
"""

import functools

import torch


@functools.cache
def _unpack_table(device: torch.device) -> torch.Tensor:
    """(256, 8) bool: row b holds the bits of the byte b, least significant first. Made once per device
    (no host-to-device copy, and no rebuilding, inside a step)."""
    byte = torch.arange(256, dtype=torch.uint8, device=device)
    return (byte[:, None] >> torch.arange(8, dtype=torch.uint8, device=device)) & 1 != 0


@functools.cache
def _bit_values(device: torch.device) -> torch.Tensor:
    """(8,) uint8: 1, 2, 4, …, 128, the value of bit i of a byte; made once per device."""
    return torch.ones(8, dtype=torch.uint8, device=device) << torch.arange(8, dtype=torch.uint8, device=device)


def positive_signs(U: torch.Tensor) -> torch.Tensor:
    """sign(U) as bool with 0 ↦ +1: U ≥ 0."""
    return U >= 0


def as_signs(positive: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """±1 in `dtype` from a bool tensor (True ↦ +1), with no wider temporary."""
    return positive.to(dtype).mul_(2).sub_(1)


def padded_length(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def pack_signs(positive: torch.Tensor, pad_to: int = 8) -> torch.Tensor:
    """Pack a flat bool tensor (n,) into uint8 (ceil(n/pad_to)·pad_to/8,), bit i of byte k = entry 8k+i.

    Padding entries (beyond n) are zeros (−1); `pad_to` must be a multiple of 8. byte k = Σᵢ 2ⁱ·[entry 8k+i]
    over the (n/8, 8) bytes of the bools (an n-byte temporary, a fixed number of ops).
    """
    n = positive.numel()
    if n % pad_to:
        bits = torch.zeros(padded_length(n, pad_to), dtype=torch.bool, device=positive.device)
        bits[:n] = positive.reshape(-1)
    else:
        bits = positive.reshape(-1)
    return (bits.view(torch.uint8).view(-1, 8) * _bit_values(positive.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """Inverse of pack_signs on the last dim: uint8 (..., k) → bool (..., 8k), cut to n if given; one row
    of a 256 × 8 table per byte (index_select: faster on a CPU than masking and comparing every bit)."""
    bits = _unpack_table(packed.device).index_select(0, packed.reshape(-1).to(torch.int32))
    bits = bits.reshape(*packed.shape[:-1], -1)
    return bits if n is None else bits[..., :n]


def count_dtype(voters: int) -> torch.dtype:
    """The narrowest integer dtype that holds a count of 0…voters."""
    return torch.uint8 if voters <= 255 else torch.int16 if voters <= 32767 else torch.int32


def count_positive(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Per entry, how many rows of `packed` (M, c) uint8 have its bit set: (n,) in count_dtype(M).

    Bit plane by bit plane: plane i = Σ_rows (packed ≫ i) & 1, the counts of entries 8k+i (c,); the 8
    planes interleave into (c, 8) = (8c,). 8 planes, whatever M: a fixed number of ops, the working set
    one (M, c) byte plane (the size of what was received) and the n counts, never an unpacked (M, n).
    """
    dtype = count_dtype(packed.shape[0])
    planes = [torch.bitwise_right_shift(packed, bit).bitwise_and_(1).sum(0, dtype=dtype) for bit in range(8)]
    return torch.stack(planes, dim=-1).view(-1)[:n]


def majority(positive_counts: torch.Tensor, voters, tie_break: torch.Tensor | None) -> torch.Tensor:
    """V = sign(Σ sᵢ) from the count c of +1 votes among `voters`: Σ sᵢ = 2c − voters, so
    V = +1 where c > voters − c, −1 where c < voters − c (comparisons only, no wider integers).

    `voters`: an int (every entry), or a tensor the shape of positive_counts in its dtype (how many
    replicas voted on each entry, c ≤ voters; 0 ⇒ V = 0: nobody voted). Ties (2c = voters > 0) give 0
    when tie_break is None, else tie_break (a ±1 tensor the shape of positive_counts). Returns int8
    in {−1, 0, +1}. A tie is taken by adding tie_break · [tie] to V (0 there): int8 arithmetic, faster on
    a CPU than torch.where.
    """
    if isinstance(voters, int):
        half = voters // 2
        V = (positive_counts > half).to(torch.int8).sub_((positive_counts < voters - half).to(torch.int8))
        tie = V == 0
    else:
        negative_counts = voters - positive_counts
        V = (positive_counts > negative_counts).to(torch.int8).sub_((positive_counts < negative_counts).to(torch.int8))
        tie = (V == 0) & (voters > 0)
    if tie_break is not None:
        V.add_(tie_break.to(torch.int8) * tie)
    return V


def per_entry(values: torch.Tensor, entries: int, start: int, length: int, fill=0) -> torch.Tensor:
    """Entries [start, start + length) of values (k,) repeated `entries` times each (matrix j of a
    stack owns entries [j·entries, (j+1)·entries)), `fill` beyond the k·entries: (length,), values'
    dtype, made without an index tensor."""
    k = values.numel()
    first, last = min(start // entries, k), min(-(-(start + length) // entries), k)
    spread = values[first:last, None].expand(last - first, entries).reshape(-1)[start - first * entries:]
    if spread.numel() >= length:
        return spread[:length]
    return torch.cat([spread, spread.new_full((length - spread.numel(),), fill)])
