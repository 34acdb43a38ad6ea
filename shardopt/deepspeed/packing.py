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

import torch

from ..wire.signs import pack_signs, unpack_signs

LOW_MASK = 0xFFFF


def split_master(master: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight ← RNE(master) (in place; weight: bf16, master's shape); returns (low, rounded_up): low the master's
    low 16 bits as int16, master's shape; rounded_up uint8 (ceil(n/8),), bit i of byte k = u of entry 8k + i."""
    if master.dtype != torch.float32 or weight.dtype != torch.bfloat16 or master.shape != weight.shape:
        raise ValueError(f"split_master takes an fp32 master and a bf16 weight of one shape; got {master.dtype} "
                         f"{tuple(master.shape)} and {weight.dtype} {tuple(weight.shape)}")
    weight.copy_(master)
    bits = master.detach().reshape(-1).view(torch.int32)
    low = bits.bitwise_left_shift(16).bitwise_right_shift_(16).to(torch.int16)   # sign-extended: exact in int16
    high = bits.bitwise_right_shift(16).bitwise_and_(LOW_MASK)
    rounded_up = weight.reshape(-1).view(torch.int16).to(torch.int32).bitwise_and_(LOW_MASK) != high
    return low.view(master.shape), pack_signs(rounded_up)


def join_master(weight: torch.Tensor, low: torch.Tensor, rounded_up: torch.Tensor) -> torch.Tensor:
    """The fp32 master that `split_master` split into (weight, low, rounded_up): a new tensor, weight's shape.
    A NaN weight gives a NaN (the payload is not kept)."""
    n = weight.numel()
    high = weight.detach().reshape(-1).view(torch.int16).to(torch.int32).bitwise_and_(LOW_MASK)
    high.sub_(unpack_signs(rounded_up, n).to(torch.int32))
    bits = high.bitwise_left_shift_(16).bitwise_or_(low.reshape(-1).to(torch.int32).bitwise_and_(LOW_MASK))
    return bits.view(torch.float32).view(weight.shape)
