"""Sign-Muon's majority vote over the replicate axis, in three wire formats.

Each replica holds a sign tensor s ∈ {−1, +1}ⁿ (bool `positive`); the vote is
V = sign(Σ_replicas s). Bytes one replica sends for n entries and M replicas:

| vote             | wire                                             | bytes sent      |
|------------------|--------------------------------------------------|-----------------|
| "allreduce_int8" | ring all-reduce SUM of int8 (2-byte ints, M > 127) | 2n(M−1)/M (×2)  |
| "allgather_1bit" | all-gather of the packed bits, everyone counts   | n(M−1)/8        |
| "alltoall_1bit"  | all-to-all packed chunks to chunk owners, owners | n(M−1)/(4M)     |
|                  | count and sign, all-gather of the packed result  |                 |

Ties: "allreduce_int8" carries a zero and abstains (V = 0); the 1-bit formats
break the tie with a coin ±1 drawn from a seed all replicas share, so every
replica gets the same V. n is padded to a multiple of 8 (1-bit formats) and of
8M ("alltoall_1bit").

Silent matrices (Sign-Muon: a matrix whose momentum is exactly zero on this
replica votes on none of its entries). The n entries are k equal matrices
(`matrices` = k); each replica sends one "I vote" flag bit per matrix, and each
entry's majority is over the replicas that vote on its matrix (ties among them
as above); a matrix no replica votes on gets V = 0 and does not move.
"allreduce_int8" sends zeros there (no extra bytes); the 1-bit formats append
the k flags, ⌈k/8⌉ bytes, to the payload each replica already sends: the
all-gather's row, and every chunk of the all-to-all (so every replica learns
every replica's flags there): (M−1)·⌈k/8⌉ bytes per vote more, whether or not a
matrix is silent (fixed-size messages).

A replica may also abstain on chosen entries (`abstain`, e.g. Lion's exact zero
direction sign(0) = 0): "allreduce_int8" sends a 0 there; a 1-bit format cannot
carry a zero, so the replica sends the shared coin instead (unbiased: entries on
which every replica abstains move by a fair ±1, not by a fixed −1/+1).
"""

from __future__ import annotations

import torch

from .comm import Axis, collective_bytes
from .seeds import mix_seed
from .signs import as_signs, count_dtype, count_positive, majority, pack_signs, padded_length, per_entry, unpack_signs



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
        return coin(chunk, mix_seed(seed, owner), device)
    return torch.cat([coin(chunk, mix_seed(seed, o), device) for o in range(voters)])[:n]


def abstain_seed(seed: int) -> int:
    """The seed of the coins a replica sends where it abstains (independent of the tie coins)."""
    return (seed * 6364136223846793005 + 1442695040888963407) % 2**63


def _with_abstentions(positive: torch.Tensor, abstain: torch.Tensor | None, seed: int) -> torch.Tensor:
    """A 1-bit format cannot carry a zero: where this replica abstains it sends its own coin
    (reusing the tie coin would let an abstainer decide every tie): positive ⊕ ((positive ⊕ coin) ∧ abstain),
    bool ops (faster than torch.where on a CPU)."""
    if abstain is None:
        return positive
    heads = coin(positive.numel(), abstain_seed(seed), positive.device) > 0
    return positive ^ ((positive ^ heads) & abstain)


def flag_bytes(matrices: int) -> int:
    """Bytes of the per-matrix "I vote" flags a 1-bit format appends (0 without silent matrices)."""
    return padded_length(matrices, 8) // 8


def voting_counts(bits: torch.Tensor, flags: torch.Tensor | None, entries: int, start: int, length: int):
    """(+1 votes, voters) per entry of [start, start + length) from every replica's packed bits
    `bits` (M, ⌈length/8⌉) over those entries and its per-matrix flags `flags` (M, k) bool (None:
    every replica votes on everything: voters is the int M). Counted one replica's row at a time."""
    if flags is None:
        return count_positive(bits, length), bits.shape[0]
    dtype = count_dtype(bits.shape[0])
    counts = torch.zeros(length, dtype=dtype, device=bits.device)
    for row, votes in zip(bits, flags):
        counts += unpack_signs(row, length) & per_entry(votes, entries, start, length, False)
    return counts, per_entry(flags.sum(0, dtype=dtype), entries, start, length)


