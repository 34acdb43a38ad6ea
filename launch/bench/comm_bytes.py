"""Whole-model replicate-axis bytes per step per rank: DDP's all-reduce vs shardopt, every parameter.

    python launch/bench/comm_bytes.py                  # formula rows for 5 models + measured rows (2 and 4 processes)
    python launch/bench/comm_bytes.py --no-measure     # formula rows only (seconds)

Models (built on the meta device: shapes only, no memory): the demo GPT of integrations/ (byte and
BPE-4096 vocabularies; tied head), GPT-2 small and medium shapes (no biases; tied head), and
Llama-3-8B shapes (GQA, SwiGLU, untied 128256×4096 head). The parameters are split by
`shardopt.param_groups` (embeddings, head, norms → the non-matrix group; 2-D weights → the matrix
group), exactly as a user's run would split them; tied weights count once.

Methods: DDP fp32 and DDP bf16 (a ring all-reduce of every gradient: what users run today),
Dion at rank_fraction 1/4 and 1/16 (bf16 and fp32 wire), Sign-Muon (vote "auto"); each shardopt
method with AdamW (full-precision mean) or Lion (1-bit vote) for the non-matrix group (the `scalar`
column). Formula rows come from `shardopt.optim.traffic` (the functions the communication layer counts with, on the buckets
the optimizer forms) and include the step's non-finite check; measured rows run one real step on
gloo processes for the two demo GPTs and read `comm_stats()`, less the double-averaging check that
step 1 (and every N-th step after) adds: `measured == formula` must hold.

Writes results/comm.csv; `python launch/results_table.py --readme README.md` puts it in the README.
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
from torch import nn

import shardopt
from integrations.model import GPT, GPTConfig
from integrations.results import write_csv
from shardopt.optim import traffic

ROOT = Path(__file__).resolve().parents[2]

REPLICAS = (2, 4, 8, 64)
MEASURED_MODELS = ("demo GPT (bytes)", "demo GPT (BPE-4096)")
MEASURED_REPLICAS = (2, 4)
METHODS = {   # name → (matrix algorithm, optimizer options); None: DDP all-reduce in that dtype
    "DDP fp32": None, "DDP bf16": None,
    "dion 1/4 bf16": ("dion", {"rank_fraction": 0.25, "wire_dtype": "bfloat16"}),
    "dion 1/4 fp32": ("dion", {"rank_fraction": 0.25, "wire_dtype": "float32"}),
    "dion 1/16 bf16": ("dion", {"rank_fraction": 1 / 16, "wire_dtype": "bfloat16"}),
    "dion 1/16 fp32": ("dion", {"rank_fraction": 1 / 16, "wire_dtype": "float32"}),
    "sign-muon": ("signmuon", {"vote": "auto"}),
}
SCALARS = ("adamw", "lion")


class LlamaShapes(nn.Module):
    """Llama-3-8B's parameter shapes (no forward): 32 layers, width 4096, GQA with 8 KV heads,
    SwiGLU 14336, RMSNorms, a 128256-token embedding and an untied head."""

    def __init__(self, layers=32, dim=4096, kv_dim=1024, hidden=14336, vocab=128256):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            q_proj=nn.Linear(dim, dim, bias=False), k_proj=nn.Linear(dim, kv_dim, bias=False),
            v_proj=nn.Linear(dim, kv_dim, bias=False), o_proj=nn.Linear(dim, dim, bias=False),
            gate_proj=nn.Linear(dim, hidden, bias=False), up_proj=nn.Linear(dim, hidden, bias=False),
            down_proj=nn.Linear(hidden, dim, bias=False), input_norm=nn.RMSNorm(dim),
            post_attention_norm=nn.RMSNorm(dim))) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)


def models() -> dict:
    """name → a function building the model (call it under a device context)."""
    return {
        "demo GPT (bytes)": lambda: GPT(GPTConfig()),
        "demo GPT (BPE-4096)": lambda: GPT(GPTConfig(vocab_size=4096)),
        "GPT-2 small": lambda: GPT(GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)),
        "GPT-2 medium": lambda: GPT(GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024)),
        "Llama-3-8B shapes": LlamaShapes,
    }


def optimizer_for(model: nn.Module, method: str, scalar: str, replicate_mesh=None):
    """The optimizer a user would build for `method` (DDP methods: an "adamw" group of every
    parameter, whose full-precision mean is DDP's all-reduce)."""
    if METHODS[method] is None:
        return shardopt.Dion([{"params": list(model.parameters()), "algorithm": "adamw"}], replicate_mesh=replicate_mesh)
    algorithm, options = METHODS[method]
    groups = shardopt.param_groups(model, algorithm, scalar)
    cls = shardopt.Dion if algorithm == "dion" else shardopt.SignMuon
    return cls(groups, **({"lr": 0.01} if cls is shardopt.SignMuon else {}), **options, replicate_mesh=replicate_mesh)


def cases():
    for method in METHODS:
        for scalar in (("",) if METHODS[method] is None else SCALARS):
            yield method, scalar


def formula_bytes(model: nn.Module, method: str, scalar: str, replicas: int) -> int:
    if METHODS[method] is None:
        dtype = torch.bfloat16 if method.endswith("bf16") else torch.float32
        return traffic.allreduce_bytes(sum(p.numel() for p in model.parameters()), dtype, replicas)
    optimizer = optimizer_for(model, method, scalar)
    return sum(optimizer.replicate_bytes_per_step(replicas)) + traffic.nonfinite_check_bytes(replicas)


# ---- measured: one optimizer step per case on gloo processes -------------------------------------
def _worker(rank: int, world_size: int, init_file: str, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    measured = {}
    for name in MEASURED_MODELS:
        for method, scalar in cases():
            torch.manual_seed(0)
            model = models()[name]()
            if method == "DDP bf16":
                model = model.to(torch.bfloat16)
            generator = torch.Generator().manual_seed(1000 * rank + 1)   # this replica's own gradients
            for param in model.parameters():
                param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
            optimizer = optimizer_for(model, method, scalar, dist.group.WORLD)
            optimizer.step()
            # less the double-averaging check, which this first step runs (then every N-th step only)
            sent = optimizer.comm_stats()["replicate"]["bytes_sent"] - traffic.double_averaging_check_bytes(world_size)
            if METHODS[method] is None:   # DDP's stand-in: shardopt's mean of every gradient, less its NaN check
                sent -= traffic.nonfinite_check_bytes(world_size)
            measured[f"{name}|{method}|{scalar}"] = {"bytes": sent,
                                                     "consistent": optimizer.replicas_consistent()}
    if rank == 0:
        Path(out_path).write_text(json.dumps(measured))
    dist.destroy_process_group()


def measure(world_size: int) -> dict:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="shardopt-bench-") as tmp:
        out_path = os.path.join(tmp, "measured.json")
        mp.spawn(_worker, args=(world_size, os.path.join(tmp, "store"), out_path), nprocs=world_size)
        return json.loads(Path(out_path).read_text())


def table(measured: dict) -> list[dict]:
    rows = []
    for name, build in models().items():
        with torch.device("meta"):
            model = build()
        numel = sum(p.numel() for p in model.parameters())
        scalar_share = sum(p.numel() for g in shardopt.param_groups(model, "dion") if g["algorithm"] != "dion"
                           for p in g["params"]) / numel
        for replicas in REPLICAS:
            ddp = {dtype: traffic.allreduce_bytes(numel, getattr(torch, dtype), replicas) for dtype in ("float32", "bfloat16")}
            for method, scalar in cases():
                sent = formula_bytes(model, method, scalar, replicas)
                got = measured.get(replicas, {}).get(f"{name}|{method}|{scalar}")
                rows.append({"model": name, "params": numel, "non_matrix_share": round(scalar_share, 4),
                             "replicas": replicas, "method": method, "scalar": scalar, "bytes_per_step": sent,
                             "vs_ddp_fp32": round(ddp["float32"] / sent, 3), "vs_ddp_bf16": round(ddp["bfloat16"] / sent, 3),
                             "measured_bytes": "" if got is None else got["bytes"],
                             "measured_equals_formula": "" if got is None else got["bytes"] == sent,
                             "replicas_identical": "" if got is None else got["consistent"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-measure", action="store_true", help="formula rows only")
    parser.add_argument("--csv", type=Path, default=ROOT / "results" / "comm.csv")
    args = parser.parse_args()
    start = time.perf_counter()
    measured = {} if args.no_measure else {world_size: measure(world_size) for world_size in MEASURED_REPLICAS}
    rows = table(measured)
    print(f"{'model':<20} {'M':>3} {'method':<15} {'scalar':<6} {'bytes/step/rank':>16} {'vs DDP fp32':>12} "
          f"{'vs DDP bf16':>12}  measured")
    for row in rows:
        check = "" if row["measured_bytes"] == "" else \
            f"{row['measured_bytes']:,} ({'= formula' if row['measured_equals_formula'] else 'MISMATCH'}" \
            f"{', replicas identical' if row['replicas_identical'] else ', REPLICAS DIFFER'})"
        print(f"{row['model']:<20} {row['replicas']:>3} {row['method']:<15} {row['scalar']:<6} {row['bytes_per_step']:>16,} "
              f"{'1/' + format(row['vs_ddp_fp32'], '.1f'):>12} {'1/' + format(row['vs_ddp_bf16'], '.1f'):>12}  {check}")
    write_csv(args.csv, list(rows[0]), rows)
    bad = [r for r in rows if r["measured_equals_formula"] is False or r["replicas_identical"] is False]
    print(f"\nwrote {args.csv} ({len(rows)} rows) in {time.perf_counter() - start:.0f} s; "
          f"rerun: python launch/bench/comm_bytes.py [--no-measure]")
    if bad:
        print(f"MISMATCH: {len(bad)} measured rows differ from the formula or left replicas unequal")
        sys.exit(1)


if __name__ == "__main__":
    main()
