"""shardopt.torchtitan with torchtitan's own container base, lr scheduler, ParallelDims and
CheckpointManager, 2 CPU processes under torchrun (gloo): docs/trainers.md's torchtitan block as
written, and tests/torchtitan_scenarios.py (replicas bitwise identical, replicate bytes per step ≤ 1/25
of an fp32 all-reduce, momenta averaged at each save, resume bit-exact, per-pattern groups with a fused
QKV split, the refusals); launch/torchtitan_debug.py refuses to start without CUDA."""

import math
import subprocess
import sys

import pytest

from two_processes import ROOT, check_docs_bytes, check_exchange, import_without, run_docs_block

pytest.importorskip("torchtitan", reason="the [torchtitan] extra is not installed")
SCENARIOS = "torchtitan_scenarios"   # the `scenarios` fixture (tests/conftest.py) runs it once for the module

def test_hsdp_replicas_identical_one_bit_exchange_and_bit_exact_resume(scenarios):
    for result in scenarios:
        hsdp = result["hsdp"]
        assert hsdp["max_norm"] == math.inf and hsdp["max_grad_norm"] == 1.0, hsdp   # clipping routed
        assert ["signmuon", 2, [0, [32, 32, 32]]] in hsdp["groups"] and hsdp["groups"][-1][0] == "lion", hsdp
        assert hsdp["replicas_consistent"], hsdp
        check_exchange(hsdp, steps=6, saved_after=3)   # checkpoints at steps 3 and 6
        assert hsdp["loaded"] and hsdp["resumed_from"] == 3 and hsdp["resume_bit_exact"], hsdp


def test_the_bytes_docs_trainers_md_quotes_are_this_run_s(scenarios):
    check_docs_bytes(SCENARIOS, scenarios)


def test_per_pattern_param_groups_with_a_fused_qkv_split(scenarios):
    for result in scenarios:
        patterns = result["patterns"]
        assert [g[0] for g in patterns["groups"]] == ["signmuon", "signmuon", "lion"], patterns
        assert patterns["groups"][0] == ["signmuon", 2, [0, [32, 32, 32]]], patterns
        assert patterns["replicas_consistent"] and patterns["replicate_bytes"] > 0, patterns


@pytest.mark.parametrize("case, words", [
    ("no_lr", ["has no 'lr'", "options={'lr': 0.02}"]),
    ("optimizer_name", ["optimizer_name='AdamW'", "'signmuon'", "'lion'"]),
    ("splits_beside_param_groups", ["splits and nonmatrix_options", "optimizer_kwargs"]),
    ("unmatched", ["transformer.wte.weight", "ParamGroupConfig(pattern=r'.*'"]),
    ("stock_hsdp", ["(Replicate(), Shard(dim=0))", "shard_only(parallelize_fn)"]),
    ("plain_params", ["plain tensors on 2 ranks", "replicate_mesh"]),
    ("overlap_backward", ["clip factor", "remove overlap_backward"]),
    ("spmd_backend", ["parallelism.spmd_backend='spmd_types'", "'partial_dtensor'"]),
])
def test_bad_settings_are_refused_naming_the_setting_and_the_fix(scenarios, case, words):
    for result in scenarios:
        message = result["refused"][case]
        assert message is not None and all(word in message for word in words), message


def test_docs_torchtitan_block_trains_on_two_processes(tmp_path):
    out = run_docs_block("torchtitan", tmp_path)
    assert "'bytes_sent'" in out, out


def test_gpu_debug_script_exits_with_a_message_without_cuda(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the script itself")
    done = subprocess.run([sys.executable, str(ROOT / "launch" / "torchtitan_debug.py"), "--assets", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1 and "needs CUDA GPUs" in done.stderr and "torch.cuda.set_device" in done.stderr, done


def test_shardopt_imports_without_torchtitan_and_the_adapter_says_what_to_install():
    done = import_without("shardopt.torchtitan", "torchtitan")
    assert done.returncode == 1 and "pip install 'shardopt[torchtitan]'" in done.stderr, done.stderr[-2000:]
