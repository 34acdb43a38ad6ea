"""The GPU smoke check (run through launch/gpu_smoke.sh): what can only go wrong on CUDA/NCCL, in ≤ 10 minutes.

    bash launch/gpu_smoke.sh                 # what this machine has runs; every other section says why it skipped
    bash launch/gpu_smoke.sh --cpu           # dry run on the CPU: CUDA hidden, the CPU parts run, exit 0
    bash launch/gpu_smoke.sh --only test_cuda fsdp_overlap
    bash launch/gpu_smoke.sh --list          # the sections and what each needs

Sections (SECTIONS below; each with a time bound, together 10 minutes):
  test_cuda          1 GPU    tests/test_cuda.py: bf16 Newton–Schulz, Dion and Sign-Muon against the float64
                              reference on the device, compiled Newton–Schulz equal to eager
  step_ops           1 GPU    launch/bench/step_ops.py --device cuda (aten ops and host syncs of one step
                              through torch's fake process group), where that file exists
  fsdp_overlap       -        integrations/fsdp/train.py with --overlap-backward off and on, bitwise equal
                              (tests/test_train_fsdp.py): gloo on the CPU; with a GPU also NCCL under
                              TORCH_CUDA_SANITIZER=1
  deepspeed_memory   1 GPU    launch/bench/deepspeed_zero_memory.py --print-only: bytes per parameter of the
                              DeepSpeed plugin (Sign-Muon, bf16, ZeRO 2) and of DeepSpeed's own ZeRO 2 on the
                              GPU, by the tensor walk and by torch.cuda.max_memory_allocated
  nccl_2gpu          2 GPUs   the NCCL multi-rank tests of tests/test_train_fsdp.py (SHARDOPT_TEST_NCCL=1):
                              overlap off/on bitwise under the sanitizer on 2 replicas (Dion) and on 2 FSDP2
                              shards (Sign-Muon); Dion on 2 replicas learns and counts gloo's bytes
A section whose needs are not met prints "skipped: <reason>". At the end a table (section, result,
seconds, detail); the exit status is 1 when a section that ran failed, else 0 (skips are not failures).
A pytest section on a machine that has its GPUs fails if any of its tests skipped: there a skip means
the GPU path did not run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_OPS = ROOT / "launch" / "bench" / "step_ops.py"
FSDP_TESTS = "tests/test_train_fsdp.py::test_overlap_backward_on_and_off_are_bitwise_equal"


@dataclass(frozen=True)
class Machine:
    """What the sections need, as detected: visible CUDA devices, why there are none, what is installed."""
    gpus: int
    no_gpu_reason: str | None
    deepspeed: bool
    step_ops: bool


@dataclass(frozen=True)
class Section:
    name: str
    gpus: int          # GPUs it needs (0: runs on the CPU too)
    seconds: int       # its time bound
    what: str


SECTIONS = [
    Section("test_cuda", 1, 120, "tests/test_cuda.py on the device (its compiled Newton–Schulz compiles)"),
    Section("step_ops", 1, 60, "launch/bench/step_ops.py --device cuda (fake process group: aten ops, host syncs)"),
    Section("fsdp_overlap", 0, 120, "FSDP2 train.py --overlap-backward off/on bitwise (CUDA: TORCH_CUDA_SANITIZER=1)"),
    Section("deepspeed_memory", 1, 90, "DeepSpeed plugin, bf16: memory per parameter"),
    Section("nccl_2gpu", 2, 210, "NCCL multi-rank tests (tests/test_train_fsdp.py, SHARDOPT_TEST_NCCL=1)"),
]


def detect() -> Machine:
    """This machine, as torch sees it (CUDA_VISIBLE_DEVICES included). Creates no CUDA context."""
    import torch
    if torch.cuda.is_available():
        gpus, reason = torch.cuda.device_count(), None
    elif torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        gpus, reason = 0, f"no CUDA: torch {torch.__version__} is a CPU build (torch.version.cuda is None)"
    else:
        gpus, reason = 0, (f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, "
                           f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r})")
    return Machine(gpus, reason, importlib.util.find_spec("deepspeed") is not None, STEP_OPS.exists())


def skip_reason(section: Section, machine: Machine) -> str | None:
    """Why `section` cannot run on `machine` (every need it lacks), or None when it can."""
    reasons = []
    if section.gpus > machine.gpus:
        reasons.append(f"needs {section.gpus} GPU(s); {machine.no_gpu_reason or f'{machine.gpus} GPU(s) visible'}")
    if section.name == "step_ops" and not machine.step_ops:
        reasons.append(f"{STEP_OPS.relative_to(ROOT)} does not exist in this checkout")
    if section.name == "deepspeed_memory" and not machine.deepspeed:
        reasons.append("deepspeed is not installed (pip install -e '.[deepspeed]')")
    return "; ".join(reasons) or None


def command(section: Section) -> tuple[list[str], dict]:
    """The command line of `section` and the environment it adds."""
    python = sys.executable
    pytest = [python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    if section.name == "test_cuda":
        return pytest + ["tests/test_cuda.py"], {}
    if section.name == "step_ops":
        return [python, str(STEP_OPS.relative_to(ROOT)), "--device", "cuda"], {}
    if section.name == "fsdp_overlap":
        return pytest + [f"{FSDP_TESTS}[gloo_1rank]", f"{FSDP_TESTS}[nccl_1rank]"], {"SHARDOPT_TEST_NCCL": "1"}
    if section.name == "deepspeed_memory":   # (env.sh sets DS_ACCELERATOR=cpu for the CPU tests)
        return torchrun + ["launch/bench/deepspeed_zero_memory.py", "--print-only"], {"DS_ACCELERATOR": "cuda"}
    if section.name == "nccl_2gpu":
        return pytest + [f"{FSDP_TESTS}[nccl_2ranks_dion_2x1]", f"{FSDP_TESTS}[nccl_2ranks_signmuon_1x2]",
                         "tests/test_train_fsdp.py::test_nccl_2ranks_dion_between_replicas_learns_and_counts_the_bytes_gloo_counts"
                         ], {"SHARDOPT_TEST_NCCL": "1"}
    raise ValueError(f"unknown section {section.name!r}; known: {', '.join(s.name for s in SECTIONS)}")


def pytest_verdict(output: str, returncode: int, skips_allowed: bool) -> tuple[str, str]:
    """(result, detail) of a pytest run from its exit status and its last summary line ("2 passed, 1 skipped
    in 3.1s"): failed on a non-zero status, on no test passed, or on a skip where none is allowed."""
    lines = [line for line in output.splitlines() if re.search(r"\b(passed|failed|skipped|error|no tests ran)\b", line)
             and re.search(r" in [\d.]+s", line)]
    summary = lines[-1].strip(" =") if lines else "(no pytest summary line)"
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    if returncode != 0:
        return "failed", f"pytest exit {returncode}: {summary}"
    if not counts.get("passed"):
        return "failed", f"no test passed: {summary}"
    if counts.get("skipped") and not skips_allowed:
        return "failed", f"skipped on a machine that has the GPUs (the GPU path did not run): {summary}"
    return "passed", summary


def run_section(section: Section, machine: Machine) -> tuple[str, str]:
    """Run `section` (its output streamed here), within its time bound; (result, detail)."""
    argv, extra = command(section)
    print("$ " + " ".join([f"{key}={value}" for key, value in extra.items()] + argv), flush=True)
    process = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **extra}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []

    def stream():
        for line in process.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    try:
        process.wait(timeout=section.seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)   # its own session: the section's processes (torchrun's workers) only
        process.wait()
        reader.join(timeout=5)
        return "failed", f"timed out after {section.seconds} s"
    reader.join(timeout=5)
    if argv[1:3] == ["-m", "pytest"]:
        return pytest_verdict("".join(lines), process.returncode, skips_allowed=machine.gpus < max(1, section.gpus))
    last = next((line.strip() for line in reversed(lines) if line.strip()), "(no output)")[:100]
    return ("passed", last) if process.returncode == 0 else ("failed", f"exit {process.returncode}: {last}")


