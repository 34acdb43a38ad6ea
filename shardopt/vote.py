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
from .signs import as_signs, count_positive, majority, pack_signs, padded_length, unpack_signs



def _int_wire_dtype(voters: int) -> torch.dtype:
    """int8 up to 127 voters; above that a 2-byte type. int16 is not a NCCL/gloo type, so the 2-byte
    wire is float16, whose partial sums are exact integers up to 2048 voters; int32 beyond."""
    if voters <= 127:
        return torch.int8
    return torch.float16 if voters <= 2048 else torch.int32


def coin(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """n fair ±1 coins (int8) from `seed`; identical on every replica that passes the same seed
    (on the meta device: their shape only)."""
    if device.type == "meta":
        return torch.empty(n, dtype=torch.int8, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=generator, device=device, dtype=torch.int8).mul_(2).sub_(1)


def tie_coins(n: int, seed: int, voters: int, owner: int | None, device: torch.device) -> torch.Tensor:
    """±1 coins (int8) that break ties among an even number of `voters` on n entries.

    The entries are cut into `voters` chunks of c = padded_length(n, 8·voters)/voters (the chunks
    "alltoall_1bit" owners count); chunk o's coins come from a generator seeded (seed·1_000_003 + o)
    mod 2⁶³, so an owner draws only its own c coins. owner=None: every entry's coin (n,), the chunks
    in order ("allgather_1bit", where every replica counts everything). Identical on every replica
    that passes the same seed, so both formats break a tie alike.
    """
    chunk = padded_length(n, 8 * voters) // voters
    if owner is not None:
        return coin(chunk, (seed * 1_000_003 + owner) % 2**63, device)
    return torch.cat([coin(chunk, (seed * 1_000_003 + o) % 2**63, device) for o in range(voters)])[:n]


def abstain_seed(seed: int) -> int:
    """The seed of the coins a replica sends where it abstains (independent of the tie coins)."""
    return (seed * 6364136223846793005 + 1442695040888963407) % 2**63


def _with_abstentions(positive: torch.Tensor, abstain: torch.Tensor | None, seed: int) -> torch.Tensor:
    """A 1-bit format cannot carry a zero: where this replica abstains it sends its own coin
    (reusing the tie coin would let an abstainer decide every tie)."""
    if abstain is None:
        return positive
    return torch.where(abstain, coin(positive.numel(), abstain_seed(seed), positive.device) > 0, positive)


class VoteFormat:
    """A wire format of the vote: `bytes(n, voters)` one replica sends for n entries, and
    `exchange(positive, axis, seed, abstain)`, the vote as a generator of collectives (schedule.py)
    that returns V = sign(Σ_replicas sᵢ) as int8 (n,) in {−1, 0, +1}. `positive`: flat bool (n,);
    `seed`: equal on all replicas (the tie coins); `abstain`: bool (n,) or None, entries where this
    replica's sᵢ is 0. Working memory per entry: a few bytes, never int64 and never an (M × n)
    unpacked tensor (gathered bits are counted one replica's row at a time)."""

    name = ""
    calls = 1   # collectives per vote (ties of `bytes` go to fewer calls)

    def bytes(self, n: int, voters: int) -> int:
        raise NotImplementedError

    def exchange(self, positive: torch.Tensor, axis: Axis, seed: int, abstain: torch.Tensor | None = None):
        raise NotImplementedError


class AllreduceInt8(VoteFormat):
    """Ring all-reduce SUM of ±1/0 int8 (a 2-byte type beyond 127 voters); carries a zero, so a tie
    and an abstention vote 0."""

    name = "allreduce_int8"

    def bytes(self, n: int, voters: int) -> int:
        itemsize = torch.empty(0, dtype=_int_wire_dtype(voters)).element_size()
        return collective_bytes("all_reduce", n * itemsize, voters)

    def exchange(self, positive, axis, seed, abstain=None):
        voters = axis.size
        signs = as_signs(positive, torch.int8 if voters == 1 else _int_wire_dtype(voters))
        if abstain is not None:
            signs.masked_fill_(abstain, 0)
        if voters == 1:
            return signs
        total = yield axis.all_reduce(signs, "sum", async_op=True)
        return torch.sign(total).to(torch.int8)


class AllgatherOneBit(VoteFormat):
    """All-gather of the packed bits; every replica counts everything; ties by the shared coins."""

    name = "allgather_1bit"

    def bytes(self, n: int, voters: int) -> int:
        return collective_bytes("all_gather", padded_length(n, 8) // 8, voters)

    def exchange(self, positive, axis, seed, abstain=None):
        if axis.size == 1:
            return (yield from ALLREDUCE_INT8.exchange(positive, axis, seed, abstain))
        n, voters = positive.numel(), axis.size
        positive = _with_abstentions(positive, abstain, seed)
        gathered = yield axis.all_gather(pack_signs(positive), async_op=True)   # (M, ceil(n/8))
        tie_break = tie_coins(n, seed, voters, None, positive.device) if voters % 2 == 0 else None
        return majority(count_positive(gathered, n), voters, tie_break)


class AlltoallOneBit(VoteFormat):
    """All-to-all of packed chunks to their owners, who count and sign them; all-gather of the
    packed result: 1/32 of a float32 all-reduce at every replica count."""

    name = "alltoall_1bit"
    calls = 2

    def bytes(self, n: int, voters: int) -> int:
        packed = padded_length(n, 8 * voters) // 8
        return collective_bytes("all_to_all", packed, voters) + collective_bytes("all_gather", packed // voters, voters)

    def exchange(self, positive, axis, seed, abstain=None):
        if axis.size == 1:
            return (yield from ALLREDUCE_INT8.exchange(positive, axis, seed, abstain))
        n, voters = positive.numel(), axis.size
        positive = _with_abstentions(positive, abstain, seed)
        packed = pack_signs(positive, pad_to=8 * voters)              # (M·c,) c bytes per owner
        chunk = packed.numel() // voters
        received = (yield axis.all_to_all(packed, async_op=True)).view(voters, chunk)   # my chunk from everyone
        tie_break = tie_coins(n, seed, voters, axis.rank, positive.device) if voters % 2 == 0 else None
        owned_vote = majority(count_positive(received, 8 * chunk), voters, tie_break) > 0
        result = (yield axis.all_gather(pack_signs(owned_vote), async_op=True)).reshape(-1)   # (M·c,)
        return as_signs(unpack_signs(result, n))


ALLREDUCE_INT8, ALLGATHER_1BIT, ALLTOALL_1BIT = AllreduceInt8(), AllgatherOneBit(), AlltoallOneBit()
FORMATS = {fmt.name: fmt for fmt in (ALLREDUCE_INT8, ALLGATHER_1BIT, ALLTOALL_1BIT)}
VOTE_FORMATS = tuple(FORMATS)
VOTES = VOTE_FORMATS + ("auto",)


def vote_bytes(vote: str, n: int, voters: int) -> int:
    """Bytes one replica sends for a vote on n entries among `voters` replicas (padding included)."""
    if vote not in FORMATS:
        raise ValueError(f"vote must be one of {VOTES}, got {vote!r}")
    return FORMATS[vote].bytes(n, voters)


def vote_format(vote: str, n: int, voters: int) -> VoteFormat:
    """The format to use for n entries: `vote` itself, or for "auto" the one with fewest bytes at
    `voters` replicas (ties: fewer calls)."""
    if vote not in VOTES:
        raise ValueError(f"vote must be one of {VOTES}, got {vote!r}")
    if vote != "auto":
        return FORMATS[vote]
    return min(FORMATS.values(), key=lambda fmt: (fmt.bytes(n, voters), fmt.calls))


def resolve_vote(vote: str, n: int, voters: int) -> str:
    """The name of `vote_format(vote, n, voters)`."""
    return vote_format(vote, n, voters).name
