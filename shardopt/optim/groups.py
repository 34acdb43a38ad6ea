"""`param_groups(model)`: split a model into matrix weights and everything else."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..algorithms import registry
from ..algorithms.hyperparams import normalize_dtype_names
from .traffic import describe

NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._BatchNorm,
              nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm)
EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)
CONV_TYPES = (nn.modules.conv._ConvNd,)   # 3-D conv weights are kernels, not stacks of matrices
HEAD_NAMES = ("lm_head", "output", "head", "classifier")


def _why_nonmatrix(name: str, param: torch.Tensor, module: nn.Module, embedding_params: set,
                   head_names, nonmatrix_names) -> str | None:
    """Why a parameter is not a matrix weight, or None if it is one."""
    leaf = name.rsplit(".", 1)
    module_name = leaf[0] if len(leaf) == 2 else ""
    if any(pattern in name for pattern in nonmatrix_names):
        return "named non-matrix"
    if isinstance(module, EMBEDDING_TYPES) or id(param) in embedding_params:
        return "embedding (or tied to one)"
    if isinstance(module, NORM_TYPES):
        return "norm"
    expert_stack = param.ndim == 3 and not isinstance(module, CONV_TYPES)   # (E, m, n): E matrices
    if param.ndim != 2 and not expert_stack:
        return "bias" if name.endswith("bias") else f"{param.ndim}-D"
    if module_name.rsplit(".", 1)[-1] in head_names:
        return "output head"
    return None


DEPRECATED_KEYWORDS = {"scalar_algorithm": "nonmatrix_algorithm", "scalar_options": "nonmatrix_options",
                       "scalar_names": "nonmatrix_names"}


def param_groups(model: nn.Module, matrix_algorithm: str = "dion", nonmatrix_algorithm: str = "adamw", *,
                 matrix_options: dict | None = None, nonmatrix_options: dict | None = None,
                 head_names=HEAD_NAMES, nonmatrix_names=(), splits: dict | None = None, verbose: bool = False,
                 replicas: int | None = None, **deprecated) -> list[dict]:
    """Two param groups for a model: 2-D weights and 3-D expert stacks (E, m, n) for
    `matrix_algorithm`, the rest for `nonmatrix_algorithm`.

    Non-matrix (element-wise) params: embeddings and weights tied to them, output heads (module
    named in `head_names`), norms, biases, conv kernels, every other tensor that is not 2-D or
    3-D, and any whose name contains a string in `nonmatrix_names`. Each group carries "param_names"
    (so errors name parameters) and the options given for it (e.g. nonmatrix_options={"lr": 1e-2}). The
    non-matrix group has no weight decay unless nonmatrix_options sets "weight_decay" (norms, biases
    and embeddings are usually not decayed); the matrix group takes the optimizer's default.
    splits: {name substring: (dim, sizes)}: the matrix params whose name contains the substring (the
    first that matches) go to a matrix group of their own with that `split` (fused projections,
    e.g. {"attn.qkv": (0, (d, d_kv, d_kv))}; shardopt/layout/matrices.py); each must match some matrix param.
    With verbose=True, prints one line per group with its replicate-axis bytes per step at
    `replicas` replicas (see describe_groups). Groups with no params are left out.
    The keywords scalar_algorithm, scalar_options and scalar_names (before 0.3) still work, with a
    DeprecationWarning.
    """
    nonmatrix_algorithm, nonmatrix_options, nonmatrix_names, nonmatrix_keyword = _current_keywords(
        deprecated, nonmatrix_algorithm, nonmatrix_options, nonmatrix_names)
    for keyword, value, allowed in (("matrix_algorithm", matrix_algorithm, registry.matrix_algorithms()),
                                    (nonmatrix_keyword, nonmatrix_algorithm, registry.nonmatrix_algorithms())):
        if value not in allowed:
            raise ValueError(f"Invalid {keyword}: {value!r}; allowed: {', '.join(map(repr, allowed))}")
    matrix = {"params": [], "param_names": [], "algorithm": matrix_algorithm, **(matrix_options or {})}
    nonmatrix = {"params": [], "param_names": [], "algorithm": nonmatrix_algorithm, "weight_decay": 0.0,
                 **(nonmatrix_options or {})}
    split_groups = {pattern: {**matrix, "params": [], "param_names": [], "split": split}
                    for pattern, split in (splits or {}).items()}
    reasons = _sort_params(model, matrix, nonmatrix, split_groups, head_names, nonmatrix_names)
    unmatched = [pattern for pattern, group in split_groups.items() if not group["params"]]
    if unmatched:
        raise ValueError(f"splits {unmatched} match no matrix parameter's name; matrix params: "
                         f"{', '.join(matrix['param_names'][:8])}{' …' if len(matrix['param_names']) > 8 else ''}")
    groups = [g for g in (matrix, *split_groups.values(), nonmatrix) if g["params"]]
    if verbose:
        print(describe_groups(groups, reasons, replicas))
    return groups


def _current_keywords(deprecated: dict, nonmatrix_algorithm: str, nonmatrix_options: dict | None,
                      nonmatrix_names) -> tuple:
    """(nonmatrix_algorithm, nonmatrix_options, nonmatrix_names, the keyword that named the algorithm), each
    taken from its keyword before 0.3 (DEPRECATED_KEYWORDS) where `deprecated` has it, with a DeprecationWarning
    at param_groups' caller; TypeError for any other keyword in `deprecated`."""
    for old in deprecated:
        if old not in DEPRECATED_KEYWORDS:
            raise TypeError(f"param_groups() got an unexpected keyword argument {old!r}")
        warnings.warn(f"param_groups({old}=...) is deprecated; use {DEPRECATED_KEYWORDS[old]}=...", DeprecationWarning,
                      stacklevel=3)
    return (deprecated.get("scalar_algorithm", nonmatrix_algorithm), deprecated.get("scalar_options", nonmatrix_options),
            deprecated.get("scalar_names", nonmatrix_names),
            "scalar_algorithm" if "scalar_algorithm" in deprecated else "nonmatrix_algorithm")


