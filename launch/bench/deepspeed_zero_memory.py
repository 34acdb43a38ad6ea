"""Bytes per parameter per rank, by kind, of the DeepSpeed plugin at ZeRO 2 against DeepSpeed's own ZeRO 2.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 launch/bench/deepspeed_zero_memory.py --label after  # CPU, gloo, ~1 min
    DS_ACCELERATOR=cuda torchrun --nproc_per_node 1 launch/bench/deepspeed_zero_memory.py --print-only  # one GPU
    bash launch/deepspeed_memory_history.sh   # every row of results/deepspeed_zero_memory.csv, earlier commits too

The GPT of integrations/model.py (4 layers of width 512 by default: 12.7M params) in bf16 on the launched ranks
(W), gradient accumulation 2, for
  shardopt   "type": "SignMuon", "zero_optimization": {"stage": 2}, "shardopt": {"mesh": {"replicate": R, "shard": S}}
             for each --meshes RxS (default: W/2 x 2 and 1 x W; non-matrix params in AdamW), through
             shardopt.deepspeed.initialize
  deepspeed  "type": "AdamW" (torch_adam), "zero_optimization": {"stage": 2}, deepspeed.initialize: DeepSpeed's own
             ZeRO 2 over the W ranks (mesh "1xW": one partition over all of them)
Two ways to count the same bytes:
  the tensor walk (every device)   every tensor the engine, its optimizer wrapper and the optimizer hold, found by
      walking their attributes (lists, dicts, DeepSpeed and shardopt objects, the .grad of every tensor met),
      counted once per storage, in the first kind that claims it:
        weights   the module's parameters (DeepSpeed's ZeRO 2 flattens them into one bf16 buffer: that buffer)
        masters   fp32 master copies (the wrapper's fp32_groups; ZeRO 2's single_partition_of_fp32_groups; shardopt's
                  packed bf16 masters between steps: low 16 bits and a rounding bit per entry, the optimizer's
                  param_residency, whose masters rebuilt per bucket during the step count in step_peak)
        grads     any tensor's .grad, and ZeRO 2's gradient partitions and buckets (averaged_gradients, ipg buffers)
        state     the optimizer's state (momenta, Adam moments, step counters)
        buffers   everything else found (the model's buffers, flat scratch, the plugin's gather buffers)
      at three moments: after backward (the gradients held before the step), inside the optimizer's step (a
      pre-step hook: the wrapper's fp32 gradients exist then), after the step; the largest over the moments and
      over the ranks, per kind and for the total.
  the allocator   step_peak: the peak of each optimizer step after the first (engine.step() at the accumulation
      boundary; the first creates the state) above what was allocated just before it: the transients the walk does not see (the fp32 gradient copies a
      wrapper makes, the node all-gather's buffers, Newton–Schulz's work). CUDA: torch.cuda.max_memory_allocated;
      CPU: the RSS high-water mark (/proc/self/status VmHWM, reset through /proc/self/clear_refs; run with
      MALLOC_MMAP_THRESHOLD_=65536, as launch/deepspeed_memory_history.sh does, so that freed buffers leave the RSS).
      device_peak (CUDA only, blank on the CPU): torch.cuda.max_memory_allocated over the steps above what was
      allocated before the engine was built: the walk's tensors plus activations and transients.
Writes results/deepspeed_zero_memory.csv (one row per configuration; rows of other --labels kept; --label names
the code measured); --print-only writes nothing (launch/gpu_smoke.sh).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

import shardopt.deepspeed
from integrations.model import GPT, GPTConfig
from integrations.results import read_csv, write_csv

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("weights", "masters", "grads", "state", "buffers")
FIELDS = ["label", "run", "optimizer", "zero_stage", "mesh", "ranks", "device", "params", *KINDS, "total",
          "step_peak", "device_peak"]
MASTER_NAMES = ("fp32_groups", "single_partition_of_fp32_groups")
GRAD_NAMES = ("averaged_gradients", "ipg_buffer", "grads_in_partition", "fp32_groups_gradients",
              "grads_in_ipg_bucket", "extra_large_param_to_reduce")


class Census:
    """The storages reachable from some roots, each counted once, in the first kind that claims it."""

    def __init__(self):
        self.kind_of: dict[int, tuple[str, int]] = {}
        self.seen: set[int] = set()

    def claim(self, tensor, kind: str) -> None:
        if not torch.is_tensor(tensor) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else id(tensor)
        if key not in self.kind_of:
            self.kind_of[key] = (kind, storage.nbytes())
        if tensor.grad is not None:
            self.claim(tensor.grad, "grads")

    def walk(self, obj, kind: str = "buffers", depth: int = 0) -> None:
        """Claim every tensor under obj as `kind` (or by its attribute name: masters, grads)."""
        if depth > 8 or id(obj) in self.seen:
            return
        if torch.is_tensor(obj):
            self.claim(obj, kind)
            return
        self.seen.add(id(obj))
        if isinstance(obj, dict):
            items = list(obj.items())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = [(None, value) for value in obj]
        elif type(obj).__module__.split(".")[0] in ("deepspeed", "shardopt", "torch") and hasattr(obj, "__dict__") \
                and not isinstance(obj, (torch.distributed.ProcessGroup,)):
            items = list(vars(obj).items())
        else:
            return
        for name, value in items:
            inner = kind
            if isinstance(name, str) and name.startswith(MASTER_NAMES):
                inner = "masters"
            elif isinstance(name, str) and name.startswith(GRAD_NAMES):
                inner = "grads"
            self.walk(value, inner, depth + 1)

    def totals(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for kind, nbytes in self.kind_of.values():
            out[kind] += nbytes
        return out


def count(engine, optimizer) -> dict[str, int]:
    census = Census()
    for param in engine.module.parameters():
        census.claim(param, "weights")
    wrapper = engine.optimizer
    for name in MASTER_NAMES:   # the wrappers' master copies, before the walk reaches them by another name
        census.walk(getattr(wrapper, name, None), "masters")
    census.walk(getattr(optimizer, "param_residency", None), "masters")   # shardopt's packed bf16 masters
    census.walk(optimizer.state, "state")
    census.walk(engine.module, "buffers")
    census.walk(wrapper)
    census.walk(optimizer)
    return census.totals()


def parse_mesh(text: str, world: int) -> tuple[int, int]:
    """"RxS" → (R, S), with R·S = the world size."""
    try:
        replicate, shard = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--meshes: {text!r} is not RxS (e.g. 2x2)") from None
    if replicate < 1 or shard < 1 or replicate * shard != world:
        raise SystemExit(f"--meshes: {text} has {replicate * shard} ranks, but {world} were launched; give RxS with "
                         f"R·S = {world}")
    return replicate, shard


def default_meshes(world: int) -> list[str]:
    """Two nodes of W/2 ranks (where W is even and > 2), and one partition over all W ranks as DeepSpeed's."""
    return [*([f"{world // 2}x2"] if world % 2 == 0 and world > 2 else []), f"1x{world}"]


