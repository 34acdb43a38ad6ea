"""A benchmark campaign: a grid of runs whose rows update a committed CSV. What every driver
(convergence.py, slowlink.py, fashion_mnist.py, nonmatrix_quality.py) does around its runs:

- resume: a run whose folder holds a finished run of the same arguments made by the same code
  (`code_version`) is read back, not run again (`run_local`, `run_two_nodes` with reuse), so an
  interrupted campaign continues where it stopped;
- merge: each row replaces the CSV's row of the same key and the others stay (`Campaign.add`,
  `merged`), so a grid can be widened later; the CSV is rewritten after every run, so a partial
  campaign leaves a usable file;
- retarget: `Campaign(arrange=...)` recomputes what depends on the whole table (slowlink.py's time to
  a target that a new baseline run moved) every time the CSV is written;
- failures: a run that fails is named and the campaign goes on (`Campaign.attempt`); `Campaign.finish`
  then stops with the list.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from integrations.results import read_csv, write_csv

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "launch" / "bench"
TWONODE = ROOT / "launch" / "netns" / "twonode.sh"
MULTINODE = ROOT / "launch" / "torchrun_multinode.sh"


class Campaign:
    """The rows of one CSV (`fields` its columns, `key` the columns that name a run): `kept` from the
    file as it was, `rows` of this campaign; `arrange` orders or recomputes the merged rows before
    each write."""

    def __init__(self, path: Path, fields: list[str], key: tuple[str, ...],
                 arrange: Callable[[list[dict]], list[dict]] = list):
        self.path, self.fields, self.key, self.arrange = Path(path), fields, key, arrange
        self.kept = read_csv(self.path) if self.path.exists() else []
        self.rows: list[dict] = []
        self.failed: list[str] = []

    def everything(self) -> list[dict]:
        """The kept rows, those of this campaign's keys replaced by its rows."""
        return merged(self.kept, self.rows, self.key)

    def add(self, *rows: dict, show: bool = True) -> None:
        """This campaign's rows (printed, with `show`), then the CSV rewritten with them."""
        self.rows.extend(rows)
        for row in rows if show else ():
            print(", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        write_csv(self.path, self.fields, self.arrange(self.everything()))

    def attempt(self, label: str, run: Callable[[], object]) -> bool:
        """run(); a RuntimeError (a failed run) is noted under `label` and printed, not raised: one failed
        run does not end a campaign. Returns whether it succeeded."""
        try:
            run()
        except RuntimeError as error:
            self.failed.append(f"{label}: {str(error)[:200]}")
            print(f"FAILED {self.failed[-1]}", flush=True)
            return False
        return True

    def finish(self, logs: str) -> None:
        """Stop with the failed runs' labels, if any (their logs under `logs`)."""
        if self.failed:
            raise SystemExit(f"these runs failed (their rows are missing; logs under {logs}):\n"
                             + "\n".join(self.failed))


# ---- resume: running, or reading back a finished run -----------------------------------------
def run_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def code_version() -> str:
    """SHA-256 of the code a run executes: shardopt/, integrations/, launch/bench/train_ddp.py, peers.py
    and counting.py, the launchers (file names and contents, in path order). A run folder records it, so a
    run made by other code is not read back as if it were this code's."""
    files = sorted([*(ROOT / "shardopt").rglob("*.py"), *(ROOT / "integrations").rglob("*.py"), BENCH / "train_ddp.py",
                    BENCH / "peers.py", BENCH / "counting.py", TWONODE, MULTINODE])
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def finished(out_dir: Path, argv: list[str]) -> bool:
    """Whether out_dir holds a run that ended (done marker) of these arguments (command.txt) made by
    this code (code.txt = code_version())."""
    out_dir = Path(out_dir)
    recorded, code = out_dir / "command.txt", out_dir / "code.txt"
    return (out_dir / "done").exists() and recorded.exists() and recorded.read_text() == " ".join(argv) \
        and code.exists() and code.read_text() == code_version()


def _reusable_run(argv: list[str], log: Path, reuse: bool, start) -> bool:
    """start() unless reuse and log's folder holds a finished run of argv (returns whether it ran); a run
    that ends is marked with its arguments, code version and a done marker."""
    out_dir = log.parent
    if reuse and finished(out_dir, argv):
        return False
    (out_dir / "done").unlink(missing_ok=True)
    start()
    (out_dir / "command.txt").write_text(" ".join(argv))
    (out_dir / "code.txt").write_text(code_version())
    (out_dir / "done").touch()
    return True


def run_local(argv: list[str], nproc: int, log: Path, timeout_s: float, reuse: bool = False) -> bool:
    """torchrun --standalone on this machine (no link limit). With reuse, a finished run of the same
    arguments and code in the log's folder is kept instead (returns False: not run again)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *argv]
    return _reusable_run(["--nproc_per_node", str(nproc), *argv], log, reuse, lambda: _run([command], log, timeout_s))


def run_two_nodes(argv: list[str], procs_per_node: int, prefix: str, port: int, log: Path, timeout_s: float,
                  reuse: bool = False) -> bool:
    """One torchrun per emulated node (launch/torchrun_multinode.sh inside `twonode.sh node N`); the link
    rate is the caller's (its folder name). With reuse, as run_local."""
    env = {"MASTER_ADDR": f"{prefix}1", "MASTER_PORT": str(port), "NNODES": "2", "NPROC_PER_NODE": str(procs_per_node),
           "PYTHON": sys.executable, "RDZV_ID": f"bench{port}", "RDZV_TIMEOUT": "120"}
    commands = [[str(TWONODE), "node", str(n), "env", *(f"{k}={v}" for k, v in env.items()),
                 f"NODE_RANK={n - 1}", "bash", str(MULTINODE), *argv] for n in (1, 2)]
    return _reusable_run(["--nnodes", "2", "--nproc_per_node", str(procs_per_node), *argv], log, reuse,
                         lambda: _run(commands, log, timeout_s, {"NETNS_PREFIX": prefix}))


def _run(commands: list[list[str]], log: Path, timeout_s: float, extra_env: dict | None = None) -> None:
    """Start every command, wait for all; on a failure or the timeout kill the others and raise with the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        processes = [subprocess.Popen(["nice", "-n", "5", *c], stdout=out, stderr=subprocess.STDOUT,
                                      env={**run_env(), **(extra_env or {})}, cwd=ROOT, start_new_session=True)
                     for c in commands]
        try:
            with _terminate_raises():
                codes = [p.wait(timeout=timeout_s) for p in processes]
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for p in processes:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
    if codes is None or any(codes):
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"run failed ({'timeout ' + str(timeout_s) + ' s' if codes is None else codes}); "
                           f"log {log}:\n{tail}")


@contextmanager
def _terminate_raises():
    """While _run waits, SIGTERM (what `kill` and `pkill` send) raises SystemExit(128 + 15) as Ctrl-C raises
    KeyboardInterrupt, so _run's cleanup kills its runs' process groups: they are sessions of their own, which
    a signal to the campaign does not reach, and would go on training. Outside the main thread (where Python
    cannot set a handler) the signal keeps its own action."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---- merge: the CSV of a campaign ---------------------------------------------------------
def merged(kept: list[dict], new: list[dict], key_fields: tuple[str, ...]) -> list[dict]:
    """kept's rows with new's rows replacing those of the same key (the values of key_fields, as strings);
    new keys appended in new's order. How a campaign updates a committed CSV instead of replacing it."""
    def key(row: dict) -> tuple:
        return tuple(str(row[f]) for f in key_fields)
    replaced = {key(r) for r in new}
    return [r for r in kept if key(r) not in replaced] + new


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in rows[0]}
    print("  ".join(k.rjust(w) for k, w in widths.items()))
    for row in rows:
        print("  ".join(str(row[k]).rjust(w) for k, w in widths.items()))
