"""launch/demo.sh, the README's first command, leaves the checkout's committed files alone, so that the
README's second command (launch/test.sh) passes after it on any CPU: a short demo (2 steps, the demo's
2 × 2 mesh, 3 × 4 processes: 35–45 s on 2 busy cores), then the suite's check of the committed tables."""

import csv
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import test_results_table

ROOT = Path(__file__).resolve().parents[1]
DEMO_TIMEOUT_S = 300


def committed_tables() -> dict[str, str]:
    """The sha256 of the README, docs/ and results/: what the demo once rewrote."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*")), *sorted((ROOT / "results").rglob("*"))]
    return {p.relative_to(ROOT).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths if p.is_file()}


def test_a_short_demo_then_the_suite_s_check_of_the_committed_tables_passes(tmp_path):
    cache = Path(os.environ.get("SHARDOPT_CACHE") or ROOT / ".cache")
    if not (cache / "data" / "shakespeare" / "meta.json").exists():
        pytest.skip("the Shakespeare bytes are not prepared (python integrations/data.py; launch/test.sh does it)")
    before = committed_tables()
    out_dir = tmp_path / "demo"
    bin_dir = Path(sys.executable).parent   # this interpreter's python and torchrun, installing nothing
    env = {**os.environ, "STEPS": "2", "OUT_DIR": str(out_dir), "SHARDOPT_SKIP_INSTALL": "1", "SHARDOPT_CACHE": str(cache),
           "VIRTUAL_ENV": sys.prefix, "PATH": os.pathsep.join([str(bin_dir), os.environ["PATH"]]),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("UPDATE_RESULTS", None)
    done = subprocess.run(["bash", str(ROOT / "launch" / "demo.sh")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=DEMO_TIMEOUT_S)
    assert done.returncode == 0, f"demo.sh failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    with (out_dir / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["optimizer"], r["steps"], r["replicate"], r["shard"]) for r in rows] == \
        [(name, "2", "2", "2") for name in ("adamw", "dion", "signmuon")]
    assert f"{out_dir / 'summary.csv'}\n| optimizer |" in done.stdout        # the table, printed from the run's CSV
    assert committed_tables() == before, "demo.sh changed a committed file"
    (tmp_path / "check").mkdir()
    test_results_table.test_the_committed_readme_and_results_md_are_what_the_committed_csvs_give(tmp_path / "check")
