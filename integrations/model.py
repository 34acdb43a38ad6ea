"""A small GPT (nanoGPT-style) for the example training scripts: byte-level, pre-norm, no biases.

Shared by integrations/fsdp/train.py, integrations/deepspeed/train.py and launch/bench/:

    from integrations.model import GPT, GPTConfig

The parameter names follow nanoGPT (transformer.wte, transformer.h.<i>.attn.c_attn, lm_head, ...)
so that shardopt.param_groups(model) puts the four 2-D weights of each block in the matrix group
and the embeddings (lm_head is tied to wte) and norms in the AdamW group. `parallelize(model,
tensor_mesh)` applies tensor parallelism to the blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256        # bytes
    block_size: int = 64         # context length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128


# The benchmark's model sizes (issue 42, launch/bench/sizes.py): S the GPT of every earlier result (1.3M params
# with BPE-4096), M ≈ 4× (width 256), L ≈ 16× (width 512, 6 layers); n_head 4, block_size 64 for all.
SIZES = {"S": {"n_embd": 128, "n_layer": 4}, "M": {"n_embd": 256, "n_layer": 4}, "L": {"n_embd": 512, "n_layer": 6}}


def parameter_count(config: GPTConfig) -> int:
    """The GPT's parameters (the tied head counted once), built on the meta device."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(config).parameters())


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} must be a multiple of n_head={config.n_head}")
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (under tensor parallelism c_attn's output holds this rank's heads only: see `parallelize`)
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        q, k, v = (t.view(B, T, -1, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=False)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=False)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, bias=False),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight   # tied: one tensor, an embedding
        self.apply(self._init_weights)
        for name, param in self.named_parameters():         # GPT-2: scaled residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: (B, T) int64 token ids, T ≤ block_size. Returns (logits (B, T, vocab), loss or None)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def parallelize(model: GPT, tensor_mesh) -> None:
    """Tensor parallelism (Megatron-style) over the 1-D `tensor_mesh` of T ranks, in place: in every
    block ColwiseParallel on attn.c_attn and mlp.c_fc (rows split: each rank computes its heads and
    its 4C/T hidden units), RowwiseParallel on attn.c_proj and mlp.c_proj (columns split, the output
    all-reduced). Embeddings, norms and the head stay whole on every tensor rank. c_attn's rows are
    first reordered from [q; k; v] to [q_0; k_0; v_0; q_1; …] (q_t: the rows of rank t's heads), so
    that rank t's row block holds its heads' q, k and v: the function the model computes is
    unchanged (a checkpoint stores c_attn in that order). Call before fully_shard."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    parts = tensor_mesh.size()
    if model.config.n_head % parts:
        raise ValueError(f"n_head={model.config.n_head} must be a multiple of the tensor-parallel size {parts}")
    for block in model.transformer.h:
        with torch.no_grad():
            weight = block.attn.c_attn.weight
            per_rank = [w.chunk(parts) for w in weight.chunk(3)]      # [q, k, v] → each split by heads
            weight.copy_(torch.cat([torch.cat([qkv[t] for qkv in per_rank]) for t in range(parts)]))
        parallelize_module(block, tensor_mesh, {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                                "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
