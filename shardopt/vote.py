"""Sign-Muon's majority vote over the replicate axis, in three wire formats.

Each replica holds a sign tensor s ∈ {−1, +1}ⁿ (bool `positive`); the vote is
V = sign(Σ_replicas s). Bytes one replica sends for n entries and M replicas:

| vote             | wire                                             | bytes sent      |
|------------------|--------------------------------------------------|-----------------|
| "allreduce_int8" | ring all-reduce SUM of int8 (2-byte ints, M > 127) | 2n(M−1)/M (×2)  |
| "allgather_1bit" | all-gather of the packed bits, everyone counts   | n(M−1)/8        |
| "alltoall_1bit"  | all-to-all packed chunks to chunk owners, owners | n(M−1)/(4M)     |
|                  | count and sign, all-gather of the packed result  |                 |

Ties (possible only for even M): "allreduce_int8" carries a zero and abstains
(V = 0); the 1-bit formats break the tie with a coin ±1 drawn from a seed all
replicas share, so every replica gets the same V. n is padded to a multiple
of 8 (1-bit formats) and of 8M ("alltoall_1bit").

A replica may also abstain on chosen entries (`abstain`, e.g. Lion's exact zero
direction sign(0) = 0): "allreduce_int8" sends a 0 there; a 1-bit format cannot
carry a zero, so the replica sends the shared coin instead (unbiased: entries on
which every replica abstains move by a fair ±1, not by a fixed −1/+1).
"""

from __future__ import annotations

import torch

from .comm import Axis, collective_bytes
from .schedule import complete
from .signs import majority, pack_signs, padded_length, unpack_signs

VOTE_FORMATS = ("allreduce_int8", "allgather_1bit", "alltoall_1bit")
VOTES = VOTE_FORMATS + ("auto",)


def _int_wire_dtype(voters: int) -> torch.dtype:
    """int8 up to 127 voters; above that a 2-byte type. int16 is not a NCCL/gloo type, so the 2-byte
    wire is float16, whose partial sums are exact integers up to 2048 voters; int32 beyond."""
    if voters <= 127:
        return torch.int8
    return torch.float16 if voters <= 2048 else torch.int32


def vote_bytes(vote: str, n: int, voters: int) -> int:
    """Bytes one replica sends for a vote on n entries among `voters` replicas (padding included)."""
    if vote == "allreduce_int8":
        itemsize = torch.empty(0, dtype=_int_wire_dtype(voters)).element_size()
        return collective_bytes("all_reduce", n * itemsize, voters)
    if vote == "allgather_1bit":
        return collective_bytes("all_gather", padded_length(n, 8) // 8, voters)
    if vote == "alltoall_1bit":
        packed = padded_length(n, 8 * voters) // 8
        return collective_bytes("all_to_all", packed, voters) + collective_bytes("all_gather", packed // voters, voters)
    raise ValueError(f"vote must be one of {VOTES}, got {vote!r}")


def resolve_vote(vote: str, n: int, voters: int) -> str:
    """The format to use: `vote` itself, or for "auto" the one with fewest bytes (ties: fewer calls)."""
    if vote not in VOTES:
        raise ValueError(f"vote must be one of {VOTES}, got {vote!r}")
    if vote != "auto":
        return vote
    calls = {"allreduce_int8": 1, "allgather_1bit": 1, "alltoall_1bit": 2}
    return min(VOTE_FORMATS, key=lambda f: (vote_bytes(f, n, voters), calls[f]))


def coin(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """n fair ±1 coins (int8) from `seed`; identical on every replica that passes the same seed."""
    generator = torch.Generator(device=device).manual_seed(seed)
    bits = torch.randint(0, 2, (n,), generator=generator, device=device, dtype=torch.int8)
    return 2 * bits - 1


def abstain_seed(seed: int) -> int:
    """The seed of the coins a replica sends where it abstains (independent of the tie coins)."""
    return (seed * 6364136223846793005 + 1442695040888963407) % 2**63


def vote(positive: torch.Tensor, axis: Axis, fmt: str, seed: int, abstain: torch.Tensor | None = None) -> torch.Tensor:
    """V = sign(Σ_replicas sᵢ) for a flat bool tensor `positive` (n,). Returns int8 (n,) in {−1, 0, +1}.

    `fmt` is a resolved format (not "auto"); `seed` must be equal on all replicas
    (it seeds the tie-breaking coins of the 1-bit formats). `abstain` (bool (n,), optional):
    entries where this replica's sᵢ is 0 (see the module docstring).
    """
    return complete(vote_exchange(positive, axis, fmt, seed, abstain))


def vote_exchange(positive: torch.Tensor, axis: Axis, fmt: str, seed: int, abstain: torch.Tensor | None = None):
    """`vote` as a generator of collectives, for schedule.overlap."""
    n = positive.numel()
    voters = axis.size
    if voters == 1 or fmt == "allreduce_int8":
        signs = torch.where(positive, 1, -1).to(torch.int8 if voters == 1 else _int_wire_dtype(voters))
        if abstain is not None:
            signs.masked_fill_(abstain, 0)
        if voters == 1:
            return signs
        total = yield axis.all_reduce(signs, "sum", async_op=True)
        return torch.sign(total).to(torch.int8)
    if abstain is not None:   # its own coin: reusing the tie coin would let an abstainer decide every tie
        positive = torch.where(abstain, coin(n, abstain_seed(seed), positive.device) > 0, positive)
    tie_break = coin(n, seed, positive.device) if voters % 2 == 0 else None
    if fmt == "allgather_1bit":
        gathered = yield axis.all_gather(pack_signs(positive), async_op=True)   # (M, ceil(n/8))
        counts = unpack_signs(gathered, n).sum(dim=0)
        return majority(counts, voters, tie_break)
    if fmt == "alltoall_1bit":
        packed = pack_signs(positive, pad_to=8 * voters)              # (M·c,) c bytes per owner
        chunk = packed.numel() // voters
        received = (yield axis.all_to_all(packed, async_op=True)).view(voters, chunk)   # my chunk from everyone
        owned = slice(axis.rank * chunk * 8, (axis.rank + 1) * chunk * 8)
        counts = unpack_signs(received).sum(dim=0)
        if tie_break is not None:
            tie_break = torch.nn.functional.pad(tie_break, (0, packed.numel() * 8 - n))[owned]
        owned_vote = majority(counts, voters, tie_break) > 0
        result = (yield axis.all_gather(pack_signs(owned_vote), async_op=True)).reshape(-1)   # (M·c,)
        return torch.where(unpack_signs(result, n), 1, -1).to(torch.int8)
    raise ValueError(f"vote format must be one of {VOTE_FORMATS}, got {fmt!r}")
