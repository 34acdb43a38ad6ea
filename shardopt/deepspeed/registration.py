"""`register()`: deepspeed.initialize itself builds shardopt's optimizer, for code that calls it (HF
Trainer with a DeepSpeed config, Accelerate's DeepSpeedPlugin, Lightning's DeepSpeedStrategy).

After `register()`, `deepspeed.initialize` is `shardopt.deepspeed.initialize`: a config whose "optimizer"
type is "Dion" or "SignMuon" gets shardopt's optimizer, wired to the engine (the engine's all-reduce
off, ZeRO 1/2 done by shardopt, clipping agreed over the replicas); any other config reaches
DeepSpeed's own initialize unchanged. The frameworks look `deepspeed.initialize` up when they call it
(HF Trainer through Accelerate's `_prepare_deepspeed`, Lightning's strategies), so registering any
time before training starts is enough. Calling it again changes nothing; `unregister()` puts
DeepSpeed's initialize back.
"""

from __future__ import annotations

from . import internals
from .engine import initialize
from .wiring import Patches

_registered: list[Patches] = []   # the patch of deepspeed.initialize


def register() -> None:
    """Make `deepspeed.initialize` build shardopt's optimizer from "Dion" / "SignMuon" configs (idempotent)."""
    deepspeed = internals.load()
    if _registered:
        return
    patches = Patches()
    internals.keep_original_initialize(deepspeed)
    patches.set(deepspeed, "initialize", initialize)
    _registered.append(patches)


def unregister() -> None:
    """Give `deepspeed.initialize` back to DeepSpeed (engines already built stay wired; `detach(engine)` undoes that)."""
    if _registered:
        _registered.pop().undo()
        internals.forget_original_initialize()