def table(results: list[tuple[str, str, float, str]]) -> str:
    rows = [f"{'section':<18}{'result':<9}{'seconds':>8}  detail"]
    rows += [f"{name:<18}{result:<9}{seconds:>8.1f}  {detail}" for name, result, seconds, detail in results]
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [s.name for s in SECTIONS]
    parser.add_argument("--cpu", action="store_true",
                        help='dry run on the CPU: hide every GPU (CUDA_VISIBLE_DEVICES=""), so the GPU sections skip')
    parser.add_argument("--only", nargs="+", choices=names, metavar="SECTION", help=f"run these only: {', '.join(names)}")
    parser.add_argument("--list", action="store_true", help="list the sections and exit")
    args = parser.parse_args(argv)
    if args.list:
        for s in SECTIONS:
            print(f"{s.name:<18}needs {s.gpus} GPU(s), ≤ {s.seconds} s: {s.what}")
        return 0
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""   # before torch is imported; the sections inherit it
    # the sections import this checkout's shardopt (it need not be installed), as launch/gpu_smoke.sh sets it
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    machine = detect()
    import torch
    print(f"gpu_smoke: torch {torch.__version__} (CUDA {torch.version.cuda}), {machine.gpus} GPU(s)"
          f"{' [--cpu: GPUs hidden]' if args.cpu else ''}, deepspeed {'installed' if machine.deepspeed else 'absent'}",
          flush=True)
    if machine.gpus and shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"],
                       check=False)
    results = []
    for section in SECTIONS:
        if args.only and section.name not in args.only:
            continue
        print(f"\n== {section.name}: {section.what}", flush=True)
        reason = skip_reason(section, machine)
        if reason:
            print(f"skipped: {reason}", flush=True)
            results.append((section.name, "skipped", 0.0, reason))
            continue
        start = time.monotonic()
        result, detail = run_section(section, machine)
        results.append((section.name, result, time.monotonic() - start, detail))
        print(f"{section.name}: {result} ({detail})", flush=True)
    print("\n" + table(results), flush=True)
    failed = [name for name, result, _, _ in results if result == "failed"]
    print(f"gpu_smoke: {'FAILED: ' + ', '.join(failed) if failed else 'no section that ran failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
