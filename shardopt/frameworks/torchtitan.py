"""shardopt's optimizers in torchtitan (0.3): `ShardoptOptimizersContainer` and its `Config`,
`shard_only(parallelize_fn)`, and `use_shardopt(trainer_config, …)` that puts both in a `Trainer.Config`
(docs/design.md §11, docs/trainers.md).

torchtitan builds its optimizer from `config.optimizer.build(model_parts=…)` after the parallelize
step. Its own `OptimizersContainer` knows Adam, AdamW and DistMuon; a shardopt optimizer needs `lr`
at construction and refuses the `fused` / `foreach` keys the container adds to every group. This
container builds one shardopt optimizer per model part (all its param groups in it, so one
agreement per step); it

- groups the params as `shardopt.param_groups(model, algorithm, nonmatrix_algorithm, splits=…)` does, or
  per regex pattern with torchtitan's `ParamGroupConfig` (`optimizer_name` is then the group's
  shardopt algorithm and `optimizer_kwargs` its options, `split` for a fused wqkv included);
- averages the decoupled momenta (`synchronize_for_checkpoint`) in `state_dict()`, which torchtitan's
  CheckpointManager (through DCP) calls when it saves.

The replicate axis. With `data_parallel_replicate_degree` > 1 torchtitan's parallelize functions
apply FSDP2 HSDP: `fully_shard` on the ("dp_replicate", "fsdp") mesh, which all-reduces the gradients
over "dp_replicate" (with `set_requires_all_reduce(False)` FSDP2 keeps them to itself instead). For
shardopt that axis is its own: `shard_only(parallelize_fn)` runs the model's parallelize function with
`parallel_dims.dp_replicate_enabled` seen as False, so `fully_shard` goes on the "fsdp" mesh only
(gradients reduce-scattered there, each replica keeps its own), and hands torchtitan's "dp_replicate"
mesh to the container (attribute `REPLICATE_MESH_ATTRIBUTE` of each model part). The data loader and
the loss still see both data-parallel dims.

Clipping. torchtitan's trainer clips with `training.max_norm` (default 1.0) before
`optimizers.step()`, each replica by its own norm; `use_shardopt` moves that value into the
optimizer's `max_grad_norm` (a norm all replicas agree on) and sets `training.max_norm` to inf
(a clip factor of exactly 1).
"""

import math
from dataclasses import dataclass, field
from typing import Any, Literal

try:
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.tools.logging import logger
except ImportError as error:   # the framework is optional (docs/design.md §11)
    raise ImportError("shardopt.torchtitan needs torchtitan 0.3: pip install 'shardopt[torchtitan]'") from error

import torch.distributed as dist
from torch.distributed.tensor import Replicate
from torch import nn

from ..optim.groups import param_groups
from ..algorithms.registry import ALGORITHMS
from ..optim.optimizer import Dion, SignMuon
from ..optim.checkpoint_momenta import checkpoint_exchange
from ..layout.placement import is_dtensor

OPTIMIZERS = {"dion": Dion, "signmuon": SignMuon}
REPLICATE_MESH_ATTRIBUTE = "shardopt_replicate_mesh"   # set on a model part by shard_only(…)


