"""Train a small GPT-2 (HF transformers) through HF Accelerate's DeepSpeed plugin, with shardopt's optimizer.

    # CPU, 2 processes (gloo); the model is built from a GPT2Config, nothing is downloaded:
    torchrun --nproc_per_node 2 integrations/deepspeed/train_accelerate.py \\
        --deepspeed_config integrations/deepspeed/signmuon_bf16.json --steps 20

Accelerate calls deepspeed.initialize itself: after `shardopt.deepspeed.register()` that call builds
shardopt's optimizer from the config's "optimizer" section (Accelerate is handed a DummyOptim) and wires
the engine (its gradient all-reduce off: the optimizer sends low-rank factors or 1-bit votes). The same
config file serves train.py. Without a GPU, Accelerate finds no distributed backend for DeepSpeed by
itself (it would count one process); InitProcessGroupKwargs(backend="gloo") gives it one.

Data: integrations/data.py's prepared corpus (its meta.json gives the vocabulary), each rank its own batches.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, DummyOptim, InitProcessGroupKwargs
from transformers import GPT2Config, GPT2LMHeadModel

import shardopt.deepspeed
from integrations import data
from shardopt.wire.comm import collective_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed_config", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--data-dir", type=Path, default=data.default_cache() / "shakespeare")
    args = parser.parse_args()

    config = json.loads(args.deepspeed_config.read_text())
    shardopt.deepspeed.register()   # accelerator.prepare's deepspeed.initialize builds shardopt's optimizer
    backend = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), kwargs_handlers=backend)
    torch.manual_seed(args.seed)   # the same initial weights on every rank
    model = GPT2LMHeadModel(GPT2Config(vocab_size=data.vocab_size(args.data_dir), n_positions=args.block_size,
                                       n_embd=args.n_embd, n_layer=args.n_layer, n_head=4, bos_token_id=0,
                                       eos_token_id=0))
    engine, _ = accelerator.prepare(model, DummyOptim(model.parameters()))
    ours = shardopt.deepspeed.shard_optimizer(engine)

    tokens = data.load(args.data_dir, "train")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch_size = engine.train_micro_batch_size_per_gpu()
    allreduce_bytes = collective_bytes("all_reduce", 4 * sum(p.numel() for p in model.parameters()), world)
    for step in range(1, args.steps + 1):
        x, _ = data.get_batch(tokens, batch_size, args.block_size, args.seed, step, rank)
        loss = engine(input_ids=x.to(engine.device), labels=x.to(engine.device)).loss
        accelerator.backward(loss)     # DeepSpeed: engine.backward, then engine.step
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)     # for the log line only
        if rank == 0:
            print(f"step {step:4d} | loss {mean_loss.item() / world:.4f} | grad norm "
                  f"{float(engine.get_global_grad_norm()):.3f}", flush=True)
    sent = ours.comm_stats()["replicate"]["bytes_sent"]
    consistent = ours.replicas_consistent()
    if rank == 0:
        print(f"{type(ours).__name__} through Accelerate on {world} ranks: {sent:,} B sent on the replicate axis, "
              f"{sent / (allreduce_bytes * args.steps):.3f} of an fp32 all-reduce; replicas identical: {consistent}")
    del ours
    dist.barrier()
    shardopt.deepspeed.shutdown(engine)
    if not consistent:
        raise SystemExit("replicas diverged: weights differ across data-parallel ranks")


if __name__ == "__main__":
    main()