def config_for(mesh: tuple[int, int] | None, args) -> dict:
    """shardopt's Sign-Muon on `mesh` (R, S), or DeepSpeed's own AdamW where mesh is None."""
    common = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 2,
              "steps_per_print": 10**6, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    if mesh is not None:
        bucket = {"bucket_bytes": args.bucket_bytes} if args.bucket_bytes else {}
        return {**common, "optimizer": {"type": "SignMuon", "params": {"lr": 0.003, "momentum": 0.9, **bucket}},
                "shardopt": {"mesh": {"replicate": mesh[0], "shard": mesh[1]}, "nonmatrix": {"lr": 0.004}}}
    return {**common, "optimizer": {"type": "AdamW", "params": {"lr": 0.004, "torch_adam": True}}}


def build(mesh: tuple[int, int] | None, args):
    """(engine, the optimizer inside it, the model's parameter count)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd))
    params = sum(p.numel() for p in model.parameters())
    if mesh is not None:
        engine, *_ = shardopt.deepspeed.initialize(model=model, config=config_for(mesh, args))
        return engine, shardopt.deepspeed.shard_optimizer(engine), params
    import deepspeed
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config_for(None, args))
    return engine, engine.basic_optimizer, params


class StepPeak:
    """The peak bytes of a stretch of code (begin → end) above those allocated when it began: torch.cuda's allocator
    statistics on CUDA, else the process's RSS high-water mark (Linux /proc). On CUDA also the peak since the
    object was made (`device_peak`), over the resets of each stretch."""

    def __init__(self, device: torch.device):
        self.device, self.cuda, self.highest = device, device.type == "cuda", 0
        if self.cuda:
            torch.cuda.synchronize(device)
            self.origin = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

    def _rss(self, field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {field}: the CPU step peak needs Linux")

    def begin(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.highest = max(self.highest, torch.cuda.max_memory_allocated(self.device))
            self.start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")   # VmHWM ← the current RSS
            self.start = self._rss("VmRSS")

    def end(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.start
        return self._rss("VmHWM") - self.start

    def device_peak(self) -> int | None:
        """CUDA: the allocator's peak since the object was made, above what was allocated then; None on the CPU."""
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return max(self.highest, torch.cuda.max_memory_allocated(self.device)) - self.origin


