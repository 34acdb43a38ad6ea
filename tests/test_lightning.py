"""shardopt.lightning.ShardoptCallback under lightning.Trainer, 2 CPU processes under torchrun (gloo;
Lightning takes torchrun's environment): docs/trainers.md's Lightning block as written, and
tests/lightning_scenarios.py (DDP: replicas bitwise identical, replicate bytes per step ≤ 1/25 of an
fp32 all-reduce, momenta agreed at each save, resume bit-exact; FSDP2 through ModelParallelStrategy,
resume bit-exact; gradient_clip_val and a missing replicate_mesh refused)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from docblocks import python_block

pytest.importorskip("lightning", reason="the [lightning] extra is not installed")

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script, tmp_path, timeout=300, **env):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    path = os.pathsep.join([str(ROOT), str(ROOT / "integrations"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **env})
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-8000:]}"
    return done.stdout


def test_docs_lightning_block_trains_with_ddp_on_two_processes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(python_block("docs/trainers.md", "Lightning"))
    out = torchrun(script, tmp_path, RUN_DIR=str(tmp_path))
    assert "'bytes_sent'" in out, out


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lightning")
    torchrun(ROOT / "tests" / "lightning_scenarios.py", directory, SHARDOPT_TEST_OUT=str(directory))
    return [json.loads((directory / f"result-{rank}.json").read_text()) for rank in range(2)]


def test_ddp_replicas_identical_one_bit_exchange_and_bit_exact_resume(scenarios):
    for result in scenarios:
        ddp = result["ddp"]
        assert ddp["steps"] == 6 and ddp["trained"] and ddp["replicas_consistent"], ddp
        # the compressed exchange only (the 4th step's bytes include the epoch-end checkpoint's momentum average)
        ordinary = [b for step, b in enumerate(ddp["bytes_per_step"], 1) if step != 4]
        assert 0 < max(ordinary) <= ddp["fp32_all_reduce_bytes"] / 25, ddp
        assert not any(ddp["momenta_equal_between_saves"]), ddp   # decoupled momenta ...
        assert ddp["momenta_equal_at_saves"] == [True, True], ddp  # ... averaged before each save
        assert ddp["resume_bit_exact"], ddp


def test_fsdp2_model_parallel_strategy_shards_and_resumes_bit_exact(scenarios):
    for result in scenarios:
        fsdp2 = result["fsdp2"]
        assert fsdp2["steps"] == 6 and fsdp2["sharded"] and fsdp2["shard_bytes"] > 0, fsdp2
        assert fsdp2["resume_bit_exact"], fsdp2


def test_gradient_clip_val_and_missing_replicate_mesh_are_refused(scenarios):
    for result in scenarios:
        refused = result["refused"]
        assert "gradient_clip_val=1.0" in refused["gradient_clip_val"] and \
            "max_grad_norm=1.0" in refused["gradient_clip_val"], refused
        assert "replicate_mesh=torch.distributed.group.WORLD" in refused["no_replicate_mesh"], refused