def _sort_params(model: nn.Module, matrix: dict, nonmatrix: dict, split_groups: dict, head_names,
                 nonmatrix_names) -> dict[str, int]:
    """Append each param of `model` that requires a gradient, with its name, to `nonmatrix` (`_why_nonmatrix`
    gives a reason), else to the group of the first pattern of `split_groups` its name contains, else to
    `matrix`; returns how many params each reason made non-matrix."""
    modules = dict(model.named_modules())
    embedding_params = {id(p) for m in model.modules() if isinstance(m, EMBEDDING_TYPES) for p in m.parameters(recurse=False)}
    reasons: dict[str, int] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        module = modules[name.rsplit(".", 1)[0]] if "." in name else model
        reason = _why_nonmatrix(name, param, module, embedding_params, head_names, nonmatrix_names)
        target = nonmatrix if reason is not None else \
            next((group for pattern, group in split_groups.items() if pattern in name), matrix)
        target["params"].append(param)
        target["param_names"].append(name)
        if reason is not None:
            reasons[reason] = reasons.get(reason, 0) + 1
    return reasons


def describe_groups(groups: list[dict], reasons: dict | None = None, replicas: int | None = None) -> str:
    """One line per group: algorithm, tensors, elements and replicate-axis bytes per step per rank at
    `replicas` replicas (default: the world size of an initialized process group, else 2; keys a
    group does not set take the optimizers' defaults), the whole model against a float32
    all-reduce, and why params were made non-matrix. An optimizer's own figure: `opt.describe()`."""
    if replicas is None:
        replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 2
    complete = []
    for group in groups:
        complete.append({**registry.defaults(), **group})
        normalize_dtype_names(complete[-1])
    text = describe(complete, replicas)
    if reasons:
        text += "\nshardopt: non-matrix params: " + ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items()))
    return text