def _entries(n: int, silent: torch.Tensor | None) -> int:
    """Entries per matrix of n entries that are `silent`'s k matrices (all n: one matrix)."""
    return n if silent is None else n // silent.numel()


def silence(V: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """V (n,) with the matrices no replica votes on (every row of flags (M, k) False there) set to 0."""
    return V.view(flags.shape[1], -1).masked_fill_(~flags.any(0)[:, None], 0).view(-1)


class VoteFormat:
    """A wire format of the vote: `bytes(n, voters, matrices)` one replica sends for n entries, and
    `exchange(positive, axis, seed, abstain, silent)`, the vote as a generator of collectives
    (schedule.py) that returns V = sign(Σ_replicas sᵢ) as int8 (n,) in {−1, 0, +1}. `positive`:
    flat bool (n,); `seed`: equal on all replicas (the tie coins); `abstain`: bool (n,) or None,
    entries where this replica's sᵢ is 0; `silent`: bool (k,) or None, the n entries being k equal
    matrices, those this replica votes on none of (module docstring). Working memory per entry: a
    few bytes, never int64 and never an (M × n) unpacked tensor (gathered bits are counted one
    replica's row at a time)."""

    name = ""
    calls = 1   # collectives per vote (ties of `bytes` go to fewer calls)

    def bytes(self, n: int, voters: int, matrices: int = 0) -> int:
        raise NotImplementedError

    def exchange(self, positive: torch.Tensor, axis: Axis, seed: int, abstain: torch.Tensor | None = None,
                 silent: torch.Tensor | None = None):
        raise NotImplementedError


class AllreduceInt8(VoteFormat):
    """Ring all-reduce SUM of ±1/0 int8 (a 2-byte type beyond 127 voters); carries a zero, so a tie,
    an abstention and a silent matrix vote 0."""

    name = "allreduce_int8"

    def bytes(self, n: int, voters: int, matrices: int = 0) -> int:
        itemsize = torch.empty(0, dtype=_int_wire_dtype(voters)).element_size()
        return collective_bytes("all_reduce", n * itemsize, voters)

    def exchange(self, positive, axis, seed, abstain=None, silent=None):
        voters = axis.size
        signs = as_signs(positive, torch.int8 if voters == 1 else _int_wire_dtype(voters))
        if abstain is not None:
            signs.masked_fill_(abstain, 0)
        if silent is not None:
            signs.view(silent.numel(), -1).masked_fill_(silent[:, None], 0)
        if voters == 1:
            return signs
        total = yield axis.all_reduce(signs, "sum", async_op=True)
        return torch.sign(total).to(torch.int8)


class AllgatherOneBit(VoteFormat):
    """All-gather of the packed bits; every replica counts everything; ties by the shared coins."""

    name = "allgather_1bit"

    def bytes(self, n: int, voters: int, matrices: int = 0) -> int:
        return collective_bytes("all_gather", padded_length(n, 8) // 8 + flag_bytes(matrices), voters)

    def exchange(self, positive, axis, seed, abstain=None, silent=None):
        if axis.size == 1:
            return (yield from ALLREDUCE_INT8.exchange(positive, axis, seed, abstain, silent))
        n, voters = positive.numel(), axis.size
        packed = pack_signs(_with_abstentions(positive, abstain, seed))
        if silent is not None:
            packed = torch.cat([packed, pack_signs(~silent)])
        gathered = yield axis.all_gather(packed, async_op=True)      # (M, ceil(n/8) [+ ceil(k/8)])
        bits = padded_length(n, 8) // 8
        flags = None if silent is None else unpack_signs(gathered[:, bits:], silent.numel())
        counts, voting = voting_counts(gathered[:, :bits], flags, _entries(n, silent), 0, n)
        ties = voters % 2 == 0 or silent is not None      # among fewer voters a tie can come at odd M
        V = majority(counts, voting, tie_coins(n, seed, voters, None, positive.device) if ties else None)
        return V if flags is None else silence(V, flags)


class AlltoallOneBit(VoteFormat):
    """All-to-all of packed chunks to their owners, who count and sign them; all-gather of the
    packed result: 1/32 of a float32 all-reduce at every replica count."""

    name = "alltoall_1bit"
    calls = 2

    def bytes(self, n: int, voters: int, matrices: int = 0) -> int:
        packed = padded_length(n, 8 * voters) // 8
        return (collective_bytes("all_to_all", packed + voters * flag_bytes(matrices), voters)
                + collective_bytes("all_gather", packed // voters, voters))

    def exchange(self, positive, axis, seed, abstain=None, silent=None):
        if axis.size == 1:
            return (yield from ALLREDUCE_INT8.exchange(positive, axis, seed, abstain, silent))
        n, voters = positive.numel(), axis.size
        packed = pack_signs(_with_abstentions(positive, abstain, seed), pad_to=8 * voters)   # (M·c,) c bytes per owner
        chunk = packed.numel() // voters
        if silent is not None:                                        # the flags ride along with every chunk
            flags = pack_signs(~silent)
            packed = torch.cat([packed.view(voters, chunk), flags.expand(voters, flags.numel())], dim=1).view(-1)
        received = (yield axis.all_to_all(packed, async_op=True)).view(voters, -1)   # my chunk from everyone
        flags = None if silent is None else unpack_signs(received[:, chunk:], silent.numel())
        counts, voting = voting_counts(received[:, :chunk], flags, _entries(n, silent), axis.rank * 8 * chunk, 8 * chunk)
        ties = voters % 2 == 0 or silent is not None      # among fewer voters a tie can come at odd M
        tie_break = tie_coins(n, seed, voters, axis.rank, positive.device) if ties else None
        owned_vote = majority(counts, voting, tie_break) > 0
        result = (yield axis.all_gather(pack_signs(owned_vote), async_op=True)).reshape(-1)   # (M·c,)
        V = as_signs(unpack_signs(result, n))
        return V if flags is None else silence(V, flags)


ALLREDUCE_INT8, ALLGATHER_1BIT, ALLTOALL_1BIT = AllreduceInt8(), AllgatherOneBit(), AlltoallOneBit()
FORMATS = {fmt.name: fmt for fmt in (ALLREDUCE_INT8, ALLGATHER_1BIT, ALLTOALL_1BIT)}
VOTE_FORMATS = tuple(FORMATS)
VOTES = VOTE_FORMATS + ("auto",)


def vote_bytes(vote: str, n: int, voters: int, matrices: int = 0) -> int:
    """Bytes one replica sends for a vote on n entries among `voters` replicas (padding included);
    `matrices`: k, the n entries being k matrices with a silence flag each (Sign-Muon), 0 for none."""
    if vote not in FORMATS:
        raise ValueError(f"vote must be one of {VOTES}, got {vote!r}")
    return FORMATS[vote].bytes(n, voters, matrices)


def vote_format(vote: str, n: int, voters: int, matrices: int = 0) -> VoteFormat:
    """The format to use for n entries (k = `matrices` flags): `vote` itself, or for "auto" the one
    with fewest bytes at `voters` replicas (ties: fewer calls)."""
    if vote not in VOTES:
        raise ValueError(f"vote must be one of {VOTES}, got {vote!r}")
    if vote != "auto":
        return FORMATS[vote]
    return min(FORMATS.values(), key=lambda fmt: (fmt.bytes(n, voters, matrices), fmt.calls))


def resolve_vote(vote: str, n: int, voters: int, matrices: int = 0) -> str:
    """The name of `vote_format(vote, n, voters, matrices)`."""
    return vote_format(vote, n, voters, matrices).name
