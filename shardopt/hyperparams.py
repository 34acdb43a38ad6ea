"""Param-group hyperparameters: the defaults, and validation with errors that name the parameter."""

from __future__ import annotations

import math
import numbers

import torch

from .lowrank import QR_METHODS
from .vote import VOTES

ALGORITHMS = ("dion", "signmuon", "muon", "adamw", "lion")
MATRIX_ALGORITHMS = ("dion", "signmuon", "muon")
LR_SCALES = ("none", "unit_gain")
ORTHOGONALIZE = ("shard", "full")
NS_DTYPES = ("float32", "float64", "bfloat16", "float16")
STATE_DTYPES = ("float32", "float64", "bfloat16", "float16")
WIRE_DTYPES = ("bfloat16", "float32")
DTYPE_KEYS = ("ns_dtype", "wire_dtype", "state_dtype")   # accept a torch.dtype or its name; the group holds the name

# Every group carries every key (as torch.optim does); each algorithm reads its own.
DEFAULTS = {
    "lr": 0.01,
    "weight_decay": 0.0,
    "maximize": False,   # every algorithm: step along +gradient (torch.optim's maximize)
    "betas": (0.9, 0.95),
    "epsilon": 1e-8,
    # matrix algorithms: dtype of the momentum (and Dion's Q); None = the param's dtype
    "state_dtype": None,
    # matrix algorithms: (dim, sizes) cuts each matrix along dim into blocks stepped as matrices of
    # their own (a fused QKV weight: (0, (d, d_kv, d_kv))); None = whole (shardopt/matrices.py)
    "split": None,
    # Dion
    "mu": 0.95,
    "rank_fraction": 1.0,
    "rank_multiple_of": 1,
    "qr_method": "qr",
    # Sign-Muon and Muon
    "momentum": 0.9,
    "nesterov": False,
    "ns_steps": 5,
    "ns_dtype": None,
    "compile": False,   # torch.compile the Newton–Schulz iterations (eager if compiling fails)
    "post_polar": False,
    "lr_scale": "none",
    "vote": "auto",
    "orthogonalize": "shard",
    # replicate-axis precision of Dion's P and R, and of Sign-Muon's "full" shard-axis all-to-all
    "wire_dtype": "bfloat16",
}

# Which keys each algorithm reads (validated only where read).
KEYS = {
    "dion": ("lr", "weight_decay", "epsilon", "mu", "rank_fraction", "rank_multiple_of", "qr_method", "wire_dtype",
             "state_dtype", "split"),
    "signmuon": ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "ns_dtype", "post_polar",
                 "lr_scale", "vote", "orthogonalize", "wire_dtype", "state_dtype", "compile", "split"),
    "muon": ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "ns_dtype", "orthogonalize", "wire_dtype",
             "state_dtype", "compile", "split"),
    "adamw": ("lr", "weight_decay", "betas", "epsilon"),
    "lion": ("lr", "weight_decay", "betas", "vote"),
}
COMMON_KEYS = ("maximize",)   # read by every algorithm
HINTS = {("adamw", "vote"): "; for a 1-bit vote of the non-matrix parameters use algorithm 'lion'"}


def _where(index: int) -> str:
    return f"param group {index}"


def _number(group, key, index, low, high, low_open=False, high_open=True):
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


def _choice(group, key, index, allowed):
    if group[key] not in allowed:
        raise ValueError(f"Invalid {key}: {group[key]!r} ({_where(index)}); allowed: {', '.join(map(repr, allowed))}")


def _integer(group, key, index, low):
    value = group[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"Invalid {key}: {value!r} ({_where(index)}); {key} must be an integer ≥ {low}")


def _flag(group, key, index):
    if not isinstance(group[key], bool):
        raise ValueError(f"Invalid {key}: {group[key]!r} ({_where(index)}); {key} must be True or False")


