"""The catalogues of torch and DeepSpeed internals (shardopt/internals.py, shardopt/deepspeed/internals.py):
every internal listed is present in the installed version, and reading one that moved names it."""

import ast
import datetime
import pathlib

import pytest
import torch
import torch.distributed as dist

from shardopt import internals


def test_every_listed_torch_internal_is_present_in_this_torch():
    missing = internals.missing_torch_internals()
    assert missing == [], f"torch {torch.__version__} moved {missing}: update shardopt/internals.py and its callers"


def _torch_privates_touched(tree) -> set[str]:
    """`torch….<_name>` attribute chains, `from torch… import _name`, and the catalogued private names."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            found |= {alias.name for alias in node.names if alias.name.startswith("_")}
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if (isinstance(root, ast.Name) and root.id in ("torch", "dist")) or node.attr in CATALOGUED:
                found.add(node.attr)
    return found


CATALOGUED = {"_execution_engine", "_get_backend", "_timeout", "_get_active_ddp_module", "_patch_step_function",
              "_StridedShard", *internals.OPTIMIZER_HOOKS}


def test_torch_internals_are_read_only_through_the_catalogue():
    """Outside shardopt/internals.py the package touches no torch private but the multi-tensor kernels it lists."""
    package = pathlib.Path(internals.__file__).parent
    touched = {}
    for path in sorted(package.rglob("*.py")):
        if path.name == "internals.py":
            continue
        names = _torch_privates_touched(ast.parse(path.read_text())) - set(internals.FOREACH)
        if names:
            touched[str(path.relative_to(package))] = sorted(names)
    assert touched == {}, f"torch internals used outside shardopt/internals.py: {touched}"


def test_group_timeout_reads_the_timeout_a_group_was_made_with(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=17))
    try:
        assert internals.group_timeout(dist.group.WORLD) == datetime.timedelta(seconds=17)
        assert internals.group_timeout(object()) is None
    finally:
        dist.destroy_process_group()


def test_a_moved_internal_raises_naming_it_and_the_checked_versions(monkeypatch):
    monkeypatch.delattr(torch.nn.parallel.DistributedDataParallel, "_get_active_ddp_module")
    with pytest.raises(RuntimeError, match=r"lacks torch\.nn\.parallel\.DistributedDataParallel\._get_active_ddp_module.*"
                                           r"checked on torch 2\.13 to 2\.13"):
        internals.active_ddp_module()
    assert "DistributedDataParallel._get_active_ddp_module" in internals.missing_torch_internals()


def test_every_listed_deepspeed_internal_is_present_in_this_deepspeed():
    deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra ([deepspeed]), not installed")
    from shardopt.deepspeed import internals as deepspeed_internals
    missing = deepspeed_internals.missing_internals(deepspeed)
    assert missing == [], f"DeepSpeed {deepspeed.__version__} moved {missing}: update shardopt/deepspeed/internals.py"