class ShardoptOptimizersContainer(OptimizersContainer):
    """torchtitan's OptimizersContainer holding one shardopt optimizer (Dion or SignMuon) per model
    part; see the module docstring. Config.implementation does not apply (shardopt has one)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        algorithm: Literal["dion", "signmuon"] = "signmuon"
        """The optimizer: shardopt.Dion or shardopt.SignMuon (also the matrix params' algorithm)."""

        options: dict[str, Any] = field(default_factory=dict)
        """Its constructor's keyword arguments; "lr" is required (torchtitan's lr scheduler scales it),
        e.g. {"lr": 0.02, "vote": "auto", "max_grad_norm": 1.0} or {"lr": 0.02, "rank_fraction": 0.25}."""

        nonmatrix_algorithm: Literal["lion", "adamw"] = "lion"
        """Without param_groups: the algorithm of embeddings, heads, norms and biases ("lion": 1-bit vote)."""

        nonmatrix_options: dict[str, Any] = field(default_factory=dict)
        """Without param_groups: options of the non-matrix group, e.g. {"lr": 3e-4}."""

        splits: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
        """Without param_groups: {name substring: (dim, sizes)} for fused projections, e.g.
        {"attention.wqkv": (0, (dim, kv_dim, kv_dim))} (shardopt.param_groups' splits)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        _check(config)
        self.model_parts = model_parts
        self.optimizers = []
        for part in model_parts:
            groups = _groups(part, config)
            replicate_mesh = config.options.get("replicate_mesh", getattr(part, REPLICATE_MESH_ATTRIBUTE, None))
            _check_replicate_axis(groups, replicate_mesh)
            optimizer = OPTIMIZERS[config.algorithm](groups, **{**config.options, "replicate_mesh": replicate_mesh})
            logger.info(optimizer.describe())
            self.optimizers.append(optimizer)
        params = [p for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]]
        self._validate_params(params)
        self._post_init(params)

    def state_dict(self) -> dict[str, Any]:
        """torchtitan's flat, FQN-keyed state dict, after averaging the replicas' decoupled momenta."""
        for optimizer in self.optimizers:
            optimizer.synchronize_for_checkpoint(checkpoint_exchange(optimizer))
        return super().state_dict()


class _ShardOnlyDims:
    """torchtitan's ParallelDims as a model's parallelize function should see it under shardopt:
    without the replicate dim, so FSDP2 shards over "fsdp" only (everything else as it is)."""

    dp_replicate_enabled = False

    def __init__(self, parallel_dims):
        self._parallel_dims = parallel_dims

    def __getattr__(self, name):
        return getattr(self._parallel_dims, name)


def shard_only(parallelize_fn):
    """A torchtitan parallelize function (model, *, parallel_dims, …) → model that applies FSDP2 on
    the "fsdp" mesh only and leaves the "dp_replicate" mesh to shardopt: it runs `parallelize_fn`
    with dp_replicate hidden and sets the model's REPLICATE_MESH_ATTRIBUTE to torchtitan's
    "dp_replicate" mesh (None without one), where ShardoptOptimizersContainer finds it."""
    def parallelize(model, *, parallel_dims, **options):
        model = parallelize_fn(model, parallel_dims=_ShardOnlyDims(parallel_dims), **options)
        setattr(model, REPLICATE_MESH_ATTRIBUTE, parallel_dims.get_optional_mesh("dp_replicate"))
        return model
    return parallelize


def use_shardopt(trainer_config, **fields):
    """`trainer_config` (a torchtitan Trainer.Config, e.g. from a config_registry function) set up for
    shardopt: its optimizer ShardoptOptimizersContainer.Config(**fields), its model's parallelize
    function `shard_only(…)`, and torchtitan's per-replica clipping `training.max_norm` moved into
    the optimizer's agreed `max_grad_norm` (unless the options set one), `training.max_norm` = inf."""
    backend = trainer_config.parallelism.spmd_backend
    if backend != "partial_dtensor":
        raise ValueError(f"parallelism.spmd_backend={backend!r}: shardopt.torchtitan runs on torchtitan's FSDP2 "
                         f"path; set parallelism.spmd_backend='partial_dtensor' (--parallelism.spmd_backend "
                         f"partial_dtensor)")
    options = dict(fields.pop("options", {}))
    max_norm = trainer_config.training.max_norm
    if max_norm and math.isfinite(max_norm):
        options.setdefault("max_grad_norm", float(max_norm))
    trainer_config.optimizer = ShardoptOptimizersContainer.Config(options=options, **fields)
    trainer_config.training.max_norm = math.inf
    spec = trainer_config.model_spec
    spec.parallelize_fn = shard_only(spec.parallelize_fn)
    return trainer_config


def _check(config) -> None:
    if config.options.get("overlap_backward"):
        raise ValueError("ShardoptOptimizersContainer.Config(options={'overlap_backward': True}): torchtitan's "
                         "trainer multiplies every gradient in place by its clip factor after backward (1.0 under "
                         "use_shardopt, still a write), and runs its gradient-accumulation micro-batches with no "
                         "sign of which is last, so the exchange started during backward would be redone in every "
                         "step (docs/design.md §12); remove overlap_backward from options")
    if config.algorithm not in OPTIMIZERS:
        raise ValueError(f"ShardoptOptimizersContainer.Config(algorithm={config.algorithm!r}): allowed "
                         f"{', '.join(map(repr, OPTIMIZERS))}")
    if "lr" not in config.options:
        raise ValueError(f"ShardoptOptimizersContainer.Config(options={config.options!r}) has no 'lr'; give the "
                         f"matrix params' learning rate, e.g. options={{'lr': 0.02}} (torchtitan's lr scheduler "
                         f"scales every group's lr)")
    if config.param_groups and (config.splits or config.nonmatrix_options):
        raise ValueError("ShardoptOptimizersContainer.Config: splits and nonmatrix_options build the automatic groups; "
                         "with param_groups put them in each ParamGroupConfig's optimizer_kwargs "
                         "(e.g. {'split': (0, (dim, kv_dim, kv_dim))}, {'lr': 3e-4})")
    for group in config.param_groups:
        if group.optimizer_name not in ALGORITHMS:
            raise ValueError(f"ParamGroupConfig(pattern={group.pattern!r}, optimizer_name={group.optimizer_name!r}): "
                             f"in ShardoptOptimizersContainer.Config a group's optimizer_name is its shardopt "
                             f"algorithm, one of {', '.join(map(repr, ALGORITHMS))}")


def _groups(part: nn.Module, config) -> list[dict]:
    """The part's param groups with torchtitan's canonical FQNs as param_names (its checkpoint keys)."""
    if not config.param_groups:
        groups = param_groups(part, config.algorithm, config.nonmatrix_algorithm, nonmatrix_options=config.nonmatrix_options,
                              splits=config.splits)
        return [{**group, "param_names": [canonical_fqn(name) for name in group["param_names"]]} for group in groups]
    trainable = [name for name, p in part.named_parameters() if p.requires_grad]
    by_algorithm, _ = OptimizersContainer._build_param_groups(part, config.param_groups, {})
    groups = [{**group, "algorithm": algorithm} for algorithm, named in by_algorithm.items() for group in named]
    claimed = {name for group in groups for name in group["param_names"]}
    missing = [name for name in trainable if canonical_fqn(name) not in claimed]
    if missing:
        raise ValueError(f"no ParamGroupConfig pattern matches the params {missing[:5]}"
                         f"{' …' if len(missing) > 5 else ''}; end param_groups with a catch-all, e.g. "
                         f"ParamGroupConfig(pattern=r'.*', optimizer_name='lion', optimizer_kwargs={{'lr': 3e-4}})")
    return groups


def _check_replicate_axis(groups: list[dict], replicate_mesh) -> None:
    """Refuse what would leave the replicas' gradients to someone else, or the replicas unknown."""
    params = [p for group in groups for p in group["params"]]
    hsdp = next((p for p in params if is_dtensor(p) and any(type(x) is Replicate for x in p.placements)), None)
    if hsdp is not None:
        raise ValueError(f"a param is placed {hsdp.placements} on the mesh {hsdp.device_mesh.mesh_dim_names}: FSDP2 "
                         f"HSDP owns the replicate dim (it all-reduces the gradients there, or keeps them to itself "
                         f"with set_requires_all_reduce(False)); parallelize with shardopt.torchtitan.shard_only("
                         f"parallelize_fn) (use_shardopt does it), which shards over 'fsdp' only")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1 and replicate_mesh is None and not any(is_dtensor(p) for p in params):
        raise ValueError(f"the model part's params are plain tensors on {world} ranks and no replicate mesh was "
                         f"given: parallelize the model with shardopt.torchtitan.shard_only(parallelize_fn) "
                         f"(FSDP2 on the 'fsdp' mesh, torchtitan's 'dp_replicate' mesh to shardopt), or pass "
                         f"options={{'replicate_mesh': <the data-parallel ProcessGroup>}}")


__all__ = ["ShardoptOptimizersContainer", "REPLICATE_MESH_ATTRIBUTE", "shard_only", "use_shardopt"]
