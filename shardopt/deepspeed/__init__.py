"""DeepSpeed plugin: Dion and Sign-Muon from a DeepSpeed JSON config, through one call.

    import shardopt.deepspeed
    engine, optimizer, _, lr_scheduler = shardopt.deepspeed.initialize(model=model, config="dion_bf16.json")
    loss = engine(batch); engine.backward(loss); engine.step()

`initialize` has deepspeed.initialize's signature and return value. When the
config's "optimizer" type is "Dion" or "SignMuon" it builds the optimizer
(`shardopt.param_groups(model)`: 2-D weights for the matrix algorithm, the rest
for AdamW or Lion) and hands it to DeepSpeed as a client optimizer; any other
config goes to deepspeed.initialize unchanged. model_parameters given as tensors
select the params to train, still split by param_groups; param-group dicts are
used as given. Model parallelism (mpu=..., PipelineModule) and MoE expert
parameters are refused. The optimizer's "params" are the class's keyword
arguments; the vote format with the fewest bytes (vote="auto") is spelled "fewest_bytes" in a config,
as HF Transformers and Accelerate take "auto" for their own placeholder ("auto" is still accepted
outside them). An optional top-level "shardopt" section:

    "shardopt": {"nonmatrix_algorithm": "adamw" | "lion",
                 "nonmatrix_names": ["pos_emb"],       names (substrings) to treat as non-matrix
                 "head_names": ["lm_head"],         output heads (non-matrix)
                 "nonmatrix": {"lr": 3e-4},            options of the non-matrix group
                 "matrix": {...},                   options of the matrix group
                 "mesh": {"replicate": R, "shard": S},   data-parallel ranks as R nodes × S ranks
                 "scale_scheduler_lr": true,        a WarmupLR-type scheduler's lr is the matrix group's;
                                                    the other groups get it scaled to their own lr
                 "local_steps": {"sync_every": H, ...},   shardopt.LocalSteps' keyword arguments: the
                                                    replicas sync every H steps
                 "verbose": true}                   print the groups on rank 0

Code that calls deepspeed.initialize itself (HF Trainer with a DeepSpeed config, Accelerate's
DeepSpeedPlugin, Lightning's DeepSpeedStrategy): call `shardopt.deepspeed.register()` once before it
does; deepspeed.initialize is then this `initialize` (idempotent; `unregister()` gives DeepSpeed's
back), and the framework is given the full config (docs/trainers.md). Without registering: give
DeepSpeed `engine_config(config)`, pass `client_optimizer(model, config)` as the optimizer, and call
`attach(engine)` on the engine it returns. `detach(engine)` undoes the wiring.

DeepSpeed's removed 1-bit optimizers (DeepSpeed ≥ 0.19): "type": "OneBitAdam" runs shardopt's 1-bit Adam
with the same meaning of its params (exact Adam for freeze_step steps, then the momentum in 1 bit per entry
across the replicas, error-compensated), at ZeRO 0, 1 and 2; "OneBitLamb" and "ZeroOneAdam" stop with an
error naming the shardopt config doing their job (onebit.py; integrations/deepspeed/README.md has the table).

One file per concern: `config.py` (what the plugin reads from the config),
`optimizers.py` (the optimizer classes DeepSpeed drives: agreed clipping and
overflow), `onebit.py` (the removed 1-bit family's configs), `zero.py` (ZeRO stages 1/2 with the compressed exchange across
nodes), `zero3.py` (stage 3: the weights released outside the modules using them), `masters.py` (fp32 master
copies of the owned slots only; under bf16 packed between steps: `packing.py`), `engine.py` (building the optimizer; the entry points), `wiring.py`
(every change to the engine, owned by one EngineWiring with detach()),
`registration.py` (register / unregister), `internals.py` (every DeepSpeed
internal the plugin touches, checked on load).

What the plugin changes in the engine, and why:

- Gradient exchange: `engine.enable_backward_allreduce = False` (as DeepSpeed's
  1-bit Adam does), so backward leaves each rank's *local* gradient; the
  optimizer's step does the compressed exchange once per accumulated batch.
- ZeRO: DeepSpeed's ZeRO optimizers flatten the gradients and average them
  themselves, so DeepSpeed is given stage 0 and shardopt runs stages 1-3
  (zero.py): state partitioned over the ranks of a node, gradients reduced to their owners
  inside the node at full precision, only the compressed exchange across nodes,
  weights all-gathered inside the node. Stage 3 (zero3.py) keeps each weight on its
  owner only and broadcasts a module's weights inside the node while it runs (forward and
  backward): stage 2's math bitwise, weights ≈ 1/S per rank. A model built under
  deepspeed.zero.Init has its partitions gathered into ds_shape weights first (whole on every rank until
  the engine is wired).
- Gradient clipping: "gradient_clipping" is taken out of the engine's config and
  done by the optimizer with a norm agreed over the replicas (shardopt/optim/clipping.py,
  the same path as the optimizer's max_grad_norm, the node axis added at ZeRO 1/2),
  also reported by engine.get_global_grad_norm().
- fp16/bf16: DeepSpeed keeps fp32 master copies in a wrapper (FP16_UnfusedOptimizer)
  that hands them to the optimizer; its construction-time "initialize state" step
  with zero gradients is a no-op here (it would apply weight decay, and Sign-Muon's
  sign(0) = +1 would move every weight). Its overflow check is replaced by one that
  agrees over all data-parallel ranks (a step is skipped on every rank or on none;
  the decision reads one flag: a device sync, as DeepSpeed's own check has). With
  fp16, DeepSpeed 0.19 at stage 0 runs backward without the loss scale yet unscales
  in step (deepspeedai/DeepSpeed#8393); engine.backward here applies it (as in
  DeepSpeed's own fp16 wrapper, an fp16 loss tensor overflows at scale 2^16: compute
  the loss in fp32). Use engine.backward, not engine.scale(loss).backward(). fp16 on
  a device DeepSpeed cannot run it on (a CPU without mkldnn fp16) is refused up front.
- Non-finite gradients in fp32: the optimizer's own check (nonfinite="skip", agreed)
  skips the step on every rank and sets `optimizer.overflow`, which the engine reads:
  engine.skipped_steps counts it and the LR scheduler does not advance, as under fp16.
- Checkpoints: `engine.save_checkpoint` first averages the replicas' decoupled
  momenta (docs/design.md §6), so the one optimizer state DeepSpeed writes (data-parallel
  rank 0) holds for every replica. At ZeRO 1/2 every rank also writes and reads
  its own partition next to DeepSpeed's files (wiring.py).
- Local steps ("local_steps", docs/design.md §10): the Dion / Sign-Muon is built without a replicate
  axis and wrapped in a DeepSpeedLocalSteps over the replicate group (the data-parallel group, or the
  mesh's replicate axis: then the node's gradients are averaged inside it every step); inner steps send
  nothing across the replicas, not even the overflow flag, so an fp16/bf16 overflow skips that replica's
  inner step alone (the step still counts towards the round). The replicas differ between syncs, so
  engine.save_checkpoint also writes every rank's own optimizer state and params, read back by
  engine.load_checkpoint (a resume mid-round continues bit-exact). At ZeRO 1/2 each rank syncs and
  keeps the outer state of the params it owns, and the node gathers them after a sync (no overlap or
  fragments there).
- Exchange during backward ("overlap_backward": true in the optimizer params, docs/design.md §12): at ZeRO
  stage 0 without a mesh or at stage 2, in fp32, bf16 or fp16, without gradient_clipping (elsewhere the
  engine changes the gradients in engine.step(): refused, naming the setting); engine.backward runs the
  micro-batches before the accumulation boundary under optimizer.accumulating(); at stage 2 a bucket starts
  once the node means of the gradients this rank owns have come back from their reduces; under fp16/bf16
  it reads the master copies' gradients, made in backward as the wrapper's step makes them.
- Bytes: `shard_optimizer(engine).comm_stats()` per axis: "replicate" (across nodes)
  and "node" (ZeRO 1/2 inside a node). "shard" also reports the node's bytes until the
  next release (the node axis's former name): read "node".

DeepSpeed's LR schedulers act on the optimizer's param groups. WarmupLR,
WarmupDecayLR, OneCycle and LRRangeTest set absolute learning rates; when the
groups' learning rates differ, give one number and "scale_scheduler_lr": true,
or per-group lists (or use WarmupCosineLR, which scales each group's own lr);
otherwise an error says so.
"""

from .engine import attach, client_optimizer, detach, engine_config, initialize, shard_optimizer, shutdown
from .optimizers import DeepSpeedDion, DeepSpeedSignMuon
from .registration import register, unregister
from .zero3 import gathered_weights

__all__ = ["initialize", "register", "unregister", "shard_optimizer", "engine_config", "client_optimizer", "attach",
           "detach", "shutdown", "gathered_weights", "DeepSpeedDion", "DeepSpeedSignMuon"]
