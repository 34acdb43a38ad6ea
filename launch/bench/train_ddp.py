"""The small GPT of integrations/fsdp/train.py trained the way users train today, for the benchmarks:
torch DistributedDataParallel and torch's own communication hooks and optimizers.

    torchrun --standalone --nproc_per_node 2 launch/bench/train_ddp.py --method powersgd --powersgd-rank 4

Same model (integrations/model.py), data and batches (integrations/data.py), lr schedule, evaluation
and metrics.csv columns as integrations/fsdp/train.py, so that launch/bench/ reads both alike.
The methods and their split of the parameters: launch/bench/peers.py (`--lr` for the 2-D weights,
`--scalar-lr` for the embeddings, tied head and norms).

Bytes: DDP-based methods count the all-reduces torch's hooks issue (launch/bench/counting.py);
signsgd's vote is counted by shardopt's comm layer. `replicate_bytes_per_step` is what one rank sends
per step on groups that span nodes; a node is --ranks-per-node consecutive ranks (default: torchrun's
LOCAL_WORLD_SIZE), so one machine can stand for several nodes (--standalone with --ranks-per-node 2).
"""

import argparse
import csv
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "integrations"), str(ROOT / "launch" / "bench")]
import data  # noqa: E402
import peers  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from netdev import link_tx_bytes  # noqa: E402

FIELDS = ["step", "tokens", "lr", "train_loss", "val_loss", "step_ms", "replicate_bytes_per_step",
          "within_node_bytes_per_step", "link_tx_bytes", "elapsed_s"]
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--method", choices=peers.METHODS, required=True)
parser.add_argument("--lr", type=float, required=True, help="lr of the 2-D weights (all params for signsgd)")
parser.add_argument("--scalar-lr", type=float, default=3e-3, help="AdamW lr of embeddings and norms")
peers.add_arguments(parser)
parser.add_argument("--ranks-per-node", type=int, default=None, help="ranks that share a node "
                    "(default: LOCAL_WORLD_SIZE); sets which groups count as between nodes and localsgd's groups")
parser.add_argument("--n-layer", type=int, default=4)
parser.add_argument("--n-head", type=int, default=4)
parser.add_argument("--n-embd", type=int, default=128)
parser.add_argument("--block-size", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--warmup", type=int, default=20)
parser.add_argument("--log-every", type=int, default=10)
parser.add_argument("--eval-every", type=int, default=50)
parser.add_argument("--eval-batches", type=int, default=8)
parser.add_argument("--out-dir", type=Path, required=True)
parser.add_argument("--tokenizer", choices=data.TOKENIZERS, default="byte", help="byte (vocab 256) or bpe (4096)")
parser.add_argument("--data-dir", type=Path, default=None, help="default: the prepared data of --tokenizer")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
args.data_dir = args.data_dir or data.data_dir(data.default_cache(), args.tokenizer)

dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
rank, world = dist.get_rank(), dist.get_world_size()
local_world = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
if world % local_world:
    parser.error(f"--ranks-per-node {local_world} must divide the world size {world}")
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
master = rank == 0
train_tokens, val_tokens = data.load(args.data_dir, "train"), data.load(args.data_dir, "val")


def batch(split: str, step: int):
    tokens = train_tokens if split == "train" else val_tokens
    x, y = data.get_batch(tokens, args.batch_size, args.block_size, args.seed, step, rank, split)
    return x.to(device), y.to(device)


torch.manual_seed(args.seed)
model = GPT(GPTConfig(vocab_size=data.vocab_size(args.data_dir), block_size=args.block_size, n_layer=args.n_layer,
                      n_head=args.n_head, n_embd=args.n_embd)).to(device)
peer = peers.build(model, args.method, args.lr, args.scalar_lr, args, local_world, args.seed)


def lr_multiplier(step: int) -> float:
    """Linear warm-up, then cosine to 0.1 at args.steps (as integrations/fsdp/train.py)."""
    if step <= args.warmup:
        return step / max(1, args.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))))


def mean_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], device=device)
    dist.all_reduce(tensor)
    return tensor.item() / world


@torch.no_grad()
def evaluate() -> float:
    model.eval()
    loss = torch.stack([model(*batch("val", i))[1] for i in range(args.eval_batches)]).mean().item()
    model.train()
    return mean_over_ranks(loss)


rows = []
if master:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{args.method}: {args.tokenizer} vocabulary, {model.num_params():,} params, {world} ranks "
          f"({local_world} per node), lr {args.lr:g}", flush=True)


def write_row(row: dict) -> None:
    rows.append(dict.fromkeys(FIELDS, "") | row)
    if master:
        with (args.out_dir / "metrics.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, FIELDS)
            writer.writeheader()
            writer.writerows(rows)


write_row({"step": 0, "tokens": 0, "val_loss": f"{evaluate():.6f}", "elapsed_s": 0})
peer.sent()                                                     # not the evaluation's
loop_started = time.perf_counter()
window = dict(loss=0.0, steps=0, seconds=0.0, between=0, within=0)
for step in range(1, args.steps + 1):
    tick = time.perf_counter()
    lr = lr_multiplier(step)
    for group in peer.param_groups():
        group.setdefault("base_lr", group["lr"])
        group["lr"] = group["base_lr"] * lr
    _, loss = peer.net(*batch("train", step))
    loss.backward()
    peer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    window["seconds"] += time.perf_counter() - tick
    window["steps"] += 1
    window["loss"] += loss.item()
    between, within = peer.sent()
    window["between"] += between
    window["within"] += within
    evaluate_now = args.eval_every and (step % args.eval_every == 0 or step == args.steps)
    if step % args.log_every == 0 or evaluate_now or step == args.steps:
        n = window["steps"]
        row = {"step": step, "tokens": step * args.batch_size * args.block_size * world,
               "lr": f"{args.lr * lr:.6g}", "train_loss": f"{mean_over_ranks(window['loss'] / n):.6f}",
               "val_loss": f"{evaluate():.6f}" if evaluate_now else "", "step_ms": f"{1000 * window['seconds'] / n:.2f}",
               "replicate_bytes_per_step": window["between"] // n, "within_node_bytes_per_step": window["within"] // n,
               "link_tx_bytes": link_tx_bytes() or "", "elapsed_s": f"{time.perf_counter() - loop_started:.1f}"}
        write_row(row)
        if master:
            print(f"step {step}/{args.steps}: train loss {row['train_loss']}"
                  + (f", val loss {row['val_loss']}" if row["val_loss"] else "")
                  + f", step {row['step_ms']} ms, replicate {row['replicate_bytes_per_step']:,} B/step", flush=True)
        window = dict(loss=0.0, steps=0, seconds=0.0, between=0, within=0)
peer.close()
dist.barrier()
dist.destroy_process_group()
