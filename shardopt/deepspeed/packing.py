"""An fp32 master kept as its bf16 weight plus 16 low bits and one bit per entry (issue 43; masters.py).

With b the fp32 bit pattern of a master x (as uint32), the bf16 weight w = RNE(x) (round to nearest, ties to even,
as torch's fp32 → bf16 copy rounds) holds b's high 16 bits, or those plus one where the rounding went up in
magnitude (the sign bit is never carried into). So

    high(b) = bits(w) − u,   u = [RNE rounded x's magnitude up] ∈ {0, 1}
    b       = high(b)·2¹⁶ + low(b),   low(b) = b mod 2¹⁶

and x is rebuilt exactly from w, low(b) (int16) and u (one bit, packed 8 to a byte): 2 + 1/8 bytes per entry
beside the weight, not 4. u is needed: at a tie (low(b) = 0x8000) the rounding goes up or down by the parity of
high(b), which w alone does not show. This holds for every finite x, ±0, subnormals and ±inf, and for x that
rounds to ±inf (high(b) = 0x7F7F, u = 1). A NaN master rebuilds as a NaN, not its payload (torch's copy makes
every NaN the one quiet NaN).
"""

from __future__ import annotations

import sys

import torch

from ..wire.signs import pack_signs, unpack_signs

# where the low and high 16 bits of an fp32 lie when it is viewed as two int16 (the machine's byte order)
LOW, HIGH = (0, 1) if sys.byteorder == "little" else (1, 0)


def _halves(master: torch.Tensor) -> torch.Tensor:
    """(n, 2) int16 view of a contiguous fp32 tensor's bits: [:, LOW] the low 16 bits, [:, HIGH] the high 16."""
    return master.detach().reshape(-1).view(torch.int16).view(-1, 2)


def split_master(master: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight ← RNE(master) (in place; weight: bf16, master's shape); returns (low, rounded_up): low the master's
    low 16 bits as int16, master's shape; rounded_up uint8 (ceil(n/8),), bit i of byte k = u of entry 8k + i
    (u = [bits(weight) ≠ high(master)]). Temporaries: n bytes twice, beside the 2n of low."""
    if master.dtype != torch.float32 or weight.dtype != torch.bfloat16 or master.shape != weight.shape:
        raise ValueError(f"split_master takes an fp32 master and a bf16 weight of one shape; got {master.dtype} "
                         f"{tuple(master.shape)} and {weight.dtype} {tuple(weight.shape)}")
    weight.copy_(master)
    halves = _halves(master.contiguous())
    rounded_up = weight.detach().reshape(-1).view(torch.int16) != halves[:, HIGH]
    return halves[:, LOW].clone().view(master.shape), pack_signs(rounded_up)


def join_master(weight: torch.Tensor, low: torch.Tensor, rounded_up: torch.Tensor) -> torch.Tensor:
    """The fp32 master that `split_master` split into (weight, low, rounded_up): a new tensor, weight's shape.
    high = bits(weight) − u in int16 (no borrow crosses the sign bit: u = 1 only where the weight's magnitude
    was rounded up, so it is ≥ 1). A NaN weight gives a NaN (the payload is not kept)."""
    master = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    halves = _halves(master)
    torch.sub(weight.detach().reshape(-1).view(torch.int16), unpack_signs(rounded_up, weight.numel()).to(torch.int16),
              out=halves[:, HIGH])
    halves[:, LOW] = low.reshape(-1)
    return master
