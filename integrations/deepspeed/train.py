"""Train a small language model with DeepSpeed, the optimizer chosen by the DeepSpeed JSON config.

    # CPU, 2 processes (gloo):
    torchrun --nproc_per_node 2 integrations/deepspeed/train.py \\
        --deepspeed_config integrations/deepspeed/dion_bf16.json --steps 50
    # GPUs, DeepSpeed launcher (NCCL):
    deepspeed --num_gpus 8 integrations/deepspeed/train.py \\
        --deepspeed_config integrations/deepspeed/signmuon_bf16.json --steps 500

Configs: dion_bf16.json, signmuon_bf16.json, signmuon_fp16.json (shardopt: the
engine's gradient all-reduce is off and the optimizer exchanges low-rank factors
or 1-bit votes itself) and adamw.json (the baseline: DeepSpeed's full-precision
all-reduce). `shardopt.deepspeed.initialize` reads the config's "optimizer"
section and hands every other optimizer type to deepspeed.initialize unchanged.

Each step prints the loss (mean over ranks) and the bytes this rank sent on the
data-parallel axis in that step: counted by shardopt's communication layer, or,
for the baseline, the fp32-equivalent ring all-reduce volume 2·(M−1)/M · 4·params.

The model and the data are two functions below (`make_model`, `get_batch`): a
next-token MLP over a short context, on a synthetic token stream drawn from a fixed
random table, the same on every run and different on every rank.
"""

import argparse
import time

import deepspeed
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import shardopt.deepspeed
from shardopt.comm import collective_bytes

VOCAB, CONTEXT = 64, 4


# ---- model ---------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embed the last CONTEXT tokens, concatenate, project, a few MLP blocks, predict the next token.
    shardopt.param_groups puts in_proj and the blocks' up/down in the matrix group, and the
    embedding, norms and lm_head in the AdamW group."""

    def __init__(self, width: int = 128, depth: int = 2):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, width // CONTEXT)
        self.in_proj = nn.Linear(width, width, bias=False)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, context):                       # (batch, CONTEXT) token ids
        x = self.in_proj(self.wte(context).flatten(1))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))             # (batch, VOCAB) logits


def make_model(args) -> nn.Module:
    torch.manual_seed(args.seed)
    return TinyLM()


# ---- data ----------------------------------------------------------------------------------------
def get_batch(args, step: int, micro: int, batch_size: int, device):
    """(context, target) for this rank: 90% of the time the target is the last context token mapped
    through a fixed random table, else a random token (the loss floor is about 0.74 nats)."""
    table = torch.randint(VOCAB, (VOCAB,), generator=torch.Generator().manual_seed(args.seed))
    generator = torch.Generator().manual_seed(((args.seed * 100_003 + step) * 1_009 + micro) * 1_009 + dist.get_rank())
    context = torch.randint(VOCAB, (batch_size, CONTEXT), generator=generator)
    noise = torch.randint(VOCAB, (batch_size,), generator=generator)
    target = torch.where(torch.rand(batch_size, generator=generator) < 0.9, table[context[:, -1]], noise)
    return context.to(device), target.to(device)


# ---- training ------------------------------------------------------------------------------------
def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)   # --deepspeed_config
    args = parser.parse_args()

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
            context, target = get_batch(args, step, micro, batch_size, engine.device)
            loss = F.cross_entropy(engine(context).float(), target)
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
    if rank == 0:
        total = optimizer.comm_stats()["replicate"]["bytes_sent"] if optimizer else allreduce_bytes * args.steps
        print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f} s, {total:,} B sent on the data-parallel axis"
              f" ({total / (allreduce_bytes * args.steps):.3f} of an fp32 all-reduce)")
    consistent = optimizer is None or optimizer.replicas_consistent()
    dist.barrier()
    dist.destroy_process_group()                       # a clean exit (gloo threads end before the interpreter)
    if not consistent:
        raise SystemExit("replicas diverged: weights differ across data-parallel ranks")


if __name__ == "__main__":
    main()