def normalize_dtype_names(group: dict) -> None:
    """In place: a torch.dtype given for ns_dtype / wire_dtype / state_dtype becomes its name ("bfloat16"), so
    param groups hold plain strings (state_dict, JSON checkpoint metadata)."""
    for key in DTYPE_KEYS:
        if isinstance(group.get(key), torch.dtype):
            group[key] = str(group[key]).removeprefix("torch.")


def validate_group(group: dict, index: int, explicit_keys=()) -> None:
    """Raise ValueError naming the key, the group, the value given and what is allowed.
    `explicit_keys`: the hyperparameters the user set in this group (not defaults); each must be
    one the group's algorithm reads."""
    algorithm = group["algorithm"]
    if algorithm not in ALGORITHMS:
        raise ValueError(f"Invalid algorithm: {algorithm!r} ({_where(index)}); allowed: "
                         f"{', '.join(map(repr, ALGORITHMS))}")
    for key in explicit_keys:
        if key in DEFAULTS and key not in KEYS[algorithm] + COMMON_KEYS:
            readers = [name for name, keys in KEYS.items() if key in keys]
            raise ValueError(f"Invalid {key} in {_where(index)} (algorithm {algorithm!r}): only "
                             f"{', '.join(map(repr, readers))} groups read {key}; remove it from this group"
                             f"{HINTS.get((algorithm, key), '')}")
    inf = float("inf")
    checks = {
        "lr": lambda: _number(group, "lr", index, 0.0, inf),
        "weight_decay": lambda: _number(group, "weight_decay", index, 0.0, inf),
        "epsilon": lambda: _number(group, "epsilon", index, 0.0, inf, low_open=True),
        "mu": lambda: _number(group, "mu", index, 0.0, 1.0),
        "momentum": lambda: _number(group, "momentum", index, 0.0, 1.0),
        "rank_fraction": lambda: _number(group, "rank_fraction", index, 0.0, 1.0, low_open=True, high_open=False),
        "rank_multiple_of": lambda: _integer(group, "rank_multiple_of", index, 1),
        "ns_steps": lambda: _integer(group, "ns_steps", index, 1),
        "qr_method": lambda: _choice(group, "qr_method", index, QR_METHODS),
        "lr_scale": lambda: _choice(group, "lr_scale", index, LR_SCALES),
        "vote": lambda: _choice(group, "vote", index, VOTES),
        "orthogonalize": lambda: _choice(group, "orthogonalize", index, ORTHOGONALIZE),
        "ns_dtype": lambda: _choice(group, "ns_dtype", index, (None,) + NS_DTYPES),
        "state_dtype": lambda: _choice(group, "state_dtype", index, (None,) + STATE_DTYPES),
        "wire_dtype": lambda: _choice(group, "wire_dtype", index, WIRE_DTYPES),
        "nesterov": lambda: _flag(group, "nesterov", index),
        "post_polar": lambda: _flag(group, "post_polar", index),
        "maximize": lambda: _flag(group, "maximize", index),
        "compile": lambda: _flag(group, "compile", index),
        "betas": lambda: _betas(group, index),
        "split": lambda: _split(group, index),
    }
    for key in KEYS[algorithm] + COMMON_KEYS:
        checks[key]()


def state_dtype(group: dict, param: torch.Tensor) -> torch.dtype:
    """The dtype of a matrix param's optimizer state: the group's `state_dtype`, else the param's.
    The step computes in fp32 whatever the state dtype (shardopt.buckets.compute_dtype)."""
    return getattr(torch, group["state_dtype"]) if group.get("state_dtype") else param.dtype


def _split(group, index):
    """None, or (dim, sizes): dim an int, sizes a non-empty sequence of integers ≥ 1 (whether they fit
    each param is checked with the param: shardopt.matrices.split_sizes)."""
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


def _betas(group, index):
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"Invalid betas: {betas!r} ({_where(index)}); betas must be a pair (beta1, beta2)")
    for i, beta in enumerate(betas):
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0.0 <= beta < 1.0:   # (NaN fails)
            raise ValueError(f"Invalid betas[{i}]: {beta!r} ({_where(index)}); each beta must be in [0.0, 1.0)")
