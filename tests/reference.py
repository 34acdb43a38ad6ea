"""Float64 references written from docs/design.md's equations (plain loops, no shardopt math).

Every function works on one whole matrix X (m×n) as float64; distributed
tests feed them the quantities a single process would see.
"""

import math

import torch

from shardopt.wire.comm import collective_bytes


def newton_schulz(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """docs/design.md §2 quintic on one float64 matrix: wide orientation, Frobenius-normalized start."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def dion_step(X, G, M, Q, *, lr, mu, weight_decay, epsilon=1e-8, transpose: bool):
    """docs/design.md §1 steps 1–7 on one matrix. M is m×n (X's orientation), Q is b×r. Returns (X, M, Q)."""
    Gb, Mb = (G.T, M.T) if transpose else (G, M)
    B = Mb + Gb
    P = B @ Q
    if P.abs().max() == 0:
        P_orth = torch.zeros_like(P)
    else:
        P_orth = torch.linalg.qr(P).Q
    R = B.T @ P_orth
    B = B - (1 - mu) * P_orth @ R.T
    norms = R.norm(dim=0)
    Q_new = torch.where(norms > 0, R / (norms + epsilon), Q)
    update = P_orth @ Q_new.T
    if transpose:
        B, update = B.T, update.T
    m, n = X.shape
    X = (1 - lr * weight_decay) * X - lr * math.sqrt(m / n) * update
    return X, B, Q_new


def initial_q(b: int, r: int, seed: int) -> torch.Tensor:
    """Q₀ as docs/design.md and shardopt document it: N(0,1) float32 from manual_seed(seed), as float64."""
    return torch.randn(b, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).double()


def optimizer_param_seed(optimizer_seed: int, param_index: int) -> int:
    """The per-parameter seed the optimizer documents: (seed·1_000_003 + index) mod 2⁶³."""
    return (optimizer_seed * 1_000_003 + param_index) % 2**63


def vote_signs(directions: list[torch.Tensor]) -> torch.Tensor:
    """sign(Σ_i sign(U_i)) with sign(0) = +1 inside, 0 on ties; float64."""
    total = sum(torch.where(U >= 0, 1, -1) for U in directions)
    return torch.sign(total).double()


def coins(seed: int, n: int, start: int = 0) -> torch.Tensor:
    """The tie coins of entries start … start+n−1 (±1, int64) as docs/design.md §2 documents them, written
    again here from the text (int64 with explicit masks, not shardopt's int32 code): key z = SplitMix64(seed),
    k₀ = z mod 2³², k₁ = ⌊z/2³²⌋ | 1; for byte g, x = (g ⊕ k₀)·k₁, x ⊕= x ≫ 16, x = x·0x85EBCA6B,
    x ⊕= x ≫ 13, x = x·0xC2B2AE35, x ⊕= x ≫ 16 (all mod 2³²); entry i is bit i mod 8 of byte ⌊i/8⌋ of x."""
    mask64, mask32 = 2**64 - 1, 2**32 - 1
    z = (seed + 0x9E3779B97F4A7C15) & mask64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask64
    z ^= z >> 31
    index = torch.arange(start, start + n, dtype=torch.int64)
    x = ((index // 8) ^ (z & mask32)) * ((z >> 32) | 1) & mask32      # < 2⁶⁴ wraps in int64; the low 32 bits hold
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & mask32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & mask32
    x ^= x >> 16
    return ((x >> (index % 8)) & 1) * 2 - 1


def vote_bytes(fmt: str, n: int, M: int, matrices: int = 0) -> int:
    """docs/design.md §2's table with its padding, written from the text: bytes one replica sends for n
    entries among M replicas; allreduce_int8 2·n(M−1)/M (a 2-byte wire beyond 127 voters), allgather_1bit
    ⌈n/8⌉ bytes to M−1 others, alltoall_1bit n padded to 8M, (M−1)/M of it out and the owner's chunk to M−1
    others back; the 1-bit formats' flags: ⌈k/8⌉ more per message to each other replica."""
    if M == 1:
        return 0
    flags = -(-matrices // 8)
    if fmt == "allreduce_int8":
        return 2 * (M - 1) * n * (1 if M <= 127 else 2 if M <= 2048 else 4) // M
    if fmt == "allgather_1bit":
        return (M - 1) * (-(-n // 8) + flags)
    chunk = -(-n // (8 * M))                           # bytes per owner
    return (M - 1) * (chunk + flags) + (M - 1) * chunk


def matrix_seed(param_seed: int, index: int) -> int:
    """The seed of matrix `index` of a param (expert·blocks + block) as shardopt documents it:
    (param_seed + index·0x9E3779B97F4A7C15) mod 2⁶³ (matrix 0 keeps the param's seed)."""
    return (param_seed + index * 0x9E3779B97F4A7C15) % 2**63


def double_averaging_checks(steps: int, every: int = 1000) -> int:
    """How many of the steps 1 … `steps` run the double-averaging check (steps 1, 1+every, …; none
    with every = 0): the schedule docs/design.md §9 and ShardOptimizer document."""
    return -(-steps // every) if every > 0 else 0


def dion_bytes(layout, rank_fraction, wire_itemsize, sizes):
    """The tests' one byte oracle for Dion, written from docs/design.md §1 and §9 (not from the code):
    bytes one rank sends per axis in one Dion step of one matrix (a bucket of one), fp64 compute (8 B).
    layout: a shardopt.layout.placement.MatrixLayout; sizes: axis name → size. Orientation B (a×b): rows split
    ⇒ B = Xᵀ; unsplit, B = Xᵀ when m < n."""
    m, n = layout.shape
    transpose = bool(layout.row_axes) or (not layout.col_axes and m < n)
    a, b = (n, m) if transpose else (m, n)
    a_i, b_j = (layout.cols, layout.rows) if transpose else (layout.rows, layout.cols)
    a_axes, b_axes = (layout.col_axes, layout.row_axes) if transpose else (layout.row_axes, layout.col_axes)
    r = math.ceil(rank_fraction * min(m, n))
    low_rank = rank_fraction < 1 and (a + b) * r < a * b
    M = sizes["replicate"]
    w = wire_itemsize if M > 1 else 8        # what an axis after the replicate mean carries
    sent = dict.fromkeys(sizes, 0)

    def add(axis, kind, nbytes):
        sent[axis] += collective_bytes(kind, nbytes, sizes[axis])

    if not low_rank:
        add("replicate", "all_reduce", layout.rows * layout.cols * 8)                     # G mean
    if a_axes:                                # P: Σ over b, replicate mean of a_i rows, all-gather over a
        A = sizes[a_axes[0]]
        for axis in b_axes:
            add(axis, "all_reduce", a_i * r * 8)
        if low_rank:
            add("replicate", "all_reduce", a_i * r * wire_itemsize)
        add(a_axes[0], "all_gather", -(-a // A) * r * (w if low_rank else 8))
        add(a_axes[0], "all_reduce", b_j * r * 8)                                        # R: Σ over a
    elif not b_axes:                          # a whole matrix: P averaged over the replicas
        if low_rank:
            add("replicate", "all_reduce", a * r * wire_itemsize)
    else:                                     # P: outer b-axis all-reduce, inner b-axis HSDP exchange
        for axis in b_axes[:-1]:
            add(axis, "all_reduce", a * r * 8)
        F = sizes[b_axes[-1]]
        if low_rank:
            rows = -(-a // F) * F
            add(b_axes[-1], "reduce_scatter", rows * r * 8)
            add("replicate", "all_reduce", rows // F * r * wire_itemsize)
            add(b_axes[-1], "all_gather", rows // F * r * w)
        else:
            add(b_axes[-1], "all_reduce", a * r * 8)
    if low_rank:
        add("replicate", "all_reduce", b_j * r * wire_itemsize)                          # R mean
    for axis in b_axes:
        add(axis, "all_reduce", r * 8)                                                   # column norms
    return sent


def outer_bytes(exchange: str, n: int, replicas: int, block: int, matrices=(), rank_fraction: float = 0.25,
                density: float = 0.02) -> int:
    """The tests' byte oracle for one local-steps sync (docs/design.md §10 and shardopt/localsteps/formats.py's table,
    not the code): bytes one replica sends for n entries among M replicas, with `block` entries per
    scale and one fp32 non-finite flag; alltoall_1bit for sign_vote; sign_mean all-gathers. "lowrank": `matrices`, whole
    (m, n) matrices whose P (a×r) and R (b×r) means cross in bf16, r = ⌈rank_fraction·min(m, n)⌉, and
    the n other entries by sign_vote. "topk": per block the max(1, round(density·block)) largest, each
    2 value bits and ⌈log2 block⌉ offset bits in one packed stream, one fp32 scale per block, all-gathered.
    "auto": sign_mean's at M ≤ 2, sign_vote's from 3."""
    M = replicas
    if M == 1:
        return 0
    if exchange == "auto":                                                  # the 1-bit format of this M
        return outer_bytes("sign_mean" if M <= 2 else "sign_vote", n, M, block)
    if exchange == "lowrank":
        factors = 0
        for rows, cols in matrices:
            r = math.ceil(rank_fraction * min(rows, cols))
            factors += sum(2 * side * r * 2 * (M - 1) // M for side in (rows, cols))
        return factors + outer_bytes("sign_vote", n, M, block)
    if exchange in ("mean", "mean_bf16"):
        itemsize = 4 if exchange == "mean" else 2
        return 2 * (n + 1) * itemsize * (M - 1) // M
    if exchange in ("int8", "int4"):
        bits = 8 if exchange == "int8" else 4
        n_p = math.ceil(n / (block * M)) * block * M
        chunk = n_p * bits // (8 * M) + 4 * n_p // (block * M) + 4       # codes, scales, flag per owner
        return 2 * (M - 1) * chunk                                          # all-to-all + all-gather
    if exchange == "sign_mean":                                             # every replica's signs and scales
        return (M - 1) * (math.ceil(n / 8) + 4 * (math.ceil(n / block) + 1))
    if exchange == "topk":
        chunks, picks = math.ceil(n / block), max(1, round(density * block))
        bits_per_pick = 2 + math.ceil(math.log2(block))
        return (M - 1) * (math.ceil(chunks * picks * bits_per_pick / 8) + 4 * (chunks + 1))
    if exchange == "sign_vote":
        n_p = math.ceil(n / (8 * M)) * 8 * M
        vote = 2 * (n_p // 8) * (M - 1) // M if n else 0                    # N(M−1)/(4M), padded
        scales = math.ceil(n / block) + 1
        return vote + 2 * 4 * scales * (M - 1) // M
    raise ValueError(exchange)
