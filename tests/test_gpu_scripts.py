"""The GPU scripts on a machine without one (issue 43 item 8): launch/gpu_smoke.sh's dry run on the CPU,
its detection (which section runs with 0, 1, 2 GPUs) and its verdicts; launch/gpu_check.py without
torch.optim.Muon; a failed torch.compile reported as a failure, not timed as eager.

The dry run here leaves out the one section that runs on the CPU (fsdp_overlap: its test,
tests/test_train_fsdp.py::test_overlap_backward_on_and_off_are_bitwise_equal[gloo_1rank], is in the
default suite itself; `bash launch/gpu_smoke.sh --cpu` runs it too, ~20 s)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))
sys.path.insert(1, str(ROOT / "launch" / "bench"))
import gpu_smoke  # noqa: E402
from gpu_smoke import Machine  # noqa: E402

GPU_SECTIONS = ["test_cuda", "step_ops", "deepspeed_memory", "nccl_2gpu"]


def test_cpu_dry_run_names_the_reason_of_every_skipped_section_and_exits_0():
    done = subprocess.run(["bash", str(ROOT / "launch" / "gpu_smoke.sh"), "--cpu", "--only", *GPU_SECTIONS],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("section "))) + 1:]
    rows = {line.split()[0]: line.split(None, 3) for line in table if line.split()[0] in GPU_SECTIONS}
    assert sorted(rows) == sorted(GPU_SECTIONS), done.stdout
    for name, (_, result, seconds, detail) in rows.items():
        assert (result, seconds) == ("skipped", "0.0"), rows[name]
        assert "needs 1 GPU(s)" in detail or "needs 2 GPU(s)" in detail, rows[name]
        assert "CUDA" in detail, rows[name]   # --cpu: no CUDA device, or a CPU build of torch
    assert done.stdout.count("\nskipped: needs ") == len(GPU_SECTIONS)
    assert "fsdp_overlap" not in rows and "no section that ran failed" in done.stdout


@pytest.mark.parametrize("gpus, runs", [
    (0, ["fsdp_overlap"]),
    (1, ["test_cuda", "step_ops", "fsdp_overlap", "deepspeed_memory"]),
    (2, ["test_cuda", "step_ops", "fsdp_overlap", "deepspeed_memory", "nccl_2gpu"])])
def test_each_section_runs_where_its_gpus_are(gpus, runs):
    machine = Machine(gpus, None if gpus else "no CUDA device (test)", deepspeed=True, step_ops=True)
    assert [s.name for s in gpu_smoke.SECTIONS if gpu_smoke.skip_reason(s, machine) is None] == runs
    one_gpu = Machine(1, None, deepspeed=False, step_ops=False)
    reasons = {s.name: gpu_smoke.skip_reason(s, one_gpu) for s in gpu_smoke.SECTIONS}
    assert reasons["nccl_2gpu"] == "needs 2 GPU(s); 1 GPU(s) visible"
    assert reasons["step_ops"] == "launch/bench/step_ops.py does not exist in this checkout"
    assert reasons["deepspeed_memory"].startswith("deepspeed is not installed")


def test_the_sections_fit_in_ten_minutes_and_the_nccl_tests_they_name_exist():
    assert sum(s.seconds for s in gpu_smoke.SECTIONS) <= 600
    named = [arg for s in gpu_smoke.SECTIONS for arg in gpu_smoke.command(s)[0] if "::" in arg]
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *named],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and f"{len(named)} tests collected" in done.stdout, done.stdout[-2000:]


@pytest.mark.parametrize("summary, returncode, skips_allowed, result", [
    ("2 passed in 3.1s", 0, False, "passed"),
    ("1 passed, 1 skipped in 3.1s", 0, True, "passed"),
    ("1 passed, 1 skipped in 3.1s", 0, False, "failed"),     # a GPU test skipped where the GPUs are
    ("2 skipped in 0.5s", 0, True, "failed"),                # nothing ran
    ("1 failed, 1 passed in 3.1s", 1, True, "failed"),
    ("no tests ran in 0.1s", 5, True, "failed")])
def test_pytest_verdict(summary, returncode, skips_allowed, result):
    output = f".s\n=== short test summary info ===\nSKIPPED [1] x.py:1: why\n{summary}\n"
    assert gpu_smoke.pytest_verdict(output, returncode, skips_allowed)[0] == result


def test_a_failed_or_hung_section_fails_the_run(monkeypatch, capsys):
    commands = {"test_cuda": [sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
                "fsdp_overlap": [sys.executable, "-c", "import time; time.sleep(60)"]}
    monkeypatch.setattr(gpu_smoke, "detect", lambda: Machine(1, None, deepspeed=True, step_ops=True))
    monkeypatch.setattr(gpu_smoke, "command", lambda section: (commands[section.name], {}))
    monkeypatch.setattr(gpu_smoke, "SECTIONS", [gpu_smoke.Section("test_cuda", 1, 30, "fails"),
                                                gpu_smoke.Section("fsdp_overlap", 0, 1, "hangs")])
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))   # main() prepends the checkout
    assert gpu_smoke.main([]) == 1
    out = capsys.readouterr().out
    assert "test_cuda         failed" in out and "exit 3: boom" in out
    assert "fsdp_overlap      failed" in out and "timed out after 1 s" in out
    assert "FAILED: test_cuda, fsdp_overlap" in out


def test_gpu_check_dry_run_skips_torch_optim_muon_where_torch_lacks_it(monkeypatch, capsys):
    import gpu_check
    monkeypatch.delattr(torch.optim, "Muon", raising=False)   # torch 2.6-2.8
    rows = gpu_check.step_rows(torch.device("cpu"), 1, gpu_check.DRY_RUN_MODELS)
    assert [r["optimizer"] for r in rows] == [name for name in gpu_check.OPTIMIZERS if name != "torch.optim.Muon"]
    assert "torch.optim.Muon              skipped: torch.optim.Muon is absent in torch" in capsys.readouterr().out
    assert all(r["median_ms"] > 0 and r["step_peak_mib"] is None for r in rows)


def test_a_failed_compile_is_an_error_not_an_eager_time(monkeypatch):
    """After a failed compile shardopt's compile=True runs eager silently (it warned once, earlier:
    tests/test_scale.py pins that fallback); the benchmark must not time that as compiled."""
    import polar_compile
    polar_module = sys.modules["shardopt.algorithms.polar"]
    monkeypatch.setattr(polar_module, "_compiled", {"failed": RuntimeError("no compiler here")})
    with pytest.raises(polar_compile.CompileFailed, match="2×16×16 torch.float32 .* RuntimeError: no compiler here"):
        polar_compile.measure([(2, 16, 16)], torch.device("cpu"), torch.float32, rounds=1)


def test_the_deepspeed_memory_section_runs_the_memory_script_whose_meshes_fit_the_world():
    argv, env = gpu_smoke.command(next(s for s in gpu_smoke.SECTIONS if s.name == "deepspeed_memory"))
    script = next(arg for arg in argv if arg.endswith(".py"))
    assert (ROOT / script).exists() and "--print-only" in argv and env == {"DS_ACCELERATOR": "cuda"}
    pytest.importorskip("deepspeed")
    import deepspeed_zero_memory as memory
    assert [memory.default_meshes(w) for w in (1, 2, 4, 8)] == [["1x1"], ["1x2"], ["2x2", "1x4"], ["4x2", "1x8"]]
    assert memory.parse_mesh("2X2", 4) == (2, 2)
    for bad, message in (("3x2", "R·S = 4"), ("2by2", "is not RxS")):
        with pytest.raises(SystemExit, match=message):
            memory.parse_mesh(bad, 4)
