"""Replicate-axis bytes per step per replica for GPT-2 small's matrices, by exchange.

    python launch/bench_comm.py                       # formula rows + measured rows at 2 and 4 processes
    python launch/bench_comm.py --measure-layers 2    # measure with 2 layers instead of 1
    python launch/bench_comm.py --no-measure          # formula rows only (seconds)

Matrices: 12 layers × {attn.qkv 2304×768, attn.proj 768×768, mlp.fc 3072×768, mlp.proj 768×3072}
(nn.Linear weights, out×in), fp32. Exchanges: the fp32 ring all-reduce of the gradient (what DDP
sends), Sign-Muon's three vote formats and "auto", Dion at rank_fraction 1/4 and 1/16.

Formula rows come from the same functions the communication layer counts with
(`shardopt.comm.collective_bytes`, `shardopt.vote.vote_bytes` / `resolve_vote`,
`shardopt.dion.compressed` / `oriented_shape` / `rank_of`), applied per bucket as the optimizer
buckets matrices (same-shape matrices, cut under the default bucket_bytes). Measured rows run one real optimizer step per exchange on
gloo processes (2 and 4) with `--measure-layers` layers (default 1, to stay fast on a CPU) and read
`comm_stats()`; they are scaled by 12/layers to the 12-layer model, and `measured == formula`
compares the unscaled count with the formula for the layers run (every bucket here divides
evenly, so the formula is linear in the layer count). The fp32 all-reduce is measured as the
optimizer's own full-precision gradient mean (the matrices in an "adamw" group).

Every row includes the optimizer's per-step non-finite gradient check, one all-reduce of one
float32 (≤ 8 bytes); "vs fp32 AR" divides by the plain ring all-reduce of the fp32 gradient,
8·n·(M−1)/M for n entries.

Writes results/comm.csv with the same numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from shardopt.buckets import DEFAULT_BUCKET_BYTES, chunk_sizes
from shardopt.comm import collective_bytes
from shardopt.dion import compressed, oriented_shape, rank_of
from shardopt.placement import MatrixLayout
from shardopt.vote import VOTE_FORMATS, resolve_vote, vote_bytes

from results_table import write_csv

LAYERS = 12
LAYER_SHAPES = {"attn.qkv": (2304, 768), "attn.proj": (768, 768), "mlp.fc": (3072, 768), "mlp.proj": (768, 3072)}
REPLICAS = (2, 4, 8, 16, 64)
MEASURED_REPLICAS = (2, 4)
ITEMSIZE = 4   # fp32 gradients and Dion factors
BASELINE = "fp32 all-reduce"
MODES = [BASELINE] + [f"sign-muon {v}" for v in VOTE_FORMATS + ("auto",)] + ["dion rank_fraction 1/4",
                                                                           "dion rank_fraction 1/16"]
RANK_FRACTIONS = {"dion rank_fraction 1/4": 0.25, "dion rank_fraction 1/16": 1 / 16}
ROOT = Path(__file__).resolve().parents[1]


def buckets(layers: int) -> list[tuple[tuple[int, int], int]]:
    """(shape, matrices) per optimizer bucket: same-shape matrices, cut under the default
    bucket_bytes (shardopt/buckets.py; the cut a work split adds moves no bytes)."""
    return [(shape, size) for shape in LAYER_SHAPES.values()
            for size in chunk_sizes(layers, shape[0] * shape[1] * ITEMSIZE, DEFAULT_BUCKET_BYTES)]


def fp32_allreduce_bytes(replicas: int, layers: int) -> int:
    """The plain ring all-reduce of the fp32 gradient, one flat buffer: 8·n·(M−1)/M."""
    numel = sum(m * n * k for (m, n), k in buckets(layers))
    return collective_bytes("all_reduce", numel * ITEMSIZE, replicas)


def formula_bytes(mode: str, replicas: int, layers: int) -> int:
    """Bytes one replica sends per optimizer step for `mode` on `layers` layers, from the comm
    layer's formulas: the exchange, plus the step's non-finite check (one float32 all-reduce)."""
    check = collective_bytes("all_reduce", 4, replicas)
    if mode == BASELINE:
        return fp32_allreduce_bytes(replicas, layers) + check
    total = check
    for (m, n), k in buckets(layers):
        if mode.startswith("sign-muon"):
            fmt = resolve_vote(mode.split()[-1], k * m * n, replicas)
            total += vote_bytes(fmt, k * m * n, replicas)
        else:
            layout = MatrixLayout(shape=(m, n), shard_rows=(m,))
            group = {"rank_fraction": RANK_FRACTIONS[mode], "rank_multiple_of": 1}
            if compressed(layout, group):       # all-reduce mean of P (k·a·r) and R (k·b·r)
                a, b = oriented_shape(layout)
                r = rank_of(layout, group)
                total += collective_bytes("all_reduce", k * a * r * ITEMSIZE, replicas)
                total += collective_bytes("all_reduce", k * b * r * ITEMSIZE, replicas)
            else:                               # fallback: gradient mean
                total += collective_bytes("all_reduce", k * m * n * ITEMSIZE, replicas)
    return total


def resolved(mode: str, replicas: int) -> str:
    """The vote format "auto" resolves to (per bucket; the same for every bucket here)."""
    if mode != "sign-muon auto":
        return ""
    return "/".join(sorted({resolve_vote("auto", k * m * n, replicas) for (m, n), k in buckets(LAYERS)}))


# ---- measured: one optimizer step per mode on gloo processes -------------------------------------
def _worker(rank: int, world_size: int, init_file: str, out_path: str, layers: int) -> None:
    import torch.distributed as dist

    import shardopt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    generator = torch.Generator().manual_seed(1000 * rank + 1)   # this replica's gradients, reused by every mode
    grads = [torch.randn(shape, generator=generator) for _ in range(layers) for shape in LAYER_SHAPES.values()]
    measured = {}
    for mode in MODES:
        params = [torch.nn.Parameter(torch.zeros(*grad.shape)) for grad in grads]
        if mode == BASELINE:
            opt = shardopt.Dion([{"params": params, "algorithm": "adamw"}], replicate_mesh=dist.group.WORLD)
        elif mode.startswith("sign-muon"):   # ns_steps=1: the wire does not depend on it
            opt = shardopt.SignMuon(params, lr=0.01, ns_steps=1, vote=mode.split()[-1], replicate_mesh=dist.group.WORLD)
        else:
            opt = shardopt.Dion(params, rank_fraction=RANK_FRACTIONS[mode], replicate_mesh=dist.group.WORLD)
        for param, grad in zip(params, grads):   # the optimizers read .grad, never write it
            param.grad = grad
        start = time.perf_counter()
        opt.step()
        seconds = time.perf_counter() - start
        stats = opt.comm_stats()
        measured[mode] = {"bytes": stats["replicate"]["bytes_sent"], "shard_bytes": stats["shard"]["bytes_sent"],
                          "consistent": opt.replicas_consistent(), "step_s": seconds}
    if rank == 0:
        Path(out_path).write_text(json.dumps(measured))
    dist.destroy_process_group()


def measure(world_size: int, layers: int) -> dict:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="shardopt-bench-") as tmp:
        out_path = os.path.join(tmp, "measured.json")
        mp.spawn(_worker, args=(world_size, os.path.join(tmp, "store"), out_path, layers), nprocs=world_size)
        return json.loads(Path(out_path).read_text())


# ---- table ---------------------------------------------------------------------------------------
def rows(measured: dict, layers_run: int) -> list[dict]:
    out = []
    for replicas in REPLICAS:
        baseline = fp32_allreduce_bytes(replicas, LAYERS)
        for mode in MODES:
            formula = formula_bytes(mode, replicas, LAYERS)
            check = collective_bytes("all_reduce", 4, replicas)   # per step, not per layer
            assert (formula - check) * layers_run == (formula_bytes(mode, replicas, layers_run) - check) * LAYERS, mode
            out.append({"replicas": replicas, "mode": mode, "source": "formula", "layers": LAYERS,
                        "bytes_per_step": formula, "ratio_vs_fp32_allreduce": formula / baseline,
                        "auto_format": resolved(mode, replicas), "measured_equals_formula": "", "replicas_identical": ""})
            if replicas in measured:
                got = measured[replicas][mode]
                expected = formula_bytes(mode, replicas, layers_run)
                check = collective_bytes("all_reduce", 4, replicas)
                scaled = (got["bytes"] - check) * LAYERS // layers_run + check
                out.append({"replicas": replicas, "mode": mode, "source": f"measured ({layers_run} layer(s) ×{LAYERS // layers_run})",
                            "layers": layers_run, "bytes_per_step": scaled, "ratio_vs_fp32_allreduce": scaled / baseline,
                            "auto_format": resolved(mode, replicas),
                            "measured_equals_formula": got["bytes"] == expected and got["shard_bytes"] == 0,
                            "replicas_identical": got["consistent"]})
    return out


def print_table(table: list[dict]) -> None:
    header = f"{'M':>3}  {'exchange':<28} {'source':<26} {'bytes/step/replica':>18} {'vs fp32 AR':>11}  {'meas==formula':>13}  note"
    print(header)
    print("-" * len(header))
    previous = None
    for row in table:
        if previous is not None and row["replicas"] != previous:
            print()
        previous = row["replicas"]
        ratio = row["ratio_vs_fp32_allreduce"]
        note = f"auto → {row['auto_format']}" if row["auto_format"] else ""
        if row["replicas_identical"] != "":
            note = (note + "; " if note else "") + f"replicas identical: {row['replicas_identical']}"
        print(f"{row['replicas']:>3}  {row['mode']:<28} {row['source']:<26} {row['bytes_per_step']:>18,} "
              f"{f'1/{1 / ratio:.2f}':>11}  {str(row['measured_equals_formula']):>13}  {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure-layers", type=int, default=1, choices=(1, 2, 3, 4, 6, 12),
                        help="layers in the measured runs (a divisor of 12; default 1)")
    parser.add_argument("--no-measure", action="store_true", help="formula rows only")
    parser.add_argument("--csv", default=str(ROOT / "results" / "comm.csv"))
    args = parser.parse_args()
    start = time.perf_counter()
    measured = {}
    if not args.no_measure:
        for world_size in MEASURED_REPLICAS:
            measured[world_size] = measure(world_size, args.measure_layers)
    table = rows(measured, args.measure_layers)
    numel = sum(m * n for m, n in LAYER_SHAPES.values()) * LAYERS
    print(f"GPT-2 small matrices: {LAYERS} layers × {list(LAYER_SHAPES)} = {numel:,} fp32 entries; "
          f"replicate-axis bytes one replica sends per optimizer step\n")
    print_table(table)
    write_csv(args.csv, table)
    mismatches = [r for r in table if r["measured_equals_formula"] is False or r["replicas_identical"] is False]
    print(f"\nwrote {args.csv} ({len(table)} rows) in {time.perf_counter() - start:.0f} s; "
          f"rerun: python launch/bench_comm.py [--measure-layers N] [--no-measure] [--csv PATH]")
    if measured:
        step_s = {w: {m: round(v["step_s"], 2) for m, v in r.items()} for w, r in measured.items()}
        print(f"measured step seconds (rank 0, CPU, includes compute): {step_s}")
    if mismatches:
        print(f"MISMATCH: {len(mismatches)} measured rows differ from the formula or left replicas unequal")
        sys.exit(1)


if __name__ == "__main__":
    main()
