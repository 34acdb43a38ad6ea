"""The algorithms a param group's "algorithm" key can name, by name: one record each (record.py).

Adding an algorithm is one new file defining its record and one line in ALGORITHMS below (or
`register(record)` at run time, e.g. from a test or a user's module).
"""

from __future__ import annotations

from .record import Algorithm
from .dion import DION
from .hyperparams import COMMON_KEYS, MAXIMIZE, unknown_algorithm
from .nonmatrix import ADAMW, LION
from .onebit_adam import ONEBIT_ADAM
from .signmuon import MUON, SIGN_MUON

ALGORITHMS: dict[str, Algorithm] = {}


def register(record: Algorithm) -> Algorithm:
    """Make `record` available under its name. A key it shares with another algorithm must have
    the same default (every group carries every key with one default, as torch.optim's do)."""
    if record.name in ALGORITHMS and ALGORITHMS[record.name] is not record:
        raise ValueError(f"an algorithm named {record.name!r} is registered already")
    shared = defaults()
    for key, hyperparameter in record.hyperparameters.items():
        if key in shared and shared[key] != hyperparameter.default:
            raise ValueError(f"algorithm {record.name!r}: default of {key!r} is {hyperparameter.default!r}, but "
                             f"the other algorithms' is {shared[key]!r}; use the same default or another key")
    ALGORITHMS[record.name] = record
    return record


def unregister(name: str) -> None:
    """Remove a record added with `register` (the built-in ones stay)."""
    if name in BUILT_IN:
        raise ValueError(f"{name!r} is a built-in algorithm")
    ALGORITHMS.pop(name, None)


def algorithm(name: str, index: int = 0) -> Algorithm:
    """The record of `name`, or ValueError naming param group `index` and the allowed names."""
    if name not in ALGORITHMS:
        raise unknown_algorithm(name, index, ALGORITHMS.values())
    return ALGORITHMS[name]


def defaults() -> dict:
    """Every registered key with its default (each group carries them all; each algorithm reads its own)."""
    merged = {key: MAXIMIZE.default for key in COMMON_KEYS}
    for record in ALGORITHMS.values():
        for key, hyperparameter in record.hyperparameters.items():
            merged.setdefault(key, hyperparameter.default)
    return merged


def matrix_algorithms() -> tuple[str, ...]:
    return tuple(name for name, record in ALGORITHMS.items() if record.matrix)


def nonmatrix_algorithms() -> tuple[str, ...]:
    return tuple(name for name, record in ALGORITHMS.items() if not record.matrix)


for _record in (DION, SIGN_MUON, MUON, ADAMW, LION, ONEBIT_ADAM):   # the built-in algorithms, one line each
    register(_record)
BUILT_IN = tuple(ALGORITHMS)
