"""What one optimizer step asks of the host: aten ops dispatched and host syncs, per step, on the CPU.

    python launch/bench/step_ops.py                        # signmuon and dion, GPT-2 small, M = 8 and 64
    python launch/bench/step_ops.py --replicas 8 --model demo   # a quick look (the demo GPT)
    python launch/bench/step_ops.py --device cuda          # the same on a GPU (launch/gpu_smoke.sh runs it)

On a GPU every aten op is a kernel launch the host queues (~5–20 µs each), and every host sync
(`.item()`, `.tolist()`, `bool(t)`, `int(t)`, `torch.equal`) stops the host until the device has
caught up, so these two numbers bound how much of a step's time the host can hide. Both are counted
here without a GPU: rank 0 of a world of M ranks on torch's fake process group
(`init_process_group("fake")`: collectives are accepted and move nothing), one step of the optimizer
under a TorchDispatchMode that counts every aten op, every c10d collective (its dtype and device)
and every op that hands a tensor's value to Python (`aten._local_scalar_dense`, `aten.equal`,
`aten.is_nonzero`; `Tensor.tolist` reads a CPU tensor without a dispatch, so it is counted by a
wrapper). Reads of the CPU step counters (`state["step"]`, which torch.optim keeps on the CPU on a
GPU too) are not syncs and are left out. With `--device cuda` the model, its gradients and the
optimizer live on the GPU (the fake group takes CUDA tensors too), so the collectives' devices and
the syncs are the GPU run's own.

Model: GPT-2 small (12 layers of 768, vocab 50257, tied head; integrations/model.py), its params split
by `shardopt.param_groups`: the 48 matrices on the algorithm, the rest on Lion (Sign-Muon: every
param votes) or AdamW (Dion, rank_fraction 1/4). The counted step is the second (the first creates
the state); the double-averaging check, which runs at step 1 and every 1000th, is off. The matmuls
and QR factorizations are counted but not computed (their results are zeros of the right shape:
no op's choice depends on their values), so a step takes seconds, not minutes, on a CPU.

Writes results/step_ops.csv (algorithm, model, replicas, aten_ops_per_step, host_syncs_per_step)
and results/step_collectives.csv (the collectives of the same steps: kind, dtype, device, calls);
with `--device cuda`, results/step_ops_cuda.csv and results/step_collectives_cuda.csv.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import shardopt
from integrations.model import GPT, GPTConfig
from integrations.results import write_csv

from campaign import print_table

ROOT = Path(__file__).resolve().parents[2]

FIELDS = ["algorithm", "model", "replicas", "aten_ops_per_step", "host_syncs_per_step"]
COLLECTIVE_FIELDS = ["algorithm", "model", "replicas", "collective", "dtype", "device", "calls_per_step"]
MODELS = {"gpt2-small": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
          "demo": GPTConfig()}
ALGORITHMS = {"signmuon": ("lion", {}), "dion": ("adamw", {"rank_fraction": 0.25})}
SYNC_OPS = ("aten._local_scalar_dense", "aten.equal", "aten.is_nonzero")
HEAVY_OPS = ("aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.linalg_qr")


def _on_meta(value):
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _host_key(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), tensor.data_ptr()


class StepCounter(TorchDispatchMode):
    """Counts aten ops, host syncs (reads of a tensor's value into Python, not of `host` tensors: their
    (device, data pointer)) and collectives ((name, dtype, device) → calls); heavy ops give zeros of
    their shape on their device."""

    def __init__(self, host: set):
        super().__init__()
        self.host, self.ops, self.syncs = host, 0, 0
        self.collectives: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        self.ops += 1
        if name in SYNC_OPS and _host_key(args[0]) not in self.host:
            self.syncs += 1
        if name.startswith("c10d."):
            tensor = next(t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor))
            self.collectives[(name.removeprefix("c10d.").strip("_"), str(tensor.dtype).removeprefix("torch."),
                              str(tensor.device))] += 1
        if name in HEAVY_OPS:
            device = next(t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)).device
            shapes = func(*tree_map(_on_meta, args), **tree_map(_on_meta, kwargs))
            return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
                            if isinstance(t, torch.Tensor) else t, shapes)
        return func(*args, **kwargs)


def count_tolist(counter: StepCounter):
    """Wrap Tensor.tolist so that each call on a non-host tensor counts as a host sync; returns the original."""
    original = torch.Tensor.tolist

    def tolist(tensor):
        if _host_key(tensor) not in counter.host:
            counter.syncs += 1
        return original(tensor)
    torch.Tensor.tolist = tolist
    return original


def build(algorithm: str, config: GPTConfig, device: torch.device):
    """GPT model on `device`, its optimizer on the fake world as the replicate axis, random gradients."""
    torch.manual_seed(0)
    model = GPT(config).to(device)
    nonmatrix, options = ALGORITHMS[algorithm]
    groups = shardopt.param_groups(model, algorithm, nonmatrix, matrix_options=options)
    optimizer = (shardopt.SignMuon if algorithm == "signmuon" else shardopt.Dion)(
        groups, lr=1e-3, replicate_mesh=dist.group.WORLD, double_averaging_check_every=0)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    return optimizer


def measure(algorithm: str, model: str, replicas: int, device: torch.device) -> tuple[dict, list[dict]]:
    """One counted step (the second) at `replicas` ranks: the CSV row and the collectives' rows."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=replicas)
    try:
        optimizer = build(algorithm, MODELS[model], device)
        optimizer.step()
        host = {_host_key(state["step"]) for state in optimizer.state.values()}
        counter = StepCounter(host)
        original = count_tolist(counter)
        try:
            with counter:
                optimizer.step()
        finally:
            torch.Tensor.tolist = original
    finally:
        dist.destroy_process_group()
    key = {"algorithm": algorithm, "model": model, "replicas": replicas}
    return ({**key, "aten_ops_per_step": counter.ops, "host_syncs_per_step": counter.syncs},
            [{**key, "collective": kind, "dtype": dtype, "device": device, "calls_per_step": calls}
             for (kind, dtype, device), calls in sorted(counter.collectives.items())])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="gpt2-small")
    parser.add_argument("--replicas", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS))
    parser.add_argument("--device", default="cpu", help="where the model and the optimizer live (cpu, cuda)")
    parser.add_argument("--csv", type=Path, help="default results/step_ops.csv (step_ops_cuda.csv on a GPU)")
    parser.add_argument("--collectives-csv", type=Path, help="default results/step_collectives.csv (…_cuda.csv)")
    args = parser.parse_args()
    device = torch.device(args.device)
    suffix = "" if device.type == "cpu" else f"_{device.type}"
    torch.set_num_threads(1)
    rows, collectives = [], []
    for algorithm in args.algorithms:
        for replicas in args.replicas:
            row, called = measure(algorithm, args.model, replicas, device)
            rows.append(row)
            collectives += called
    print_table(rows)
    print_table(collectives)
    write_csv(args.csv or ROOT / "results" / f"step_ops{suffix}.csv", FIELDS, rows)
    write_csv(args.collectives_csv or ROOT / "results" / f"step_collectives{suffix}.csv", COLLECTIVE_FIELDS, collectives)


if __name__ == "__main__":
    main()
