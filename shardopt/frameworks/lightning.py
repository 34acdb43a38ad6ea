"""`ShardoptCallback`: shardopt's optimizers under a Lightning `Trainer` (docs/design.md §11, docs/trainers.md).

    trainer = lightning.Trainer(strategy="ddp", devices=2, callbacks=[shardopt.lightning.ShardoptCallback()])

with the LightningModule's `configure_optimizers` returning a shardopt optimizer whose
`replicate_mesh` is the DDP world (`torch.distributed.group.WORLD`). The callback

- switches DDP's gradient all-reduce off once the strategy has wrapped the model (on_fit_start, before
  the first backward): `shardopt.ddp.keep_local_gradients` installs a no-exchange comm hook. Lightning
  registers DDP comm hooks itself only on CUDA (`DDPStrategy(ddp_comm_hook=…)` is ignored on CPU), so
  the callback does it on every device. Under `ModelParallelStrategy` (FSDP2 `fully_shard` in
  `configure_model`) FSDP2 only reduce-scatters over the mesh it is given, nothing to switch off (HSDP:
  a (replicate, shard) mesh built there, fully_shard on "shard", the optimizer on "replicate");
- averages the decoupled momenta (`synchronize_for_checkpoint`) whenever Lightning saves a
  checkpoint with optimizer state: in the callback's `state_dict()`, which `dump_checkpoint` calls
  before it reads the optimizers' state (`on_save_checkpoint` comes after it);
- refuses `Trainer(gradient_clip_val=…)` (it clips each replica by its own norm); the optimizer's
  `max_grad_norm` clips by a norm all replicas agree on;
- checks after the first optimizer step that the replicas' weights are bitwise equal (one all-gather
  of one hash per param): they are not when the optimizer's replicate axis is not DDP's world.

`shardopt.LocalSteps` is refused (each replica's state is its own; see `_optimizers`).
`accumulate_grad_batches` works as Lightning does it (`no_sync` on the inner micro-batches).
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as error:   # the framework is optional (docs/design.md §11)
    raise ImportError("shardopt.lightning needs Lightning 2.x: pip install 'shardopt[lightning]' "
                      "(the `lightning` package; `pytorch_lightning` alone is not supported)") from error

from ..wire.comm import Axis
from .ddp import keep_local_gradients
from ..localsteps.optimizer import LocalSteps
from ..optim.guard import replicas_equal
from ..optim.optimizer import ShardOptimizer
from ..optim.checkpoint_momenta import checkpoint_exchange


class ShardoptCallback(Callback):
    """Runs shardopt's optimizers under `lightning.Trainer` with DDP (strategy="ddp"),
    `ModelParallelStrategy` (FSDP2) or a single device; see the module docstring."""

    def __init__(self) -> None:
        self._trainer = None
        self._replicas_checked = False

    def setup(self, trainer, pl_module, stage: str) -> None:
        from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
        self._trainer = trainer
        if stage != "fit":
            return
        if trainer.gradient_clip_val:
            raise ValueError(f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips each replica's gradient by "
                             f"its own norm, so the replicas would step differently; with ShardoptCallback leave "
                             f"gradient_clip_val unset and pass max_grad_norm={trainer.gradient_clip_val} to the shardopt "
                             f"optimizer in configure_optimizers (it clips by a norm all replicas agree on)")
        strategy = trainer.strategy
        if not isinstance(strategy, (DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy)):
            raise ValueError(f"ShardoptCallback supports Trainer(strategy='ddp' | ModelParallelStrategy() | a single "
                             f"device), got {type(strategy).__name__}; for DeepSpeed use shardopt.deepspeed (a JSON "
                             f"config), for FSDP use ModelParallelStrategy with fully_shard in configure_model")

    def on_fit_start(self, trainer, pl_module) -> None:
        from lightning.pytorch.strategies import DDPStrategy
        optimizers = self._optimizers(trainer)
        model = trainer.strategy.model
        if isinstance(trainer.strategy, DDPStrategy) and isinstance(model, DistributedDataParallel):
            try:
                for optimizer in optimizers:   # accumulate_grad_batches' no_sync() micro-batches: accumulation
                    keep_local_gradients(model, optimizer)
            except RuntimeError as error:
                raise RuntimeError("ShardoptCallback installs its own DDP comm hook (the all-reduce off) and DDP "
                                   "accepts one: drop DDPStrategy(ddp_comm_hook=…)") from error

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        model = trainer.strategy.model
        if self._replicas_checked or trainer.global_step == 0 or not isinstance(model, DistributedDataParallel):
            return
        self._replicas_checked = True
        params = [p.detach() for p in model.parameters()]
        if not replicas_equal(params, Axis("replicate", model.process_group)):
            raise RuntimeError("shardopt: after the first optimizer step the DDP replicas' weights differ: the shardopt "
                               "optimizer does not exchange over Lightning's DDP world; pass "
                               "replicate_mesh=torch.distributed.group.WORLD to it in configure_optimizers")

    def state_dict(self) -> dict:
        """Lightning calls this while it builds a checkpoint with optimizer state, on every rank and
        before reading the optimizers: the moment to agree on one momentum."""
        if self._trainer is not None:
            for optimizer in self._optimizers(self._trainer):
                optimizer.synchronize_for_checkpoint(checkpoint_exchange(optimizer))
        return {}

    def _optimizers(self, trainer) -> list[ShardOptimizer]:
        optimizers = [opt for opt in trainer.optimizers if isinstance(opt, ShardOptimizer)]
        if any(isinstance(opt, LocalSteps) for opt in trainer.optimizers):
            raise ValueError("ShardoptCallback does not run shardopt.LocalSteps: Lightning saves rank 0's checkpoint "
                             "for every rank while each replica's local-steps state is its own, and the last round "
                             "must be synced before the final save (LocalSteps.sync_now); use local steps through "
                             "integrations/fsdp/train.py --local-steps H, a DeepSpeed config or your own loop "
                             "(docs/trainers.md, 'Local steps at the end of training')")
        if not optimizers:
            raise ValueError(f"ShardoptCallback found no shardopt optimizer among the Trainer's optimizers "
                             f"({', '.join(type(opt).__name__ for opt in trainer.optimizers) or 'none'}); return "
                             f"shardopt.SignMuon(…) or shardopt.Dion(…) from configure_optimizers")
        return optimizers


__all__ = ["ShardoptCallback"]
