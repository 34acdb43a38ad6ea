"""Sign-Muon's majority vote over the replicate axis, in three wire formats.

Each replica holds a sign tensor s ∈ {−1, +1}ⁿ (bool `positive`); the vote is
V = sign(Σ_replicas s). Bytes one replica sends for n entries and M replicas:

| vote             | wire                                             | bytes sent      |
|------------------|--------------------------------------------------|-----------------|
| "allreduce_int8" | ring all-reduce SUM of int8 (2-byte ints, M > 127) | 2n(M−1)/M (×2)  |
| "allgather_1bit" | all-gather of the packed bits, everyone counts   | n(M−1)/8        |
| "alltoall_1bit"  | all-to-all packed chunks to chunk owners, owners | n(M−1)/(4M)     |
|                  | count and sign, all-gather of the packed result  |                 |

(`VoteFormat.bytes`: the format's own exchange run on a counting axis, so the table
is what the code sends by construction; tests/reference.py keeps the table as the oracle.)

Ties: "allreduce_int8" carries a zero and abstains (V = 0); the 1-bit formats
break the tie with a coin ±1 from a seed all replicas share, entry i's coin a hash
of (seed, i) in int32 arithmetic (coins.py), the same bits on every device, so every
replica gets the same V. n is padded to a multiple of 8 (1-bit formats) and of
8M ("alltoall_1bit"). A vote issues a fixed number of ops whatever M (the counts
are taken per bit plane, signs.count_positive) and no host sync.

Silent matrices (Sign-Muon: a matrix whose momentum is exactly zero on this
replica votes on none of its entries). The n entries are k equal matrices
(`matrices` = k); each replica sends one "I vote" flag bit per matrix, and each
entry's majority is over the replicas that vote on its matrix (ties among them
as above); a matrix no replica votes on gets V = 0 and does not move.
"allreduce_int8" sends zeros there (no extra bytes); the 1-bit formats send
0 bits there (so the receivers' counts of +1 are the voters') and append
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

import functools

import torch

from .coins import coin_bytes
from .comm import Axis, CountingAxis, complete
from .signs import as_signs, count_dtype, count_positive, majority, pack_signs, padded_length, per_entry, unpack_signs


def _int_wire_dtype(voters: int) -> torch.dtype:
    """int8 up to 127 voters; above that a 2-byte type. int16 is not a NCCL/gloo type, so the 2-byte
    wire is float16, whose partial sums are exact integers up to 2048 voters; int32 beyond."""
    if voters <= 127:
        return torch.int8
    return torch.float16 if voters <= 2048 else torch.int32


def coins(seed: int, start: int, length: int, device: torch.device) -> torch.Tensor:
    """bool (length,): the heads of entries start … start+length−1 (any start) of `seed`'s device-independent
    coins (coins.py: entry i's coin is bit i mod 8 of hash byte ⌊i/8⌋), drawn in one pass for just these
    entries (an owner's chunk; a bucket's entries, its first entry's index in its group: `Vote.first`)."""
    skip = start % 8
    heads = unpack_signs(coin_bytes(seed, start // 8, padded_length(skip + length, 8) // 8, device), skip + length)
    return heads[skip:]


def tie_coins(seed: int, start: int, length: int, device: torch.device) -> torch.Tensor:
    """±1 coins (int8, (length,)) of entries start … start+length−1 (`coins`), the same on every replica,
    device and replica count, so every format breaks a tie alike ("alltoall_1bit": an owner's chunk)."""
    return as_signs(coins(seed, start, length, device))


def abstain_seed(seed: int) -> int:
    """The seed of the coins a replica sends where it abstains (independent of the tie coins)."""
    return (seed * 6364136223846793005 + 1442695040888963407) % 2**63


def _voting_signs(positive: torch.Tensor, abstain: torch.Tensor | None, silent: torch.Tensor | None,
                  seed: int, first: int) -> torch.Tensor:
    """The bits this replica sends in a 1-bit format, bool (n,). Where it abstains, its coin (a 1-bit
    format cannot carry a zero; reusing the tie coin would let an abstainer decide every tie):
    positive ⊕ ((positive ⊕ heads) ∧ abstain), bool ops (faster than torch.where on a CPU). On the
    matrices it is silent on (`silent` (k,)), zeros: the receivers then count +1 votes of the voting
    replicas only, and learn from the flags how many vote."""
    if abstain is not None:
        heads = coins(abstain_seed(seed), first, positive.numel(), positive.device)
        positive = positive ^ ((positive ^ heads) & abstain)
    if silent is not None:
        positive = (positive.view(silent.numel(), -1) & ~silent[:, None]).view(-1)
    return positive


def voting_counts(bits: torch.Tensor, flags: torch.Tensor | None, entries: int, start: int, length: int):
    """(+1 votes, voters) per entry of [start, start + length) from every replica's packed bits
    `bits` (M, ⌈length/8⌉) over those entries (zeros on the matrices a replica is silent on:
    `_voting_signs`) and its per-matrix flags `flags` (M, k) bool (None: every replica votes on
    everything: voters is the int M). A fixed number of ops whatever M (signs.count_positive)."""
    counts = count_positive(bits, length)
    if flags is None:
        return counts, bits.shape[0]
    return counts, per_entry(flags.sum(0, dtype=count_dtype(bits.shape[0])), entries, start, length)


def _entries(n: int, silent: torch.Tensor | None) -> int:
    """Entries per matrix of n entries that are `silent`'s k matrices (all n: one matrix)."""
    return n if silent is None else n // silent.numel()


def silence(V: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """V (n,) with the matrices no replica votes on (every row of flags (M, k) False there) set to 0."""
    return V.view(flags.shape[1], -1).masked_fill_(~flags.any(0)[:, None], 0).view(-1)


class VoteFormat:
    """A wire format of the vote: `exchange(positive, axis, seed, abstain, silent)`, the vote as a
    generator of collectives (schedule.py) that returns V = sign(Σ_replicas sᵢ) as int8 (n,) in
    {−1, 0, +1}. `positive`: flat bool (n,); `seed`: equal on all replicas (the tie coins); `abstain`:
    bool (n,) or None, entries where this replica's sᵢ is 0; `silent`: bool (k,) or None, the n entries
    being k equal matrices, those this replica votes on none of (module docstring); `first`: the index of
    entry 0 in the coins' numbering (a bucket of a larger vote: its entries' coins are the whole vote's). Working memory per
    entry: a few bytes, never int64 and never an (M × n) unpacked tensor; ops per vote: a fixed number,
    whatever M. `cost` and `bytes` are what `exchange` itself sends, counted (`_counted`)."""

    name = ""

    def exchange(self, positive: torch.Tensor, axis: Axis, seed: int, abstain: torch.Tensor | None = None,
                 silent: torch.Tensor | None = None, first: int = 0):
        raise NotImplementedError

    def cost(self, n: int, voters: int, matrices: int = 0) -> tuple[int, int]:
        """(bytes one replica sends, collectives) of a vote on n entries among `voters` replicas (k =
        `matrices` silence flags, 0 for none): the format's own `exchange`, counted (`_counted`)."""
        return _counted(self, n, voters, matrices)

    def bytes(self, n: int, voters: int, matrices: int = 0) -> int:
        """Bytes one replica sends for a vote on n entries among `voters` (k = `matrices` flags)."""
        return self.cost(n, voters, matrices)[0]


@functools.lru_cache(maxsize=4096)
def _counted(fmt: VoteFormat, n: int, voters: int, matrices: int) -> tuple[int, int]:
    """`fmt.exchange` on meta tensors against a counting axis of `voters` ranks: (bytes sent, calls), by
    construction those the real vote sends (one byte model: comm.collective_bytes of the collectives
    it issues). Remembered: a meta run takes milliseconds, and plans ask for the same sizes again."""
    axis = CountingAxis("replicate", voters)
    silent = torch.empty(matrices, dtype=torch.bool, device="meta") if matrices else None
    complete(fmt.exchange(torch.empty(n, dtype=torch.bool, device="meta"), axis, 0, silent=silent))
    return axis.bytes_sent, axis.calls


class AllreduceInt8(VoteFormat):
    """Ring all-reduce SUM of ±1/0 int8 (a 2-byte type beyond 127 voters); carries a zero, so a tie,
    an abstention and a silent matrix vote 0."""

    name = "allreduce_int8"

    def exchange(self, positive, axis, seed, abstain=None, silent=None, first=0):
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
    """All-gather of the packed bits (and the flags); every replica counts everything; ties by the
    shared coins of all n entries."""

    name = "allgather_1bit"

    def exchange(self, positive, axis, seed, abstain=None, silent=None, first=0):
        if axis.size == 1:
            return (yield from ALLREDUCE_INT8.exchange(positive, axis, seed, abstain, silent, first))
        n, voters = positive.numel(), axis.size
        packed = pack_signs(_voting_signs(positive, abstain, silent, seed, first))
        if silent is not None:
            packed = torch.cat([packed, pack_signs(~silent)])
        gathered = yield axis.all_gather(packed, async_op=True)      # (M, ceil(n/8) [+ ceil(k/8)])
        bits = padded_length(n, 8) // 8
        flags = None if silent is None else unpack_signs(gathered[:, bits:], silent.numel())
        counts, voting = voting_counts(gathered[:, :bits], flags, _entries(n, silent), 0, n)
        ties = voters % 2 == 0 or silent is not None      # among fewer voters a tie can come at odd M
        V = majority(counts, voting, tie_coins(seed, first, n, positive.device) if ties else None)
        return V if flags is None else silence(V, flags)


class AlltoallOneBit(VoteFormat):
    """All-to-all of packed chunks to their owners, who count and sign them (ties by the coins of
    their own chunk only); all-gather of the packed result: 1/32 of a float32 all-reduce at every
    replica count."""

    name = "alltoall_1bit"

    def exchange(self, positive, axis, seed, abstain=None, silent=None, first=0):
        if axis.size == 1:
            return (yield from ALLREDUCE_INT8.exchange(positive, axis, seed, abstain, silent, first))
        n, voters = positive.numel(), axis.size
        packed = pack_signs(_voting_signs(positive, abstain, silent, seed, first), pad_to=8 * voters)   # (M·c,)
        chunk = packed.numel() // voters                              # c bytes per owner
        if silent is not None:                                        # the flags ride along with every chunk
            flags = pack_signs(~silent)
            packed = torch.cat([packed.view(voters, chunk), flags.expand(voters, flags.numel())], dim=1).view(-1)
        received = (yield axis.all_to_all(packed, async_op=True)).view(voters, -1)   # my chunk from everyone
        flags = None if silent is None else unpack_signs(received[:, chunk:], silent.numel())
        start = axis.rank * 8 * chunk
        counts, voting = voting_counts(received[:, :chunk], flags, _entries(n, silent), start, 8 * chunk)
        ties = voters % 2 == 0 or silent is not None      # among fewer voters a tie can come at odd M
        owned_vote = majority(counts, voting, tie_coins(seed, first + start, 8 * chunk, positive.device) if ties else None) > 0
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
    with fewest bytes at `voters` replicas (ties: fewer collectives)."""
    if vote not in VOTES:
        raise ValueError(f"vote must be one of {VOTES}, got {vote!r}")
    if vote != "auto":
        return FORMATS[vote]
    return min(FORMATS.values(), key=lambda fmt: fmt.cost(n, voters, matrices))


def resolve_vote(vote: str, n: int, voters: int, matrices: int = 0) -> str:
    """The name of `vote_format(vote, n, voters, matrices)`."""
    return vote_format(vote, n, voters, matrices).name
