"""Train a small language model with DeepSpeed, the optimizer chosen by the DeepSpeed JSON config.

    # CPU, 2 processes (gloo):
    torchrun --nproc_per_node 2 integrations/deepspeed/train.py \\
        --deepspeed_config integrations/deepspeed/dion_bf16.json --steps 50
    # GPUs, DeepSpeed launcher (NCCL):
    deepspeed --num_gpus 8 integrations/deepspeed/train.py \\
        --deepspeed_config integrations/deepspeed/signmuon_bf16.json --steps 500

Configs: dion_bf16.json (dion_zero3_bf16.json: the same at ZeRO stage 3), signmuon_bf16.json, signmuon_fp16.json (shardopt: the
engine's gradient all-reduce is off and the optimizer exchanges low-rank factors
or 1-bit votes itself), signmuon_local_steps_bf16.json (Sign-Muon inside local
steps: the replicas sync every 10 steps), signmuon_lion_bf16.json (Sign-Muon with the non-matrix params on
Lion: every parameter crosses as a 1-bit vote), onebit_adam_bf16.json (DeepSpeed's removed
"OneBitAdam" config, run by shardopt: exact Adam for freeze_step steps, then a 1-bit momentum
exchange) and adamw.json (the baseline: DeepSpeed's full-precision all-reduce). `shardopt.deepspeed.initialize` reads the config's "optimizer"
section and hands every other optimizer type to deepspeed.initialize unchanged.

Each step prints the loss (mean over ranks) and the bytes this rank sent on the
data-parallel axis in that step: counted by shardopt's communication layer, or,
for the baseline, the fp32-equivalent ring all-reduce volume 2·(M−1)/M · 4·params.

The model and the data are those of the FSDP2 entry point (integrations/model.py, a small
nanoGPT-style GPT; integrations/data.py, Shakespeare's plays as bytes — prepare them once with
`python integrations/data.py`); each rank reads its own batches, drawn from (seed, step, rank).
--val-batches N prints the mean loss over N val batches per rank at the end.
"""

import argparse
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

import shardopt.deepspeed
from integrations import data
from integrations.model import GPT, GPTConfig
from shardopt.wire.comm import collective_bytes


def make_model(args) -> GPT:
    torch.manual_seed(args.seed)   # the same initial weights on every rank
    return GPT(GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))


def get_batch(args, tokens, step: int, micro: int, micro_batches: int, batch_size: int, device):
    """(x, y) for this rank's micro-batch `micro` of optimizer step `step`."""
    x, y = data.get_batch(tokens, batch_size, args.block_size, args.seed, (step - 1) * micro_batches + micro,
                          dist.get_rank())
    return x.to(device), y.to(device)


@torch.no_grad()
def val_loss(args, engine, tokens, batch_size: int, batches: int) -> float:
    """The mean loss over `batches` val batches on every rank (the same batches whatever the optimizer)."""
    engine.eval()
    total = torch.zeros((), device=engine.device)
    for index in range(batches):
        x, y = data.get_batch(tokens, batch_size, args.block_size, args.seed, index, dist.get_rank(), split="val")
        total += engine(x.to(engine.device), y.to(engine.device))[1].float() / batches
    dist.all_reduce(total)
    engine.train()
    return total.item() / dist.get_world_size()


# ---- training ------------------------------------------------------------------------------------
def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64, help="context length")
    parser.add_argument("--data-dir", type=Path, default=data.default_cache() / "shakespeare")
    parser.add_argument("--val-batches", type=int, default=0,
                        help="at the end, the mean val loss over this many batches per rank (0: none)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)   # --deepspeed_config
    args = parser.parse_args()

    tokens = data.load(args.data_dir, "train")
    model = make_model(args)
    engine, *_ = shardopt.deepspeed.initialize(args=args, model=model)   # engine, optimizer, loader, scheduler
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        optimizer = shardopt.deepspeed.shard_optimizer(engine)
    except ValueError:
        optimizer = None                               # the baseline: DeepSpeed's own all-reduce
    allreduce_bytes = collective_bytes("all_reduce", 4 * sum(p.numel() for p in model.parameters()), world)
    micro_batches, batch_size = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    if rank == 0:
        print(f"{type(optimizer or engine.optimizer).__name__} on {world} ranks, "
              f"{sum(p.numel() for p in model.parameters()):,} params, fp32 all-reduce = {allreduce_bytes:,} B/step")

    sent_before, start = 0, time.perf_counter()
    for step in range(1, args.steps + 1):
        loss_sum = torch.zeros((), device=engine.device)
        for micro in range(micro_batches):
            x, y = get_batch(args, tokens, step, micro, micro_batches, batch_size, engine.device)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach() / micro_batches
        dist.all_reduce(loss_sum)                      # for the log line only
        if optimizer is not None:
            sent = optimizer.comm_stats()["replicate"]["bytes_sent"]
            step_bytes, sent_before = f"{sent - sent_before:>9,} B", sent
        else:
            step_bytes = f"{allreduce_bytes:>9,} B (fp32-equivalent all-reduce)"
        if rank == 0:
            lr = engine.get_lr()[0]
            print(f"step {step:5d} | loss {loss_sum.item() / world:.4f} | lr {lr:.2e} | sent {step_bytes}"
                  f"{' | skipped (overflow)' if not engine.was_step_applied() else ''}", flush=True)
    if isinstance(optimizer, shardopt.LocalSteps):   # the last round ends synced: every replica holds one model
        synced = optimizer.sync_now()
        if rank == 0 and synced:
            print(f"end: synced fragment(s) {synced} left pending by the last round (LocalSteps.sync_now)", flush=True)
    if rank == 0:
        total = optimizer.comm_stats()["replicate"]["bytes_sent"] if optimizer else allreduce_bytes * args.steps
        print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f} s, {total:,} B sent on the data-parallel axis"
              f" ({total / (allreduce_bytes * args.steps):.3f} of an fp32 all-reduce)")
    if args.val_batches:
        val = val_loss(args, engine, data.load(args.data_dir, "val"), batch_size, args.val_batches)
        if rank == 0:
            print(f"val loss {val:.4f} ({args.val_batches} batches of {batch_size} per rank, {world} ranks)")
    consistent = optimizer is None or optimizer.replicas_consistent()   # (local steps: synced at the end above)
    del optimizer
    dist.barrier()
    shardopt.deepspeed.shutdown(engine)                # engine, then every process group, before the interpreter exits
    if not consistent:
        raise SystemExit("replicas diverged: weights differ across data-parallel ranks")


if __name__ == "__main__":
    main()
