"""Device memory per parameter of shardopt's DeepSpeed plugin: one process, a few steps, printed.

    torchrun --nproc_per_node 1 launch/bench/deepspeed_memory.py            # the config below, on CUDA if present
    DS_ACCELERATOR=cuda torchrun --nproc_per_node 1 launch/bench/deepspeed_memory.py --steps 5 --n-embd 768

The GPT of integrations/model.py (--n-layer, --n-embd; ~13M parameters by default) under
shardopt.deepspeed.initialize with a DeepSpeed JSON config (default
integrations/deepspeed/signmuon_bf16.json: bf16, ZeRO stage 0), --micro-batch sequences of --block-size
random tokens per step. After --steps steps, per parameter of the model:
  weights, masters, grads, state   bytes of the module's weights, DeepSpeed's fp32 master copies, the
                                   gradients held between backward and the step (the module's .grad and
                                   DeepSpeed's fp32 gradient buffers), shardopt's optimizer state
  allocated                        torch.cuda.memory_allocated after the last step (CUDA only)
  peak                             torch.cuda.max_memory_allocated over the steps (activations included)
  step peak                        the last engine.step()'s peak above what was allocated before it
On the CPU the allocator keeps no such statistics: those rows read "n/a (CPU)" and the tensor bytes
are printed all the same (launch/gpu_smoke.sh runs this on a GPU only).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

import shardopt.deepspeed
from integrations.model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def held_gradients(engine) -> int:
    """The module's .grad plus DeepSpeed's fp32 gradient buffers of the bf16 wrapper (where it has them)."""
    buffers = getattr(engine.optimizer, "fp32_groups_gradients_flat", None) or []
    return tensor_bytes(p.grad for p in engine.module.parameters()) + tensor_bytes(buffers)


def measure(args) -> dict:
    config = json.loads(Path(args.config).read_text())
    config["train_micro_batch_size_per_gpu"] = args.micro_batch
    config["gradient_accumulation_steps"] = 1
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
    params = sum(p.numel() for p in model.parameters())
    engine, *_ = shardopt.deepspeed.initialize(model=model, config=config)
    ours = shardopt.deepspeed.shard_optimizer(engine)
    device = engine.device
    cuda = torch.device(device).type == "cuda"
    generator = torch.Generator().manual_seed(dist.get_rank())
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    grads = step_peak = peak = 0
    for _ in range(args.steps):
        tokens = torch.randint(0, 256, (args.micro_batch, args.block_size + 1), generator=generator).to(device)
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        grads = max(grads, held_gradients(engine))
        if cuda:   # the peak so far (forward, backward), then the step's own from a reset
            torch.cuda.synchronize(device)
            before, peak = torch.cuda.memory_allocated(device), max(peak, torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
        engine.step()
        if cuda:
            torch.cuda.synchronize(device)
            step_peak = torch.cuda.max_memory_allocated(device) - before
            peak = max(peak, torch.cuda.max_memory_allocated(device))
    masters = getattr(engine.optimizer, "fp32_groups", None) or []
    row = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "optimizer": type(ours).__name__,
           "config": Path(args.config).name, "params": params,
           "weights": tensor_bytes(engine.module.parameters()) / params,
           "masters": tensor_bytes(p for group in masters for p in group) / params,
           "grads": grads / params,
           "state": tensor_bytes(v for s in ours.state.values() for v in s.values()) / params,
           "allocated": torch.cuda.memory_allocated(device) / params if cuda else None,
           "peak": peak / params if cuda else None,
           "step_peak": step_peak / params if cuda else None,
           "loss": loss.item()}
    engine.destroy()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "integrations" / "deepspeed" / "signmuon_bf16.json")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    row = measure(args)
    if dist.get_rank() == 0:
        print(f"deepspeed memory: {row['optimizer']} ({row['config']}) on {row['device']}, {row['params']:,} params, "
              f"{args.steps} steps of {args.micro_batch}×{args.block_size} tokens, final loss {row['loss']:.4f}")
        for key, what in (("weights", "module weights"), ("masters", "fp32 master copies"),
                          ("grads", "gradients held before the step"), ("state", "shardopt optimizer state"),
                          ("allocated", "torch.cuda.memory_allocated after the steps"),
                          ("peak", "torch.cuda.max_memory_allocated over the steps"),
                          ("step_peak", "engine.step()'s peak above its start")):
            value = "n/a (CPU)" if row[key] is None else f"{row[key]:.2f} B/param"
            print(f"  {key:<10}{value:>16}   {what}")


if __name__ == "__main__":
    main()
