"""Transient memory and time of one optimizer step, each case in a fresh process.

    python launch/bench/step_memory.py                # k = 32 and 128 bf16 1024×1024 matrices, Dion 1/4 and Sign-Muon
    python launch/bench/step_memory.py --size 256 --bucket-bytes 1048576   # the scaled-down check the tests run
    python launch/bench/step_memory.py --llama1b           # adds one Dion step on Llama-3.2-1B's matrix shapes (fp32)

Transient memory is the RSS high-water mark of the second step above the RSS just before it
(the first step creates the state, so the second starts from the steady state): the child
resets the high-water mark through /proc/self/clear_refs, and runs with a fixed glibc mmap
threshold so that freed working copies go back to the system (otherwise a step could reuse
heap that an earlier step kept, and the figure would read low). One thread per child
(OMP_NUM_THREADS=1). The first step of Sign-Muon runs one Newton–Schulz step (it only has to
create the state); the measured step runs `--ns-steps`. Writes results/step_memory.csv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from integrations.results import write_csv

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20
# Llama-3.2-1B: 16 layers of q, k, v, o, gate, up, down (hidden 2048, 8 KV heads of 64, MLP 8192)
LLAMA_1B_LAYER = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)]
LLAMA_1B_LAYERS = 16


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} (Linux only)")


def _child(case: dict) -> dict:
    """Build the parameters and the optimizer, step twice, measure the second step."""
    import gc

    import torch

    import shardopt

    torch.set_num_threads(1)
    dtype = getattr(torch, case["dtype"])
    shapes = [tuple(s) for s in case["shapes"]]
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.empty(shape, dtype=dtype)) for shape in shapes]
    grads = {}   # one gradient per distinct shape, shared by the params of that shape (saves memory; read only)
    for param in params:
        if param.shape not in grads:
            grads[param.shape] = torch.randn(param.shape, generator=generator).to(dtype)
        param.data.normal_(generator=generator)
        param.grad = grads[param.shape]
    options = {"bucket_bytes": case["bucket_bytes"]}
    if case["algorithm"] == "dion":
        optimizer = shardopt.Dion(params, lr=0.01, rank_fraction=case["rank_fraction"], **options)
    else:
        optimizer = shardopt.SignMuon(params, lr=1e-3, ns_steps=1, ns_dtype="float32", **options)
    optimizer.step()                                              # creates the state
    optimizer.param_groups[0]["ns_steps"] = case["ns_steps"]
    gc.collect()
    steady_kib = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")                 # reset VmHWM to the current RSS
    start = time.perf_counter()
    optimizer.step()
    seconds = time.perf_counter() - start
    peak_kib = _status_kib("VmHWM")
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    return {"steady_mib": steady_kib / 1024, "peak_mib": peak_kib / 1024,
            "transient_mib": (peak_kib - steady_kib) / 1024, "param_mib": param_bytes / MIB, "step_s": seconds}


def measure(case: dict, timeout_s: float = 3600) -> dict:
    """Run one case in a fresh Python process; its measurements merged into the case."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)], env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"case {case['name']} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return {**case, **json.loads(done.stdout.strip().splitlines()[-1])}


def matrix_cases(size: int, counts, dtype: str, bucket_bytes: int, ns_steps: int) -> list[dict]:
    cases = []
    for count in counts:
        shapes = [(size, size)] * count
        cases.append({"name": f"dion 1/4, {count}×{size}²", "algorithm": "dion", "rank_fraction": 0.25,
                      "ns_steps": ns_steps, "shapes": shapes, "count": count, "dtype": dtype,
                      "bucket_bytes": bucket_bytes})
        cases.append({"name": f"sign-muon ns {ns_steps}, {count}×{size}²", "algorithm": "signmuon",
                      "rank_fraction": 1.0, "ns_steps": ns_steps, "shapes": shapes, "count": count,
                      "dtype": dtype, "bucket_bytes": bucket_bytes})
    return cases


def llama_case(bucket_bytes: int) -> dict:
    shapes = LLAMA_1B_LAYER * LLAMA_1B_LAYERS
    return {"name": "dion 1/4, Llama-3.2-1B matrices", "algorithm": "dion", "rank_fraction": 0.25, "ns_steps": 5,
            "shapes": shapes, "count": len(shapes), "dtype": "float32", "bucket_bytes": bucket_bytes}


def main() -> None:
    from shardopt.layout.buckets import DEFAULT_BUCKET_BYTES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--counts", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    parser.add_argument("--algorithms", nargs="+", default=["dion", "signmuon"])
    parser.add_argument("--llama1b", action="store_true", help="add a Dion 1/4 step on Llama-3.2-1B matrix shapes")
    parser.add_argument("--csv", default=str(ROOT / "results" / "step_memory.csv"))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for tests)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    cases = [c for c in matrix_cases(args.size, args.counts, args.dtype, args.bucket_bytes, args.ns_steps)
             if c["algorithm"] in args.algorithms]
    if args.llama1b:
        cases.append(llama_case(args.bucket_bytes))
    rows = []
    header = f"{'case':<40}{'param MiB':>11}{'steady MiB':>12}{'transient MiB':>15}{'÷ params':>10}{'step s':>9}"
    if not args.json:
        print(f"one step, transient RSS above the steady state, fresh process per case, 1 thread, "
              f"bucket_bytes={args.bucket_bytes}")
        print(header)
    for case in cases:
        result = measure(case)
        row = {"case": result["name"], "algorithm": result["algorithm"], "matrices": result["count"],
               "dtype": result["dtype"], "bucket_bytes": result["bucket_bytes"], "ns_steps": result["ns_steps"],
               "param_mib": round(result["param_mib"], 1), "steady_mib": round(result["steady_mib"], 1),
               "peak_mib": round(result["peak_mib"], 1), "transient_mib": round(result["transient_mib"], 1),
               "transient_vs_params": round(result["transient_mib"] / result["param_mib"], 3),
               "step_s": round(result["step_s"], 2)}
        rows.append(row)
        if not args.json:
            print(f"{row['case']:<40}{row['param_mib']:>11.1f}{row['steady_mib']:>12.1f}{row['transient_mib']:>15.1f}"
                  f"{row['transient_vs_params']:>10.3f}{row['step_s']:>9.2f}", flush=True)
            write_csv(args.csv, list(rows[0]), rows)     # after every row: a long run keeps what it measured
    if args.json:
        print(json.dumps(rows))
        return
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
