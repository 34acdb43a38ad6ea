"""HF Transformers' Trainer (docs/design.md §11): `ShardoptCallback` and `optimizer_cls_and_kwargs`.

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ShardoptCallback()],
                      optimizer_cls_and_kwargs=optimizer_cls_and_kwargs("signmuon", "lion", lr=3e-3))

or `optimizers=(shardopt optimizer, scheduler)` in place of optimizer_cls_and_kwargs. The callback
(a) switches off the all-reduce of the DDP wrapper Trainer puts around the model on several processes
    (shardopt.ddp.keep_local_gradients, installed in the first training forward, before the first
    backward: a callback is handed the bare model, and DDP names the wrapper running it only then);
(b) averages the replicas' decoupled momenta (synchronize_for_checkpoint) before every checkpoint
    Trainer saves, and checks that the replicas' weights are bitwise equal, so rank 0's checkpoint
    holds what every rank has and a resume from it is exact;
(c) applies TrainingArguments' max_grad_norm (1.0 unless set) through the optimizer's agreed norm
    (every replica scales by the same factor), not Trainer's clip of each replica by its own norm; that
    needs the whole gradient first, so it turns the optimizer's exchange during backward off
    (`overlap_backward`, docs/design.md §12); with max_grad_norm=0 the exchange starts in backward,
    and Trainer's inner micro-batches (run under DDP's no_sync()) count as accumulation.
(d) under a DeepSpeed config (TrainingArguments(deepspeed=...)), where the engine does (a)-(c), it only ends
    local steps ("shardopt": {"local_steps": ...}): at the last step, before Trainer saves its last
    checkpoint, and at the end of training, LocalSteps.sync_now() syncs what the last round left pending,
    so the replicas end bitwise equal and the final checkpoint and model are the synced ones.
Trainer's FSDP setting is refused with the reason. transformers is imported here
only, so `import shardopt` works without it.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from ..internals import active_ddp_module
from .ddp import keep_local_gradients
from .gradscaler import hand_over_scaler
from .common import check_replicas, local_steps_inside, prepare_checkpoint, shardopt_optimizer
from ..optim.groups import param_groups
from ..optim.optimizer import Dion, ShardOptimizer, SignMuon

try:
    from transformers import TrainerCallback
except ImportError as error:   # an optional dependency: pip install 'shardopt[hf]'
    raise ImportError("shardopt.hf needs transformers; install it with pip install 'shardopt[hf]'") from error

logger = logging.getLogger("shardopt")
OPTIMIZER_CLASSES = {"dion": Dion, "signmuon": SignMuon, "muon": SignMuon}
# keyword arguments of optimizer_cls_and_kwargs that build the groups (shardopt.param_groups), not the optimizer
GROUP_OPTIONS = ("matrix_options", "nonmatrix_options", "head_names", "nonmatrix_names", "splits")


class ShardoptCallback(TrainerCallback):
    """Trainer's side of shardopt's contract (see the module doc): DDP's all-reduce off, momenta averaged
    before each checkpoint, max_grad_norm by the agreed norm. Trainer(..., callbacks=[ShardoptCallback()])."""

    def __init__(self):
        self.optimizer = None
        self.local_steps = None   # under a DeepSpeed config with "local_steps": the LocalSteps to sync at the end
        self._synced_at = None
        self.max_grad_norm = 0.0
        self.scaler = None
        self._hook = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if args.fsdp:
            raise NotImplementedError(
                f"ShardoptCallback: TrainingArguments(fsdp={args.fsdp!r}) is not supported: Trainer (through "
                f"Accelerate) shards the model after the optimizer is built and swaps the optimizer's params for "
                f"the sharded ones, while shardopt derives its shard and replicate axes from the params when it is "
                f"built (on a CPU, Accelerate ignores fsdp and Trainer runs DDP). Leave fsdp unset (Trainer then runs DDP, whose all-reduce this callback switches off), or "
                f"shard with fully_shard before building the optimizer in your own loop (README.md, Use)")
        if args.deepspeed:   # the engine owns the all-reduce, the clipping and the checkpoints: only local steps' end
            self.local_steps = local_steps_inside(optimizer)
            return
        self.optimizer = shardopt_optimizer(optimizer, "pass Trainer(optimizers=(shardopt.SignMuon(...) or "
                                            "shardopt.Dion(...), None)) or Trainer(optimizer_cls_and_kwargs="
                                            "shardopt.hf.optimizer_cls_and_kwargs(...))")
        check_replicas(self.optimizer, args.world_size, "Trainer")
        self.scaler = getattr(optimizer, "scaler", None)   # fp16: Accelerate's GradScaler
        hand_over_scaler(optimizer, self.optimizer)         # its overflow agreed by the replicas (gradscaler.py)
        if args.max_grad_norm > 0:   # Trainer clips while it is > 0: hand it to the optimizer
            self.max_grad_norm = float(args.max_grad_norm)
            args.max_grad_norm = 0.0
            if self.optimizer.overlap_backward:
                logger.warning("shardopt: overlap_backward turned off: TrainingArguments' max_grad_norm=%g clips by "
                               "the agreed norm, known only after backward; set max_grad_norm=0 to keep the "
                               "exchange during backward", self.max_grad_norm)
            self.optimizer.overlap_backward = False
            logger.info("shardopt: TrainingArguments' max_grad_norm=%g clips by the norm all replicas agree on "
                        "(ShardOptimizer.clip_grad_norm_), not Trainer's per-replica clip", self.max_grad_norm)
        if args.world_size > 1:
            self._hook = model.register_forward_pre_hook(self._keep_local_gradients)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.max_grad_norm > 0:
            if self.scaler is not None:   # clip the true gradients, as Trainer's own clip does (step sees UNSCALED)
                self.scaler.unscale_(self.optimizer)
            self.optimizer.clip_grad_norm_(self.max_grad_norm)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps or control.should_training_stop:
            self._end_local_steps(state)   # before Trainer saves the last checkpoint, after this event
        self._before_save(args, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._before_save(args, control)

    def on_train_end(self, args, state, control, **kwargs):
        self._end_local_steps(state)   # (training stopped by another callback after this one's on_step_end)

    def _end_local_steps(self, state) -> None:
        """Local steps stopping off a sync step: sync what is pending (LocalSteps.sync_now), once per step, so
        every replica ends with the same weights and the final checkpoint and model are the synced ones."""
        if self.local_steps is not None and self._synced_at != state.global_step:
            self.local_steps.sync_now()
            self._synced_at = state.global_step

    def _before_save(self, args, control) -> None:
        """Trainer saves after this event when control.should_save is set (or, with save_strategy="best", after
        an evaluation that finds a new best): average the momenta first and check the replicas agree."""
        if self.optimizer is None or not (control.should_save or (args.save_strategy == "best" and
                                                                  control.should_evaluate)):
            return
        prepare_checkpoint(self.optimizer, "Trainer saves a checkpoint")

    def _keep_local_gradients(self, module, inputs):
        """A forward pre-hook on the bare model: in its first training forward, switch off the all-reduce of the
        DistributedDataParallel running it (shardopt.ddp.keep_local_gradients), then remove itself."""
        if not module.training:
            return   # an evaluation forward (Trainer does not wrap the model for it)
        wrapper = active_ddp_module()
        if wrapper is None or wrapper.module is not module:
            raise RuntimeError("ShardoptCallback: Trainer runs several processes but its training forward does not "
                               "run inside a torch DistributedDataParallel of this model, so no all-reduce can be "
                               "switched off (a DDP built under torch._dynamo.config.optimize_ddp='python_reducer' "
                               "does not say it runs; leave that setting at its default)")
        keep_local_gradients(wrapper, self.optimizer)
        self._hook.remove()


class ShardoptFactory:
    """Trainer's optimizer-factory protocol (transformers' Trainer.create_optimizer calls
    optimizer_cls()(model, **optimizer_kwargs) when optimizer_cls is not a torch Optimizer class):
    builds shardopt.param_groups(model, matrix_algorithm, nonmatrix_algorithm) and the optimizer, with
    the replicas of an initialized process group as its replicate axis."""

    def __init__(self, *args, **kwargs):
        if args or kwargs:   # a Trainer without factories calls optimizer_cls(params, **optimizer_kwargs)
            raise TypeError("shardopt.hf.optimizer_cls_and_kwargs needs a transformers Trainer that calls optimizer "
                            "factories (create_optimizer: optimizer_cls()(model, **kwargs)); with this one, build the "
                            "optimizer yourself and pass Trainer(optimizers=(optimizer, None))")

    def __call__(self, model, matrix_algorithm: str, nonmatrix_algorithm: str, **options) -> ShardOptimizer:
        group_options = {key: options.pop(key) for key in GROUP_OPTIONS if key in options}
        groups = param_groups(model, matrix_algorithm, nonmatrix_algorithm, **group_options)
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        options.setdefault("replicate_mesh", dist.group.WORLD if several else None)
        return OPTIMIZER_CLASSES[matrix_algorithm](groups, **options)


def optimizer_cls_and_kwargs(matrix_algorithm: str = "signmuon", nonmatrix_algorithm: str = "lion",
                             **options) -> tuple[type, dict]:
    """For Trainer(optimizer_cls_and_kwargs=...): a factory and its kwargs that build, from the model Trainer
    trains, shardopt.param_groups(model, matrix_algorithm, nonmatrix_algorithm, <GROUP_OPTIONS in options>)
    and the optimizer of matrix_algorithm (Dion for "dion", SignMuon for "signmuon" and "muon") with the
    other `options` (lr, vote, max_grad_norm, …; replicate_mesh defaults to the process group's world).
    An unknown matrix_algorithm raises here; the rest is checked when Trainer builds the optimizer.""" 
    if matrix_algorithm not in OPTIMIZER_CLASSES:
        raise ValueError(f"Invalid matrix_algorithm: {matrix_algorithm!r}; allowed: "
                         f"{', '.join(map(repr, OPTIMIZER_CLASSES))}")
    return ShardoptFactory, {"matrix_algorithm": matrix_algorithm, "nonmatrix_algorithm": nonmatrix_algorithm, **options}
