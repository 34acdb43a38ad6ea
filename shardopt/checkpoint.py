"""Optimizer state as a safetensors file (no pickle), for users who do not use DCP.

    save_optimizer_state(optimizer, "opt.safetensors")   # atomic: temp file, fsync, rename
    load_optimizer_state(optimizer, "opt.safetensors")   # checks name, shapes, checksums

Tensors are stored as "state.<param index>.<key>" (this rank's local tensors:
under FSDP2 each rank writes its own file, e.g. "opt-rank{rank}.safetensors";
to change the world size, use torch.distributed.checkpoint instead). The
metadata holds the optimizer class, its param-group hyperparameters, the step,
and a SHA-256 of every tensor's bytes, so a corrupt, truncated or foreign file
is rejected with an error that names the tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save, save_file

from .layout.placement import local

FORMAT = "shardopt-optimizer-state/1"
TENSORS_FORMAT = "shardopt-tensors/1"


def _digest(tensor: torch.Tensor) -> str:
    """SHA-256 of the tensor's safetensors encoding (its dtype, shape and bytes)."""
    return hashlib.sha256(save({"tensor": tensor.detach().cpu().contiguous()})).hexdigest()


def _hyperparameters(optimizer) -> list[dict]:
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def _write_atomically(tensors: dict, path, metadata: dict) -> None:
    """safetensors file at `path`: a temp file in the same directory, fsync, rename, fsync of the directory."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=directory)
    os.close(handle)
    try:
        save_file(tensors, temporary, metadata=metadata)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_optimizer_state(optimizer, path: str | os.PathLike) -> None:
    """Write `optimizer.state_dict()` to `path` atomically (a crash leaves any previous file intact)."""
    state = optimizer.state_dict()
    tensors = {}
    for index, param_state in state["state"].items():
        for key, value in param_state.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"optimizer state {index}.{key} is a {type(value).__name__}, not a tensor; "
                                 f"save_optimizer_state stores tensors only")
            tensors[f"state.{index}.{key}"] = local(value).detach().cpu().contiguous()
    steps = [float(s["step"]) for s in state["state"].values() if "step" in s]
    metadata = {
        "format": FORMAT,
        "optimizer": type(optimizer).__name__,
        "param_groups": json.dumps(_hyperparameters(optimizer), default=str),
        "group_params": json.dumps([group["params"] for group in state["param_groups"]]),
        "step": str(int(max(steps)) if steps else 0),
        "sha256": json.dumps({name: _digest(t) for name, t in tensors.items()}),
    }
    _write_atomically(tensors, path, metadata)


def save_tensors(tensors: list[torch.Tensor], path: str | os.PathLike) -> None:
    """This rank's local pieces of `tensors` (e.g. one replica's params between two syncs) as
    "tensor.<i>", atomically, with a SHA-256 of each; `load_tensors` reads them back into the same list."""
    pieces = {f"tensor.{i}": local(t).detach().cpu().contiguous() for i, t in enumerate(tensors)}
    _write_atomically(pieces, path, {"format": TENSORS_FORMAT, "count": str(len(pieces)),
                                     "sha256": json.dumps({name: _digest(t) for name, t in pieces.items()})})


def load_tensors(tensors: list[torch.Tensor], path: str | os.PathLike) -> None:
    """Copy what save_tensors wrote into `tensors` (their local pieces, in place), after every check:
    format, count, each tensor's dtype, shape and SHA-256; nothing is written unless all fit."""
    metadata = read_metadata(path, TENSORS_FORMAT)
    pieces = _checked_tensors(path, metadata)
    if int(metadata["count"]) != len(tensors) or len(pieces) != len(tensors):
        raise ValueError(f"{path} holds {metadata['count']} tensors, {len(tensors)} are to be loaded")
    for i, tensor in enumerate(tensors):
        piece, name = pieces.get(f"tensor.{i}"), f"tensor.{i}"
        if piece is None:
            raise ValueError(f"{path}: tensor {name!r} is missing")
        if piece.dtype != local(tensor).dtype or piece.shape != local(tensor).shape:
            raise ValueError(f"{path}: tensor {name!r} is {piece.dtype} {tuple(piece.shape)}, this rank holds "
                             f"{local(tensor).dtype} {tuple(local(tensor).shape)}")
    with torch.no_grad():
        for i, tensor in enumerate(tensors):
            local(tensor).copy_(pieces[f"tensor.{i}"])


def _checked_tensors(path, metadata: dict) -> dict[str, torch.Tensor]:
    """The file's tensors, each present and matching the SHA-256 its metadata lists (ValueError naming it)."""
    try:
        tensors = load_file(os.fspath(path))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path} could not be read ({error}); it may be truncated or corrupt") from error
    for name, digest in json.loads(metadata["sha256"]).items():
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name!r} listed in the metadata is missing")
        if _digest(tensors[name]) != digest:
            raise ValueError(f"{path}: tensor {name!r} fails its SHA-256 check; the file is corrupt")
    return tensors


def read_metadata(path: str | os.PathLike, expected_format: str = FORMAT) -> dict:
    """The metadata of a file written here (raises ValueError if it is not one of `expected_format`)."""
    try:
        with safe_open(os.fspath(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path} is not a readable safetensors file ({error}); it may be truncated or corrupt") from error
    if metadata.get("format") != expected_format:
        raise ValueError(f"{path} is not a shardopt {'optimizer-state' if expected_format == FORMAT else 'tensors'} "
                         f"file (format {metadata.get('format')!r}, expected {expected_format!r})")
    return metadata


def load_optimizer_state(optimizer, path: str | os.PathLike) -> dict:
    """Load a file written by save_optimizer_state into `optimizer` (same class, same param shapes).
    Returns the file's metadata. Raises ValueError naming the first tensor that does not match."""
    metadata = read_metadata(path)
    if metadata["optimizer"] != type(optimizer).__name__:
        raise ValueError(f"{path} holds {metadata['optimizer']} state; cannot load it into {type(optimizer).__name__}")
    tensors = _checked_tensors(path, metadata)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    group_params = json.loads(metadata["group_params"])
    if [len(g) for g in group_params] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError(f"{path}: param groups hold {[len(g) for g in group_params]} params, the optimizer "
                         f"{[len(g['params']) for g in optimizer.param_groups]}")
    state = {}
    for name, tensor in tensors.items():
        _, index, key = name.split(".", 2)
        param = params[int(index)]
        current = optimizer.state.get(param, {}).get(key)
        expected = tuple(local(param).shape) if key in ("momentum", "exp_avg", "exp_avg_sq") else None
        if expected is not None and tuple(tensor.shape) != expected:
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)} but param {index} holds "
                             f"{expected} on this rank")
        if current is not None and hasattr(current, "to_local"):
            local(current).copy_(tensor)
            tensor = current
        state.setdefault(int(index), {})[key] = tensor
    groups = json.loads(metadata["param_groups"])
    for saved, group, ids in zip(groups, optimizer.param_groups, group_params):
        saved["params"] = ids
        for key in ("betas",):
            if key in saved:
                saved[key] = tuple(saved[key])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return metadata
