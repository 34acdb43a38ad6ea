"""Param-group hyperparameters: the checks (errors that name the parameter) and the keys several
algorithms share; each algorithm's record (algorithm.py) lists the keys it reads."""

from __future__ import annotations

import math
import numbers

import torch

from .record import Hyperparameter
from .lowrank import QR_METHODS
from .polar import SCHEDULES
from ..wire.vote import VOTES

LR_SCALES = ("none", "unit_gain")
ORTHOGONALIZE = ("shard", "full")
NS_DTYPES = ("float32", "float64", "bfloat16", "float16")
STATE_DTYPES = ("float32", "float64", "bfloat16", "float16")
WIRE_DTYPES = ("bfloat16", "float32")
MATMUL_DTYPES = ("float32", "bfloat16")
DTYPE_KEYS = ("ns_dtype", "wire_dtype", "state_dtype", "matmul_dtype")   # accept a torch.dtype or its name; the group holds the name
COMMON_KEYS = ("maximize",)   # read by every algorithm
HINTS = {("adamw", "vote"): "; for a 1-bit vote of the non-matrix parameters use algorithm 'lion'"}
INF = float("inf")


def _where(index: int) -> str:
    return f"param group {index}"


def number(group, key, index, low, high, low_open=False, high_open=True):
    value = group[key]
    if isinstance(value, torch.Tensor):   # torch.optim's capturable pattern; shardopt steps are not graph-captured
        raise ValueError(f"Invalid {key}: a tensor ({_where(index)}); pass a Python float, e.g. {key}={key}.item()")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"Invalid {key}: {value!r} ({_where(index)}); {key} must be a real number (not NaN)")
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if below or above:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"Invalid {key}: {value} ({_where(index)}); {key} must be in {interval}")


def choice(group, key, index, allowed):
    if group[key] not in allowed:
        raise ValueError(f"Invalid {key}: {group[key]!r} ({_where(index)}); allowed: {', '.join(map(repr, allowed))}")


def integer(group, key, index, low):
    value = group[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"Invalid {key}: {value!r} ({_where(index)}); {key} must be an integer ≥ {low}")


def flag(group, key, index):
    if not isinstance(group[key], bool):
        raise ValueError(f"Invalid {key}: {group[key]!r} ({_where(index)}); {key} must be True or False")


def normalize_dtype_names(group: dict) -> None:
    """In place: a torch.dtype given for ns_dtype / wire_dtype / state_dtype / matmul_dtype becomes its name ("bfloat16"), so
    param groups hold plain strings (state_dict, JSON checkpoint metadata)."""
    for key in DTYPE_KEYS:
        if isinstance(group.get(key), torch.dtype):
            group[key] = str(group[key]).removeprefix("torch.")


def validate_group(group: dict, index: int, algorithm, algorithms, explicit_keys=()) -> None:
    """Raise ValueError naming the key, the group, the value given and what is allowed.
    algorithm: the group's record (algorithm.py); algorithms: every registered record (to name the
    readers of a key). `explicit_keys`: the hyperparameters the user set in this group (not
    defaults); each must be one the group's algorithm reads."""
    known = {name: record for name, record in ((r.name, r) for r in algorithms)}
    for key in explicit_keys:
        if key not in algorithm.hyperparameters and key not in COMMON_KEYS:
            readers = [name for name, record in known.items() if key in record.hyperparameters]
            raise ValueError(f"Invalid {key} in {_where(index)} (algorithm {algorithm.name!r}): only "
                             f"{', '.join(map(repr, readers))} groups read {key}; remove it from this group"
                             f"{HINTS.get((algorithm.name, key), '')}")
    for key, hyperparameter in algorithm.hyperparameters.items():
        hyperparameter.check(group, key, index)
    MAXIMIZE.check(group, "maximize", index)


def unknown_algorithm(name, index: int, algorithms) -> ValueError:
    return ValueError(f"Invalid algorithm: {name!r} ({_where(index)}); allowed: "
                      f"{', '.join(repr(record.name) for record in algorithms)}")


def state_dtype(group: dict, param: torch.Tensor) -> torch.dtype:
    """The dtype of a matrix param's optimizer state: the group's `state_dtype`, else the param's.
    The step computes in fp32 whatever the state dtype (shardopt.layout.buckets.compute_dtype)."""
    return getattr(torch, group["state_dtype"]) if group.get("state_dtype") else param.dtype


