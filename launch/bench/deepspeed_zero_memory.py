"""Bytes per parameter per rank, by kind, of the DeepSpeed plugin at ZeRO 2 against DeepSpeed's own ZeRO 2.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 launch/bench/deepspeed_zero_memory.py   # CPU, gloo, ~1 min

The GPT of integrations/model.py in bf16 on 4 ranks, gradient accumulation 2, for
  shardopt   "type": "SignMuon", "zero_optimization": {"stage": 2}, "shardopt": {"mesh": {"replicate": 2, "shard": 2}}
             (non-matrix params in AdamW), through shardopt.deepspeed.initialize
  deepspeed  "type": "AdamW" (torch_adam), "zero_optimization": {"stage": 2}, deepspeed.initialize: DeepSpeed's own
             ZeRO 2 over the 4 ranks
Every tensor the engine, its optimizer wrapper and the optimizer hold is found by walking their attributes
(lists, dicts, DeepSpeed and shardopt objects, the .grad of every tensor met), counted once per storage, and
put in the first kind that claims it:
  weights   the module's parameters (DeepSpeed's ZeRO 2 flattens them into one bf16 buffer: that buffer)
  masters   fp32 master copies (the wrapper's fp32_groups; ZeRO 2's single_partition_of_fp32_groups)
  grads     any tensor's .grad, and ZeRO 2's gradient partitions and buckets (averaged_gradients, ipg buffers)
  state     the optimizer's state (momenta, Adam moments, step counters)
  buffers   everything else found (the model's buffers, flat scratch, the plugin's gather buffers)
Three moments, largest over the moments and over the 4 ranks per kind and for the total: after backward (the
gradients held before the step), inside the optimizer's step (a pre-step hook: the wrapper's fp32 gradients
exist then), after the step. Writes results/deepspeed_zero_memory.csv (one row per configuration; --label
names the code measured, e.g. before/after).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import shardopt.deepspeed
from integrations.model import GPT, GPTConfig
from integrations.results import read_csv, write_csv

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("weights", "masters", "grads", "state", "buffers")
FIELDS = ["label", "run", "optimizer", "zero_stage", "mesh", "ranks", "params", *KINDS, "total"]
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
    census.walk(optimizer.state, "state")
    census.walk(engine.module, "buffers")
    census.walk(wrapper)
    census.walk(optimizer)
    return census.totals()


def config_for(run: str, args) -> dict:
    common = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 2,
              "steps_per_print": 10**6, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    if run == "shardopt":
        return {**common, "optimizer": {"type": "SignMuon", "params": {"lr": 0.003, "momentum": 0.9}},
                "shardopt": {"mesh": {"replicate": 2, "shard": 2}, "nonmatrix": {"lr": 0.004}}}
    return {**common, "optimizer": {"type": "AdamW", "params": {"lr": 0.004, "torch_adam": True}}}


def measure(run: str, args) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd))
    params = sum(p.numel() for p in model.parameters())
    config = config_for(run, args)
    if run == "shardopt":
        engine, *_ = shardopt.deepspeed.initialize(model=model, config=config)
        optimizer = shardopt.deepspeed.shard_optimizer(engine)
    else:
        import deepspeed
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        optimizer = engine.basic_optimizer
    largest = dict.fromkeys([*KINDS, "total"], 0)

    def note(*_):
        sizes = count(engine, optimizer)
        for kind, nbytes in [*sizes.items(), ("total", sum(sizes.values()))]:
            largest[kind] = max(largest[kind], nbytes)

    hook = optimizer.register_step_pre_hook(note)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        for _ in range(2):
            tokens = torch.randint(0, 256, (args.micro_batch, args.block_size + 1), generator=generator)
            _, loss = engine(tokens[:, :-1].to(engine.device), tokens[:, 1:].to(engine.device))
            engine.backward(loss)
            note()
            engine.step()
        note()
    hook.remove()
    engine.destroy()
    return largest, params, engine.zero_optimization_stage()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "deepspeed_zero_memory.csv")
    args = parser.parse_args()
    rows = []
    for run in ("shardopt", "deepspeed"):
        largest, params, _ = measure(run, args)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, largest)
        worst = {key: max(sizes[key] for sizes in every) for key in largest}
        rows.append({"label": args.label, "run": run, "optimizer": "SignMuon" if run == "shardopt" else "AdamW",
                     "zero_stage": 2, "mesh": "2x2" if run == "shardopt" else "1x4", "ranks": dist.get_world_size(),
                     "params": params, **{key: round(worst[key] / params, 3) for key in [*KINDS, "total"]}})
    if dist.get_rank() == 0:
        print(f"bytes per parameter per rank (largest over {dist.get_world_size()} ranks), {rows[0]['params']:,} params, bf16")
        print(f"  {'run':<10}" + "".join(f"{kind:>9}" for kind in [*KINDS, "total"]))
        for row in rows:
            print(f"  {row['run']:<10}" + "".join(f"{row[kind]:>9.2f}" for kind in [*KINDS, "total"]))
        print(f"  ratio     {rows[0]['total'] / rows[1]['total']:.2f}× DeepSpeed's own ZeRO 2")
        kept = [row for row in (read_csv(args.out) if args.out.exists() else []) if row["label"] != args.label]
        write_csv(args.out, FIELDS, [{key: row[key] for key in FIELDS} for row in kept] + rows)


if __name__ == "__main__":
    main()
