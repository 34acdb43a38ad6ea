"""The small GPT of integrations/fsdp/train.py trained the way users train today, for the benchmarks:
torch DistributedDataParallel and torch's own communication hooks and optimizers.

    torchrun --standalone --nproc_per_node 2 launch/bench/train_ddp.py --method powersgd --powersgd-rank 4

Same model (integrations/model.py), options and defaults, batches, lr schedule, evaluation and
metrics.csv columns as integrations/fsdp/train.py (both from integrations/training.py), so that
launch/bench/ reads both alike. The methods and their split of the parameters: launch/bench/peers.py
(`--lr` for the 2-D weights, `--nonmatrix-lr` for the embeddings, tied head and norms).

Bytes: DDP-based methods count the all-reduces torch's hooks issue (launch/bench/counting.py);
signsgd's vote is counted by shardopt's comm layer. `replicate_bytes_per_step` is what one rank sends
per step on groups that span nodes; a node is --ranks-per-node consecutive ranks (default: torchrun's
LOCAL_WORLD_SIZE), so one machine can stand for several nodes (--standalone with --ranks-per-node 2).
"""

import argparse
import contextlib
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import peers
from integrations import data, step_profile, training
from integrations.model import GPT, GPTConfig

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--method", choices=peers.METHODS, required=True)
parser.add_argument("--lr", type=float, required=True, help="lr of the 2-D weights (all params for signsgd)")
training.add_renamed(parser, "--nonmatrix-lr", "--scalar-lr", type=float, default=3e-3,
                     help="AdamW lr of embeddings and norms")
peers.add_arguments(parser)
parser.add_argument("--ranks-per-node", type=int, default=None, help="ranks that share a node "
                    "(default: LOCAL_WORLD_SIZE); sets which groups count as between nodes and localsgd's groups")
training.add_gpt_arguments(parser)
parser.add_argument("--out-dir", type=Path, required=True)
step_profile.add_argument(parser)
args = training.parse_args(parser, training.GPT_DEFAULTS)

dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
rank, world = dist.get_rank(), dist.get_world_size()
local_world = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
if world % local_world:
    parser.error(f"--ranks-per-node {local_world} must divide the world size {world}")
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
master = rank == 0
batches = training.Batches(args, rank, device)

torch.manual_seed(args.seed)
model = GPT(GPTConfig(vocab_size=data.vocab_size(args.data_dir), block_size=args.block_size, n_layer=args.n_layer,
                      n_head=args.n_head, n_embd=args.n_embd)).to(device)
peer = peers.build(model, args.method, args.lr, args.nonmatrix_lr, args, local_world, args.seed)
metrics = training.Metrics(args.out_dir / "metrics.csv", ["step", "tokens", "lr", "train_loss", "val_loss", "step_ms",
                           "replicate_bytes_per_step", "within_node_bytes_per_step", "link_tx_bytes", "elapsed_s"], master)
if master:
    print(f"{args.method}: {args.tokenizer} vocabulary, {model.num_params():,} params, {world} ranks "
          f"({local_world} per node), lr {args.lr:g}", flush=True)

metrics.add({"step": 0, "tokens": 0, "val_loss": f"{training.evaluate(model, batches, args.eval_batches):.6f}",
             "elapsed_s": 0})
peer.sent()                                                     # not the evaluation's
loop_started = time.perf_counter()
window = dict(loss=0.0, steps=0, seconds=0.0, between=0, within=0)
profile = step_profile.StepProfile(*args.profile_optimizer) if args.profile_optimizer and master else None
for step in range(1, args.steps + 1):
    tick = time.perf_counter()
    lr = training.lr_multiplier(step, args.warmup, args.steps)
    for group in peer.param_groups():
        group.setdefault("base_lr", group["lr"])
        group["lr"] = group["base_lr"] * lr
    _, loss = peer.net(*batches("train", step))
    loss.backward()
    with profile.step(step) if profile else contextlib.nullcontext():
        peer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    window["seconds"] += time.perf_counter() - tick
    window["steps"] += 1
    window["loss"] += loss.item()
    between, within = peer.sent()
    window["between"] += between
    window["within"] += within
    log_now, evaluate_now = training.log_and_eval(step, args.steps, args)
    if log_now:
        n = window["steps"]
        train_loss = training.mean_over_ranks(torch.tensor(window["loss"] / n, device=device))
        val_loss = training.evaluate(model, batches, args.eval_batches) if evaluate_now else None
        row = training.metrics_row(step, step * args.batch_size * args.block_size * world, args.lr * lr, train_loss,
                                   val_loss, n, window["seconds"], window["between"], loop_started)
        metrics.add(row | {"within_node_bytes_per_step": window["within"] // n})
        if master:
            print(f"step {step}/{args.steps}: train loss {row['train_loss']}"
                  + (f", val loss {row['val_loss']}" if row["val_loss"] else "")
                  + f", step {row['step_ms']} ms, replicate {row['replicate_bytes_per_step']:,} B/step", flush=True)
        window = dict(loss=0.0, steps=0, seconds=0.0, between=0, within=0)
peer.close()
if profile:
    profile.write(args.out_dir / step_profile.PROFILE_CSV)
dist.barrier()
dist.destroy_process_group()