def split_check(group, key, index):
    """None, or (dim, sizes): dim an int, sizes a non-empty sequence of integers ≥ 1 (whether they fit
    each param is checked with the param: shardopt.layout.matrices.split_sizes)."""
    split = group["split"]
    if split is None:
        return
    example = "e.g. split=(0, (d, d_kv, d_kv)) for a fused QKV weight"
    if not (isinstance(split, (tuple, list)) and len(split) == 2 and isinstance(split[1], (tuple, list))):
        raise ValueError(f"Invalid split: {split!r} ({_where(index)}); split must be a pair (dim, sizes), {example}")
    dim, sizes = split
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise ValueError(f"Invalid split: {split!r} ({_where(index)}); its dim must be an integer, {example}")
    if not sizes or any(isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1
                        for size in sizes):
        raise ValueError(f"Invalid split: {split!r} ({_where(index)}); its sizes must be integers ≥ 1 (at least "
                         f"one), {example}")


def betas_check(group, key, index):
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"Invalid betas: {betas!r} ({_where(index)}); betas must be a pair (beta1, beta2)")
    for i, beta in enumerate(betas):
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0.0 <= beta < 1.0:   # (NaN fails)
            raise ValueError(f"Invalid betas[{i}]: {beta!r} ({_where(index)}); each beta must be in [0.0, 1.0)")


def _range(low, high, **interval):
    return lambda group, key, index: number(group, key, index, low, high, **interval)


def _choices(allowed):
    return lambda group, key, index: choice(group, key, index, allowed)


# keys several algorithms read: one default and one check each (every group carries every key,
# as torch.optim's groups carry its defaults; each algorithm reads and validates its own)
LR = Hyperparameter(0.01, _range(0.0, INF))
WEIGHT_DECAY = Hyperparameter(0.0, _range(0.0, INF))
MAXIMIZE = Hyperparameter(False, flag)   # every algorithm: step along +gradient (torch.optim's maximize)
BETAS = Hyperparameter((0.9, 0.95), betas_check)
EPSILON = Hyperparameter(1e-8, _range(0.0, INF, low_open=True))
# matrix algorithms: dtype of the momentum (and Dion's Q); None = the param's dtype
STATE_DTYPE = Hyperparameter(None, _choices((None,) + STATE_DTYPES))
# matrix algorithms: (dim, sizes) cuts each matrix along dim into blocks stepped as matrices of
# their own (a fused QKV weight: (0, (d, d_kv, d_kv))); None = whole (shardopt/layout/matrices.py)
SPLIT = Hyperparameter(None, split_check)
# replicate-axis precision of Dion's P and R, and of Sign-Muon's "full" shard-axis all-to-all
WIRE_DTYPE = Hyperparameter("bfloat16", _choices(WIRE_DTYPES))
VOTE = Hyperparameter("auto", _choices(VOTES))
# Sign-Muon and Muon
MOMENTUM = Hyperparameter(0.9, _range(0.0, 1.0))
NESTEROV = Hyperparameter(False, flag)
NS_STEPS = Hyperparameter(5, lambda group, key, index: integer(group, key, index, 1))
NS_DTYPE = Hyperparameter(None, _choices((None,) + NS_DTYPES))
NS_COEFFICIENTS = Hyperparameter("quintic", _choices(tuple(SCHEDULES)))   # Newton–Schulz schedule (shardopt/algorithms/polar.py)
COMPILE = Hyperparameter(False, flag)   # torch.compile the Newton–Schulz iterations (eager if compiling fails)
ORTHOGONALIZE_KEY = Hyperparameter("shard", _choices(ORTHOGONALIZE))
# Dion
MU = Hyperparameter(0.95, _range(0.0, 1.0))
RANK_FRACTION = Hyperparameter(1.0, _range(0.0, 1.0, low_open=True, high_open=False))
RANK_MULTIPLE_OF = Hyperparameter(1, lambda group, key, index: integer(group, key, index, 1))
QR_METHOD = Hyperparameter("qr", _choices(QR_METHODS))
# the inputs of Dion's large matmuls; None = bf16 on CUDA for fp32 compute, else the compute dtype (lowrank.py)
MATMUL_DTYPE = Hyperparameter(None, _choices((None,) + MATMUL_DTYPES))
POST_POLAR = Hyperparameter(False, flag)
LR_SCALE = Hyperparameter("none", _choices(LR_SCALES))


def follow_momentum_schedule(group: dict, momentum: str) -> None:
    """torch's CyclicLR and OneCycleLR with cycle_momentum=True cycle betas[0] of every group (the
    optimizer's defaults have "betas": the non-matrix AdamW and Lion groups' key) and mark each group
    they drive with "base_momentum"; such a group whose algorithm's momentum is another key
    (`Algorithm.momentum`: Sign-Muon's and Muon's "momentum", Dion's "mu") takes it from betas[0],
    so the schedule drives the momentum the step uses (and the group shows it)."""
    if momentum != "betas" and "base_momentum" in group:
        group[momentum] = group["betas"][0]
