"""Every torch internal shardopt touches, in one place, each behind one accessor (DeepSpeed's: deepspeed/internals.py).

torch does not promise these names. Each is read only through the functions below, so a torch that
moved one fails with a message naming it instead of misbehaving in a run, and `missing_torch_internals()`
(run by tests/test_internals.py on every install) lists what the installed torch lacks.
Checked on torch 2.13 (`TESTED`); pyproject allows torch ≥ 2.6, where tests/test_internals.py is the check.

| internal | used in | for |
|---|---|---|
| `torch.autograd.Variable._execution_engine.queue_callback` | overlap (backward round) | run after backward's own callbacks (DDP's copy-back) |
| `ProcessGroup._get_backend(device).options._timeout` | wire/comm.py `Axis.private` | new groups get the user's collective timeout |
| `torch.optim.Optimizer._optimizer_load_state_dict_pre_hooks` | optim/checks.py, optim/optimizer.py | run the load pre-hooks once, before shardopt checks what they return |
| `torch.optim.Optimizer.__setstate__` making the `_optimizer_*_hooks` dicts and calling `_patch_step_function` | localsteps/surface.py | an Optimizer that holds no param groups of its own, with working step hooks |
| `DistributedDataParallel._get_active_ddp_module()` | frameworks/hf.py | the DDP running the model's forward (HF Trainer wraps it late) |
| `torch.distributed.tensor.placement_types._StridedShard` | layout/placement.py | FSDP2's placement over a tensor-parallel row split |
| `GradScaler._per_optimizer_states[id(optimizer)]` (`stage`, `found_inf_per_device`), `OptState.READY` | frameworks/gradscaler.py | agree the found-inf over the replicas and hand it back to `update()` |
| `torch._foreach_*` (`FOREACH`) | clipping, agreement, elementwise | the multi-tensor kernels torch.optim uses |
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.amp import grad_scaler as amp_grad_scaler
from torch.distributed.tensor import placement_types
from torch.nn.parallel import DistributedDataParallel

TESTED = ((2, 13), (2, 14))   # [low, high) of torch versions these internals were checked on
FOREACH = ("_foreach_norm", "_foreach_mul_", "_foreach_lerp_", "_foreach_addcmul_", "_foreach_sqrt", "_foreach_add_",
           "_foreach_addcdiv_", "_foreach_div_")
OPTIMIZER_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                   "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                   "_optimizer_load_state_dict_post_hooks")


def _moved(name: str) -> RuntimeError:
    return RuntimeError(f"torch {torch.__version__} lacks {name}, a torch internal shardopt relies on (checked on torch "
                        f"{TESTED[0][0]}.{TESTED[0][1]} to {TESTED[1][0]}.{TESTED[1][1] - 1}: shardopt/internals.py); "
                        f"install a torch in that range or report it")


def execution_engine():
    """autograd's engine, whose `queue_callback(fn)` runs fn at the end of the current backward."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not hasattr(engine, "queue_callback"):
        raise _moved("torch.autograd.Variable._execution_engine.queue_callback")
    return engine


def group_timeout(group):
    """The collective timeout of `group` (its backend's options), or None where the group has none to read."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def load_state_dict_pre_hooks(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's load_state_dict pre-hooks (an OrderedDict torch.optim keeps; the caller may swap it)."""
    try:
        return optimizer._optimizer_load_state_dict_pre_hooks
    except AttributeError:
        raise _moved("torch.optim.Optimizer._optimizer_load_state_dict_pre_hooks") from None


def active_ddp_module():
    """The DistributedDataParallel whose forward is running (None outside one)."""
    if not hasattr(DistributedDataParallel, "_get_active_ddp_module"):
        raise _moved("torch.nn.parallel.DistributedDataParallel._get_active_ddp_module")
    return DistributedDataParallel._get_active_ddp_module()


def strided_shard_type() -> type:
    """FSDP2's `_StridedShard` placement class."""
    if not hasattr(placement_types, "_StridedShard"):
        raise _moved("torch.distributed.tensor.placement_types._StridedShard")
    return placement_types._StridedShard


def grad_scaler_state(scaler, optimizer) -> dict:
    """`scaler`'s per-optimizer state for `optimizer` (keys "stage", "found_inf_per_device")."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        raise _moved("torch.amp.GradScaler._per_optimizer_states")
    state = states[id(optimizer)]
    if "stage" not in state or "found_inf_per_device" not in state:
        raise _moved("torch.amp.GradScaler._per_optimizer_states[...]['stage' / 'found_inf_per_device']")
    return state


def grad_scaler_ready(state: dict) -> bool:
    """Whether the scaler has not unscaled this optimizer's gradients yet this step (stage OptState.READY)."""
    if not hasattr(amp_grad_scaler, "OptState"):
        raise _moved("torch.amp.grad_scaler.OptState")
    return state["stage"] is amp_grad_scaler.OptState.READY


def missing_torch_internals() -> list[str]:
    """The internals of the table above that this torch lacks (empty when all are there)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    group = dist.ProcessGroup if dist.is_available() else None
    checks = {
        "torch.autograd.Variable._execution_engine.queue_callback":
            hasattr(getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback"),
        "DistributedDataParallel._get_active_ddp_module": hasattr(DistributedDataParallel, "_get_active_ddp_module"),
        "ProcessGroup._get_backend": group is not None and hasattr(group, "_get_backend"),
        "torch.distributed.tensor.placement_types._StridedShard": hasattr(placement_types, "_StridedShard"),
        "torch.amp.GradScaler._per_optimizer_states": _grad_scaler_has_states(),
        "torch.amp.grad_scaler.OptState.READY": hasattr(getattr(amp_grad_scaler, "OptState", None), "READY"),
        "torch.optim.Optimizer._patch_step_function": hasattr(optimizer, "_patch_step_function"),
        **{f"torch.optim.Optimizer.{name}": hasattr(optimizer, name) for name in OPTIMIZER_HOOKS},
        **{f"torch.{name}": hasattr(torch, name) for name in FOREACH},
    }
    return [name for name, present in checks.items() if not present]


def _grad_scaler_has_states() -> bool:
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    states = getattr(scaler, "_per_optimizer_states", None)
    return states is not None and {"stage", "found_inf_per_device"} <= set(states[0])
