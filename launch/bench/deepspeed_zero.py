"""DeepSpeed ZeRO stages 0/1/2/3 with shardopt on 2 nodes × 2 ranks: memory per rank, bytes per axis, replicas.

    torchrun --nproc_per_node 4 launch/bench/deepspeed_zero.py            # CPU, gloo, ~1 min
    torchrun --nproc_per_node 4 launch/bench/deepspeed_zero.py --steps 20 --n-embd 128

The GPT of integrations/model.py in bf16 under shardopt.deepspeed.initialize, for Dion (rank 1/4) and
Sign-Muon, at "zero_optimization" stage 0 (every rank a replica, the plugin's default) and stages 1,
2 and 3 with "shardopt": {"mesh": {"replicate": 2, "shard": 2}}; random tokens, each rank its own.
Per configuration (the largest value over the 4 ranks where ranks differ):
  state      bytes of the tensors in shard_optimizer(engine).state
  state/S0   state over stage 0's; "owned" is the formula, the rank's share of the state from the partition
             itself (Σ owned elements × state tensors per element / Σ all; a row-split param, at stage 3 Dion's
             matrices and the element-wise groups' params, counts its rows' part), 1/S up to whole-tensor balance
  grads      bytes of the model's .grad tensors held between backward and the step (bf16)
  masters    bytes of DeepSpeed's fp32 master copies (stages 2/3: the owned slots only)
  weights    bytes of the model's bf16 weights held between steps (their storage; stage 3: the owned ones and the
             rank's row blocks of Dion's matrices and the element-wise params)
  repl B/st  replicate-axis bytes per step (between nodes); B/node the same summed over a node's ranks (stage 0:
             each rank its own node); shard B/st the bytes inside a node
  identical  all four ranks' weights bitwise equal; loss: mean over ranks, first → last step
Writes results/deepspeed_zero.csv.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

import shardopt.deepspeed
from integrations.model import GPT, GPTConfig
from integrations.results import write_csv
from shardopt.optim.guard import replicas_equal
from shardopt.wire.comm import Axis

ROOT = Path(__file__).resolve().parents[2]

OPTIMIZERS = {"Dion": {"lr": 0.02, "rank_fraction": 0.25}, "SignMuon": {"lr": 0.003, "momentum": 0.9}}
MESH = {"replicate": 2, "shard": 2}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def run(args, optimizer: str, stage: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd))
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
              "optimizer": {"type": optimizer, "params": OPTIMIZERS[optimizer]},
              "shardopt": {"scalar": {"lr": 0.003}, **({"mesh": MESH} if stage else {})}}
    engine, *_ = shardopt.deepspeed.initialize(model=model, config=config)
    ours = shardopt.deepspeed.shard_optimizer(engine)
    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, 64, (16, args.block_size + 1), generator=generator)   # 64 of the 256 symbols
    losses, grads = [], 0
    for _ in range(args.steps):
        total = 0.0
        for micro in range(2):
            batch = tokens[8 * micro:8 * micro + 8]
            _, loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            if micro == 0:       # held between backward and the next one (stage 2: the owned part only)
                grads = max(grads, tensor_bytes(p.grad for p in engine.module.parameters()))
            engine.step()
            total += loss.item() / 2
        losses.append(total)
    stats = ours.comm_stats()
    mean = torch.tensor([losses[0], losses[-1]])
    dist.all_reduce(mean)
    with shardopt.deepspeed.gathered_weights(engine):   # stage 3: every weight whole for the comparison
        identical = replicas_equal([p.detach() for p in engine.module.parameters()], Axis("replicate", dist.group.WORLD))
    zero = ours.zero
    owned = sum(c * zero.share(i) for i, c in enumerate(zero.costs)) / sum(zero.costs) if zero else 1.0
    release = getattr(ours.wiring, "release", None)   # stage 3: the row slots are held as row blocks
    row = {"optimizer": optimizer, "stage": stage, "mesh": f"{MESH['replicate']}x{MESH['shard']}" if stage else "4x1",
           "params": sum(p.numel() for p in model.parameters()),
           "state_bytes": tensor_bytes(v for s in ours.state.values() for v in s.values() if torch.is_tensor(v)),
           "owned_fraction": owned, "grad_bytes": grads,
           "master_bytes": tensor_bytes(p for g in engine.optimizer.fp32_groups for p in g),
           "weight_bytes": sum(p.untyped_storage().nbytes() for p in engine.module.parameters())
           + tensor_bytes(release.blocks.values() if release is not None else ()),
           "replicate_bytes_per_step": stats["replicate"]["bytes_sent"] / args.steps,
           "shard_bytes_per_step": stats["shard"]["bytes_sent"] / args.steps,
           "identical": identical,
           "loss_first": mean[0].item() / dist.get_world_size(), "loss_last": mean[1].item() / dist.get_world_size()}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    engine.destroy()
    ranks_per_node = MESH["shard"] if stage else 1
    per_node = [sum(r["replicate_bytes_per_step"] for r in rows[first:first + ranks_per_node])
                for first in range(0, len(rows), ranks_per_node)]
    return {**{key: (max(r[key] for r in rows) if isinstance(row[key], (int, float)) and key not in ("identical",)
                     else row[key]) for key in row}, "replicate_bytes_per_node_step": max(per_node)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--csv", type=Path, default=ROOT / "results" / "deepspeed_zero.csv")
    args = parser.parse_args()
    os.environ.setdefault("LOCAL_WORLD_SIZE", "2")
    rows = [run(args, optimizer, stage) for optimizer in OPTIMIZERS for stage in (0, 1, 2, 3)]
    if dist.get_rank() == 0:
        header = (f"{'optimizer':>9} {'stage':>5} {'mesh':>4} {'state B':>9} {'state/S0':>8} {'owned':>7} "
                  f"{'grads B':>8} {'masters B':>9} {'weights B':>9} {'repl B/st':>9} {'repl/S0':>7} {'B/node':>8} {'shard B/st':>10} "
                  f"{'identical':>9}  loss")
        print(header)
        for row in rows:
            base = next(r for r in rows if r["optimizer"] == row["optimizer"] and r["stage"] == 0)
            row["state_vs_stage0"] = row["state_bytes"] / base["state_bytes"]
            row["replicate_vs_stage0"] = row["replicate_bytes_per_step"] / base["replicate_bytes_per_step"]
            print(f"{row['optimizer']:>9} {row['stage']:>5} {row['mesh']:>4} {row['state_bytes']:>9,} "
                  f"{row['state_vs_stage0']:>8.2f} {row['owned_fraction']:>7.2f} {row['grad_bytes']:>8,} "
                  f"{row['master_bytes']:>9,} {row['weight_bytes']:>9,} {row['replicate_bytes_per_step']:>9,.0f} {row['replicate_vs_stage0']:>7.2f} "
                  f"{row['replicate_bytes_per_node_step']:>8,.0f} {row['shard_bytes_per_step']:>10,.0f} {str(row['identical']):>9}  "
                  f"{row['loss_first']:.3f} → {row['loss_last']:.3f}")
        rounded = [{key: round(value, 4) if isinstance(value, float) else value for key, value in row.items()}
                   for row in rows]
        write_csv(args.csv, list(rounded[0]), rounded)
        print(f"wrote {args.csv}")
    dist.barrier()
    shardopt.deepspeed.shutdown()


if __name__ == "__main__":
    main()
