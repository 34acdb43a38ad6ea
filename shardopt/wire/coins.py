"""Fair coins that are the same bits on every device: a counter-based integer hash of (seed, index).

The 1-bit votes break ties, and fill a replica's abstentions, with coins that every replica must
draw alike. A device generator (Philox, `torch.Generator(device)`) gives bits that depend on the
device and its launch grid: replicas on different GPU models, or a CPU against a GPU, would break
ties differently. These coins are integer arithmetic on int32 tensors, wrapping modulo 2³², which
every device computes bit for bit alike (docs/design.md §2):

    key (on the host, Python ints mod 2⁶⁴):  z = splitmix64(seed);  k₀ = z mod 2³²;  k₁ = ⌊z / 2³²⌋ | 1
    byte g, the coins of entries 8g … 8g+7 (all mod 2³², ≫ a logical shift; murmur3's finalizer):
        x = (g ⊕ k₀)·k₁;  x ⊕= x ≫ 16;  x = x·0x85EBCA6B;  x ⊕= x ≫ 13;  x = x·0xC2B2AE35;  x ⊕= x ≫ 16
        byte g = x mod 2⁸
    coin of entry i: bit (i mod 8) of byte ⌊i/8⌋ (least significant first, as `signs.pack_signs`): 1 ⇒ +1

A coin depends on (seed, i) only, so any run of bytes (an owner's chunk) is drawn alone, in one pass
of element-wise ops over int32 (4 bytes per 8 entries: no int64 temporaries, none per entry).
"""

from __future__ import annotations

import torch

_MASK64 = 2**64 - 1


def splitmix64(seed: int) -> int:
    """SplitMix64's output for state `seed` (Steele, Lea, Flood 2014), a Python int in [0, 2⁶⁴)."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _int32(value: int) -> int:
    """The int32 with the bits of `value` mod 2³² (a scalar torch takes for an int32 tensor)."""
    value &= 0xFFFFFFFF
    return value - 2**32 if value >= 2**31 else value


def _xorshift_(x: torch.Tensor, shift: int) -> torch.Tensor:
    """x ⊕= x ≫ shift, a logical shift of int32 bits (in place)."""
    return x.bitwise_xor_(torch.bitwise_right_shift(x, shift).bitwise_and_((1 << (32 - shift)) - 1))


def coin_bytes(seed: int, first: int, count: int, device: torch.device) -> torch.Tensor:
    """uint8 (count,): bytes first … first+count−1 of the coins of `seed` (module docstring), i.e. the
    coins of entries 8·first … 8·(first+count)−1, packed as `signs.pack_signs` packs signs."""
    z = splitmix64(seed)
    x = torch.arange(first, first + count, dtype=torch.int32, device=device)
    x.bitwise_xor_(_int32(z)).mul_(_int32((z >> 32) | 1))
    _xorshift_(x, 16).mul_(_int32(0x85EBCA6B))
    _xorshift_(x, 13).mul_(_int32(0xC2B2AE35))
    return _xorshift_(x, 16).bitwise_and_(0xFF).to(torch.uint8)