def measure(mesh: tuple[int, int] | None, args) -> tuple[dict, int, str]:
    """This rank's largest bytes per kind and total over the moments (the module doc), the largest step_peak,
    device_peak on CUDA (else None); the parameter count; the device's name."""
    from deepspeed.accelerator import get_accelerator
    device = torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))
    peak = StepPeak(device)
    engine, optimizer, params = build(mesh, args)
    largest = dict.fromkeys([*KINDS, "total", "step_peak"], 0)

    def note(*_):
        sizes = count(engine, optimizer)
        for kind, nbytes in [*sizes.items(), ("total", sum(sizes.values()))]:
            largest[kind] = max(largest[kind], nbytes)

    hook = optimizer.register_step_pre_hook(note)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for index in range(args.steps):
        for micro in range(2):
            tokens = torch.randint(0, 256, (args.micro_batch, args.block_size + 1), generator=generator)
            _, loss = engine(tokens[:, :-1].to(engine.device), tokens[:, 1:].to(engine.device))
            engine.backward(loss)
            note()
            peak.begin()
            engine.step()
            if micro == 1 and index > 0:   # the optimizer's step, from the second on (the first makes the state)
                largest["step_peak"] = max(largest["step_peak"], peak.end())
        note()
    hook.remove()
    largest["device_peak"] = peak.device_peak()
    engine.destroy()
    return largest, params, torch.cuda.get_device_name(device) if peak.cuda else device.type


def row(label: str, mesh: tuple[int, int] | None, args) -> dict:
    """One CSV row: `measure` on every rank, the largest over the ranks, in bytes per parameter."""
    largest, params, device = measure(mesh, args)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, largest)
    worst = {key: None if largest[key] is None else max(sizes[key] for sizes in every) for key in largest}
    world = dist.get_world_size()
    return {"label": label, "run": "shardopt" if mesh else "deepspeed", "optimizer": "SignMuon" if mesh else "AdamW",
            "zero_stage": 2, "mesh": "x".join(map(str, mesh or (1, world))), "ranks": world, "device": device,
            "params": params, **{key: None if worst[key] is None else round(worst[key] / params, 3) for key in worst}}


def show(rows: list[dict]) -> None:
    """The table on stdout, each run's total, and its total + step_peak (what a rank needs at the step: held plus
    transients), as ratios to DeepSpeed's own ZeRO 2 measured in the same run."""
    deepspeed = next(r for r in rows if r["run"] == "deepspeed")
    print(f"bytes per parameter per rank (largest over {rows[0]['ranks']} ranks), {rows[0]['params']:,} params, bf16, "
          f"on {rows[0]['device']}")
    columns = [*KINDS, "total", "step_peak", "device_peak"]
    print(f"  {'run':<20}" + "".join(f"{name:>12}" for name in columns) + "  vs DeepSpeed ZeRO 2: total, total + step_peak")
    for r in rows:
        cells = "".join(f"{'n/a':>12}" if r[name] is None else f"{r[name]:>12.2f}" for name in columns)
        needed = (r["total"] + r["step_peak"]) / (deepspeed["total"] + deepspeed["step_peak"])
        print(f"  {r['run'] + ' ' + r['mesh']:<20}{cells}  {r['total'] / deepspeed['total']:.2f}x, {needed:.2f}x")
    print("rerun: bash launch/deepspeed_memory_history.sh (every label, CPU), or this script with --print-only")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="")
    parser.add_argument("--meshes", nargs="+", help="shardopt's (replicate x shard) meshes, e.g. 2x2 1x4 "
                                                    "(default: W/2x2 and 1xW)")
    parser.add_argument("--bucket-bytes", type=int, help="shardopt's bucket_bytes (default: its own), which bounds "
                        "its step's working copies and the node all-gather's buffer; a model this small fits one "
                        "default bucket, as no large model does")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "deepspeed_zero_memory.csv")
    parser.add_argument("--print-only", action="store_true", help="print the table, write no CSV")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: give 2 or more (the first step creates the state; step_peak is the "
                     f"largest of the later ones)")
    import deepspeed
    deepspeed.init_distributed()
    world = dist.get_world_size()
    meshes = [parse_mesh(text, world) for text in args.meshes or default_meshes(world)]
    rows = [row(args.label, mesh, args) for mesh in [*meshes, None]]
    if dist.get_rank() == 0:
        show(rows)
        if not args.print_only:
            kept = [r for r in (read_csv(args.out) if args.out.exists() else []) if r["label"] != args.label]
            if kept and list(kept[0]) != FIELDS:
                raise SystemExit(f"{args.out} has the columns {list(kept[0])}, not {FIELDS}: rerun every label "
                                 f"(bash launch/deepspeed_memory_history.sh) or give another --out")
            write_csv(args.out, FIELDS, kept + rows)


if __name__ == "__main__":
    main()
