"""1-bit Adam's compressed all-reduce: the replicas' mean of scaled signs, error-compensated twice
(Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed", arXiv 2102.02888, §4; DeepSpeed's compressed all-reduce had the same two stages).

Each replica j holds T tensors x_t (n_t entries, fp32) with its worker error e_t (n_t,), and for the
chunk of every tensor it owns a server error. Tensor t is zero-padded to p_t = n_t rounded up to 8·M
and cut into M chunks of c_t = p_t / M; replica i owns chunk i of every tensor.

    worker, on replica j, per tensor:   x ← x + e,  s = ‖x‖₂ / √n_t,  e ← x − s·sign(x)
    all-to-all: chunk i of sign(x) (packed, 1 bit per entry) and the T scales s to replica i
    server, on replica i, per tensor:   y ← (1/M)·Σ_j s_j·sign_j(chunk i) + e_s   (real entries only)
                                        σ = ‖y‖₂ / √r,  e_s ← y − σ·sign(y)   (r real entries of the chunk)
    all-gather: every server's packed sign(y) and its T scales σ
    result, on every replica:           chunk i of tensor t = σ_i,t · sign(y_i,t), bitwise equal everywhere

sign(0) = +1 (a 1-bit wire carries no zero). On one replica nothing is sent or rounded: the result
is x itself and the errors stay as they are (DeepSpeed's optimizer also ran uncompressed there).

Bytes one replica sends (M replicas, C = Σ_t c_t, each message C/8 sign bytes and 4·T scale bytes):

    all-to-all  (M−1)·(C/8 + 4T)   +   all-gather  (M−1)·(C/8 + 4T)   =   2·(M−1)·(C/8 + 4T)

≈ n·(M−1)/(4M): 1/32 of a float32 ring all-reduce 8n·(M−1)/M, at every M, plus the scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .comm import Axis, collective_bytes
from .signs import pack_signs, padded_length, unpack_signs


def chunk_sizes(numels: list[int], replicas: int) -> list[int]:
    """c_t = n_t rounded up to 8·M, divided by M: each owner's entries of tensor t (a multiple of 8)."""
    return [padded_length(n, 8 * replicas) // replicas for n in numels]


def onebit_mean_bytes(numels: list[int], replicas: int) -> int:
    """Bytes one replica sends for the compressed mean of tensors of `numels` entries (module doc)."""
    if replicas <= 1:
        return 0
    message = sum(chunk_sizes(numels, replicas)) // 8 + 4 * len(numels)
    return collective_bytes("all_to_all", replicas * message, replicas) + collective_bytes("all_gather", message,
                                                                                          replicas)


def scaled_sign(x: torch.Tensor, real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positive, s): sign(x) as bool (0 ↦ +1) and s = ‖x‖₂/√real, the scale that keeps the RMS of
    the `real` (unpadded) entries; x is (…, k) with zeros beyond `real`; s is (…,) fp32."""
    scale = torch.linalg.vector_norm(x.float(), dim=-1) / max(real, 1) ** 0.5
    return x >= 0, scale


def decode(positive: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """s·(±1) from bool signs (…, k) and scales (…,): fp32 (…, k)."""
    return torch.where(positive, 1.0, -1.0) * scale.unsqueeze(-1)


def _as_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.float().contiguous().view(torch.uint8)


def _chunked(tensors: list[torch.Tensor], chunks: list[int], replicas: int) -> torch.Tensor:
    """The tensors (flat, padded with zeros / False to M·c_t) as (M, C) in their dtype: row i holds chunk i
    of each tensor in turn."""
    out = tensors[0].new_zeros((replicas, sum(chunks)))
    for t, start, c in zip(tensors, _starts(chunks), chunks):
        padded = t.new_zeros(replicas * c)
        padded[:t.numel()] = t.reshape(-1)
        out[:, start:start + c] = padded.view(replicas, c)
    return out


def _starts(chunks: list[int]) -> list[int]:
    return [sum(chunks[:t]) for t in range(len(chunks))]


def _split(rows: torch.Tensor, chunks: list[int], numels: list[int]) -> list[torch.Tensor]:
    """Inverse of `_chunked`: (M, C) → each tensor's first n_t entries, flat."""
    return [piece.reshape(-1)[:n] for piece, n in zip(rows.split(chunks, dim=1), numels)]


def _real_counts(numels: list[int], chunks: list[int], owner: int) -> list[int]:
    """r_t: the entries of tensor t's chunk `owner` that are not padding."""
    return [max(0, min(c, n - owner * c)) for n, c in zip(numels, chunks)]


def _server(received: torch.Tensor, server_errors, chunks: list[int], numels: list[int], replicate: Axis):
    """The owner's stage (module doc), in place on the owned entries of its server errors: received
    (M, C/8 + 4T) from the replicas → this owner's message (C/8 + 4T,)."""
    M, width, rank = replicate.size, sum(chunks), replicate.rank
    scales = received[:, width // 8:].contiguous().view(torch.float32)              # (M, T): s_j,t
    positive = unpack_signs(received[:, :width // 8].contiguous(), width)          # (M, C)
    signs, sigmas = [], []
    for t, (piece, real, c) in enumerate(zip(positive.split(chunks, dim=1), _real_counts(numels, chunks, rank),
                                             chunks)):
        y = decode(piece, scales[:, t]).sum(dim=0) / M                               # (c,), replica order
        y[real:] = 0
        owned = server_errors[t].view(-1)[rank * c:rank * c + real]
        y[:real] += owned
        positive_y, sigma = scaled_sign(y, real)
        owned.copy_((y - decode(positive_y, sigma))[:real])
        signs.append(positive_y)
        sigmas.append(sigma.reshape(1))
    return torch.cat([pack_signs(torch.cat(signs)), _as_bytes(torch.cat(sigmas))])


@dataclass(frozen=True)
class OneBitMean:
    """The exchange of 1-bit Adam's momentum: `tensors(xs, worker_errors, server_errors, replicate)`, a
    generator of the two collectives (schedule.py) that returns the compressed mean of each x, equal on
    every replica, and updates the errors in place. worker_errors: like each x; server_errors: like each
    x too, of which this replica reads and writes only the entries of the chunk it owns (so the state's
    shape does not depend on M)."""

    def tensors(self, xs: list[torch.Tensor], worker_errors: list[torch.Tensor], server_errors: list[torch.Tensor],
                replicate: Axis):
        if replicate.size == 1 or not xs:
            return list(xs)
        M, numels = replicate.size, [x.numel() for x in xs]
        chunks = chunk_sizes(numels, M)
        signs, scales = [], []
        for x, error in zip(xs, worker_errors):                  # worker stage, tensor by tensor
            compensated = x.float().reshape(-1) + error.reshape(-1)
            positive, scale = scaled_sign(compensated, compensated.numel())
            error.copy_((compensated - decode(positive, scale)).view_as(error))
            signs.append(positive)
            scales.append(scale.reshape(1))
        sent = torch.cat([pack_signs(_chunked(signs, chunks, M).reshape(-1)).view(M, -1),
                          _as_bytes(torch.cat(scales)).expand(M, -1)], dim=1)
        received = (yield replicate.all_to_all(sent.reshape(-1), async_op=True)).view(M, -1)
        mine = _server(received, server_errors, chunks, numels, replicate)
        rows = (yield replicate.all_gather(mine, async_op=True))   # (M, C/8 + 4T)
        width = sum(chunks)
        sigma = rows[:, width // 8:].contiguous().view(torch.float32)                      # (M, T)
        positive = unpack_signs(rows[:, :width // 8].contiguous(), width)               # (M, C)
        values = torch.cat([decode(p, sigma[:, t]) for t, p in enumerate(positive.split(chunks, dim=1))], dim=1)
        return [v.view_as(x).to(x.dtype) for v, x in zip(_split(values, chunks, numels), xs)]

    def starting_at(self, first: int) -> OneBitMean:
        """This exchange for a bucket of whole tensors of a group (its scales and chunks are per tensor)."""
        return self


ONEBIT_MEAN = OneBitMean()
