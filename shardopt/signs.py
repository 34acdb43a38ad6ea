"""Signs as bits: the 1-bit wire format of Sign-Muon's vote.

A sign tensor is a bool tensor `positive` (True ⇔ +1, False ⇔ −1): exact zeros
count as positive so the map is deterministic.
"""

import torch



def _bit_weights(device) -> torch.Tensor:
    """(1, 2, 4, …, 128) as uint8, made on `device` (no host-to-device copy inside a step)."""
    return torch.bitwise_left_shift(torch.ones(8, dtype=torch.uint8, device=device),
                                    torch.arange(8, dtype=torch.uint8, device=device))


def positive_signs(U: torch.Tensor) -> torch.Tensor:
    """sign(U) as bool with 0 ↦ +1: U ≥ 0."""
    return U >= 0


def padded_length(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def pack_signs(positive: torch.Tensor, pad_to: int = 8) -> torch.Tensor:
    """Pack a flat bool tensor (n,) into uint8 (ceil(n/pad_to)·pad_to/8,), bit i of byte k = entry 8k+i.

    Padding entries (beyond n) are zeros (−1); `pad_to` must be a multiple of 8.
    """
    n = positive.numel()
    bits = torch.zeros(padded_length(n, pad_to), dtype=torch.uint8, device=positive.device)
    bits[:n] = positive.reshape(-1)
    weights = _bit_weights(positive.device)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """Inverse of pack_signs on the last dim: uint8 (..., k) → bool (..., 8k), cut to n if given."""
    weights = _bit_weights(packed.device)
    bits = (packed.unsqueeze(-1) & weights) != 0
    bits = bits.reshape(*packed.shape[:-1], -1)
    return bits if n is None else bits[..., :n]


def majority(positive_counts: torch.Tensor, voters: int, tie_break: torch.Tensor | None) -> torch.Tensor:
    """V = sign(Σ sᵢ) from the count c of +1 votes among `voters`: Σ sᵢ = 2c − voters.

    Ties (2c = voters) give 0 when tie_break is None, else tie_break (a ±1 tensor
    the shape of positive_counts). Returns int8 in {−1, 0, +1}.
    """
    total = 2 * positive_counts.to(torch.int32) - voters
    V = torch.sign(total).to(torch.int8)
    if tie_break is not None:
        V = torch.where(total == 0, tie_break.to(torch.int8), V)
    return V
