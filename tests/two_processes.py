"""Run a script under torchrun with 2 CPU processes (gloo), as a user launches a framework's trainer."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script, cwd, timeout=300, integrations=True, **env) -> str:
    """Run `script` with `python -m torch.distributed.run --standalone --nproc_per_node 2` in `cwd`, this
    checkout and (`integrations`) integrations/ (the example model) on PYTHONPATH, `env` added; assert it
    exits 0 and return its stdout."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    path = os.pathsep.join([str(ROOT)] + [str(ROOT / "integrations")] * integrations + [os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **env})
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-8000:]}"
    return done.stdout


def run_docs_block(heading: str, cwd, **env) -> str:
    """docs/trainers.md's python block under `heading`, written to cwd/train.py, under `torchrun`, with what
    `pip install shardopt` gives a user on the path (this checkout's shardopt, not integrations/)."""
    from docblocks import python_block
    script = Path(cwd) / "train.py"
    script.write_text(python_block("docs/trainers.md", heading))
    return torchrun(script, cwd, integrations=False, **env)


def run_scenarios(name: str, directory) -> list[dict]:
    """tests/<name>.py under `torchrun`, writing result-<rank>.json to $SHARDOPT_TEST_OUT=directory:
    the two ranks' results."""
    import json
    torchrun(ROOT / "tests" / f"{name}.py", directory, SHARDOPT_TEST_OUT=str(directory))
    return [json.loads((Path(directory) / f"result-{rank}.json").read_text()) for rank in range(2)]


def finish(path, result: dict) -> None:
    """The end of a scenario script on each rank: `result` written to `path` as JSON, the ranks met at a
    barrier, the groups destroyed, and the process ended without interpreter teardown (os._exit).
    Why the last: gloo's worker threads keep their last work item, with its tensors, alive; a group a
    framework object still holds outlives destroy_process_group, and freeing those tensors during
    interpreter finalization can abort the process with SIGABRT ("terminate called without an active
    exception") after its work is done and written (pytorch/pytorch#179291; seen once in CI, at exit of
    tests/lightning_scenarios.py, after both result files were complete)."""
    import json
    import torch.distributed as dist
    Path(path).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_exchange(run: dict, steps: int, saved_after: int) -> None:
    """A scenario's 2-replica run with Sign-Muon + Lion-vote: `steps` steps, each sending ≤ 1/25 of an fp32
    all-reduce of all params on the replicate axis (comm_stats; the step after the first save also carries
    that save's momentum average, 4 bytes per momentum entry), the replicas' momenta different after
    every step (decoupled) and equal at both saves (averaged first)."""
    per_step = run["bytes_per_step"]
    ordinary = [b for step, b in enumerate(per_step, 1) if step != saved_after + 1]
    assert len(per_step) == steps and 0 < max(ordinary) <= run["fp32_all_reduce_bytes"] / 25, run
    assert not any(run["momenta_equal_between_saves"]), run
    assert run["momenta_equal_at_saves"] == [True, True], run


def check_docs_bytes(scenarios: str, results: list[dict]) -> None:
    """The rows of results/trainers.csv that docs/trainers.md's byte tables are drawn from are what this run of
    tests/<scenarios>.py measured on each rank (launch/bench/trainer_bytes.py writes them from the same run)."""
    import csv
    sys.path.insert(0, str(ROOT / "launch" / "bench"))
    import trainer_bytes
    framework, layouts = next((f, layouts) for f, name, layouts in trainer_bytes.SCENARIOS if name == scenarios)
    with trainer_bytes.CSV.open(newline="") as f:
        committed = [row for row in csv.DictReader(f) if row["framework"] == framework]
    for result in results:
        measured = [trainer_bytes.figures(framework, layout, result[key]) for key, layout in layouts.items()]
        assert measured == committed, (f"results/trainers.csv (docs/trainers.md's bytes) is not what this run sent: "
                                       f"{measured} vs {committed}; run python launch/bench/trainer_bytes.py, then "
                                       f"python launch/results_table.py --readme README.md, and commit what they write")


def import_without(module: str, framework: str) -> subprocess.CompletedProcess:
    """`import shardopt` then `import <module>` in a fresh interpreter where `framework` cannot be imported."""
    code = f"import sys; sys.modules[{framework!r}] = None; import shardopt; import {module}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
