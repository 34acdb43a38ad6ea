"""shardopt.torchft on real torchft, CPU / gloo (docs/design.md §13): replica groups are processes
(tests/torchft_replica.py) around an in-process torchft lighthouse; groups are SIGKILLed mid-round and
inside an exchange, restarted, healed. Every wait is bounded: the process groups' and the manager's
timeouts, and a wall-clock bound on every run."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torchft = pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parents[1]
WALL_S = 150


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_group(index, ranks, lighthouse, out, args):
    port, env = _port(), {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    return [subprocess.Popen([sys.executable, str(ROOT / "tests" / "torchft_replica.py"), "--replica-id", str(index),
                              "--lighthouse", lighthouse, "--out", str(out), *args],
                             env={**env, "RANK": str(r), "WORLD_SIZE": str(ranks), "MASTER_PORT": str(port)},
                             stdout=subprocess.DEVNULL, stderr=open(out.parent / f"group{index}_rank{r}.log", "ab"))
            for r in range(ranks)]   # (each group's log beside the records, for a failure's reason)


def run_groups(tmp_path, groups, ranks=1, common=(), per_group=None, restart=None, min_replicas=2):
    """Run `groups` replica groups to the end (wall-clock bound); the group `restart` is started again,
    without its per-group arguments, once it has died. Returns (records, restarts)."""
    from torchft.coordination import LighthouseServer
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=3000)
    out, restarts = tmp_path / "rounds.jsonl", 0
    out.touch()
    base = ["--min-replicas", str(min_replicas), "--groups", str(groups), *common]
    procs = {i: _start_group(i, ranks, lighthouse.address(), out, [*base, *(per_group or {}).get(i, ())])
             for i in range(groups)}
    start = time.monotonic()
    try:
        while any(p.poll() is None for group in procs.values() for p in group):
            assert time.monotonic() - start < WALL_S, "replica groups still running after the wall-clock bound"
            time.sleep(0.2)
            for i, group in procs.items():
                if i == restart and restarts == 0 and any(p.poll() == -9 for p in group):
                    for p in group:
                        p.kill()
                        p.wait()
                    procs[i], restarts = _start_group(i, ranks, lighthouse.address(), out, base), 1
    finally:
        for group in procs.values():
            for p in group:
                p.kill()
        lighthouse.shutdown()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return records, restarts, {i: [p.returncode for p in group] for i, group in procs.items()}


def assert_bitwise_equal_after_committed_rounds(records):
    by_round: dict = {}
    for r in records:
        if "hash" in r and r["committed"]:
            by_round.setdefault((r["step"], r["rank"]), set()).add(r["hash"])
    assert by_round, "no round committed"
    assert all(len(hashes) == 1 for hashes in by_round.values()), by_round


def done(records, replica):
    return [r for r in records if r.get("done") and r["replica"] == replica]


def kill_restart_heal(tmp_path, groups, common, kill_step, ranks=1, min_replicas=2):
    """Group 1 is SIGKILLed at `kill_step` and restarted: it heals once (every rank), everyone ends with exit
    code 0, and the replicas are bitwise equal after every committed round. Returns the records."""
    records, restarts, codes = run_groups(tmp_path, groups, ranks=ranks, common=common, min_replicas=min_replicas,
                                          per_group={1: ["--kill-at-step", str(kill_step)]}, restart=1)
    assert restarts == 1 and all(c == [0] * ranks for c in codes.values()), codes
    assert_bitwise_equal_after_committed_rounds(records)
    healed = done(records, 1)
    assert len(healed) == ranks and all(d["heals"] == 1 and d["heal_bytes_received"] > 0 for d in healed)
    return records


def test_local_steps_kill_mid_round_restart_heals_and_rejoins(tmp_path):
    common = ["--steps", "48", "--sync-every", "4", "--step-sleep", "0.12", "--timeout", "5"]
    records = kill_restart_heal(tmp_path, 3, common, kill_step=6)
    for survivor in (0, 2):   # survivors never restarted and finished every step
        assert done(records, survivor) and max(r["step"] for r in records if r.get("replica") == survivor and
                                               "step" in r) == 48
    final = {r["hash"] for r in records if "hash" in r and r["step"] == 48}
    assert len(final) == 1   # the healed group ends bitwise equal to the survivors
    rounds = [r for r in records if r.get("replica") == 0 and "M" in r]
    assert any(r["contributors"] < 3 for r in rounds) and rounds[-1]["M"] == 3   # 3 → fewer (dead or healing) → 3


@pytest.mark.parametrize("exchange", ["sign_vote", pytest.param("mean", marks=pytest.mark.slow),
                                      pytest.param("int8", marks=pytest.mark.slow),
                                      pytest.param("lowrank", marks=pytest.mark.slow)])
def test_kill_inside_exchange_and_injected_error_roll_back_everywhere(tmp_path, exchange):
    common = ["--steps", "24", "--sync-every", "4", "--timeout", "5", "--exchange", exchange]
    records, _, codes = run_groups(tmp_path, 3, common=common,
                                   per_group={2: ["--kill-in-round", "2"], 0: ["--error-in-round", "4"]})
    assert codes[2] == [-9] and codes[0] == [0] and codes[1] == [0]
    assert_bitwise_equal_after_committed_rounds(records)
    survivors = [r for r in records if "hash" in r and r["replica"] in (0, 1)]
    by_step: dict = {}
    for r in survivors:
        by_step.setdefault(r["step"], set()).add(r["committed"])
    assert all(len(v) == 1 for v in by_step.values()), by_step   # never half a round
    discarded = sorted(step for step, v in by_step.items() if v == {False})
    assert len(discarded) >= 2, by_step   # the round the kill broke, and the round with the injected error
    assert by_step[max(by_step)] == {True}


def test_fsdp_groups_of_two_ranks_kill_and_heal(tmp_path):
    common = ["--steps", "40", "--sync-every", "4", "--step-sleep", "0.15", "--timeout", "5", "--fsdp"]
    records = kill_restart_heal(tmp_path, 2, common, kill_step=5, ranks=2, min_replicas=1)
    final = {(r["rank"], r["hash"]) for r in records if "hash" in r and r["step"] == 40}
    assert len(final) == 2   # per shard rank, one hash across the two groups


@pytest.mark.parametrize("mode", ["signmuon", pytest.param("dion", marks=pytest.mark.slow)])
def test_per_step_kill_and_heal(tmp_path, mode):
    common = ["--mode", mode, "--steps", "40", "--step-sleep", "0.1", "--timeout", "5"]
    kill_restart_heal(tmp_path, 3, common, kill_step=5)


@pytest.mark.slow
def test_a_straggler_sits_out_a_round_and_heals_at_the_next(tmp_path):
    common = ["--steps", "32", "--sync-every", "4", "--step-sleep", "0.1", "--timeout", "5"]
    records, restarts, codes = run_groups(tmp_path, 3, common=common, per_group={2: ["--stall-at-step", "5"]})
    assert restarts == 0 and all(c == [0] for c in codes.values()), codes
    assert_bitwise_equal_after_committed_rounds(records)
    assert any(r["M"] == 2 and r["committed"] for r in records if r.get("replica") == 0 and "M" in r)
    assert done(records, 2)[0]["heals"] >= 1   # it fell behind by a round and healed from a live group
    assert len({r["hash"] for r in records if "hash" in r and r["step"] == 32}) == 1


# ---- bad input -----------------------------------------------------------------------------------
def test_a_manager_that_is_not_a_torchft_manager_is_refused():
    from shardopt.torchft.checks import check_manager
    with pytest.raises(ValueError, match="torchft.Manager"):
        check_manager(object())


def test_an_async_quorum_manager_is_refused():
    from torchft.manager import Manager

    from shardopt.torchft.checks import check_manager
    manager = object.__new__(Manager)
    manager._use_async_quorum = True
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        check_manager(manager)


def test_min_replicas_above_the_group_count_is_refused():
    import shardopt.torchft
    with pytest.raises(ValueError, match="--min-replicas ≤ 3"):
        shardopt.torchft.check_min_replicas(4, 3)


def test_an_inner_optimizer_with_the_manager_as_replicate_axis_is_refused():
    import torch
    from torchft.manager import Manager

    from shardopt.torchft.axis import ManagerAxis
    from shardopt.torchft.checks import check_no_replicate_axis
    manager = object.__new__(Manager)
    manager._use_async_quorum, manager._init_sync = False, True
    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    inner.replicate = ManagerAxis("replicate", manager)
    with pytest.raises(ValueError, match="without replicate_mesh"):
        check_no_replicate_axis(inner)


def test_the_torchft_privates_are_where_the_catalogue_says():
    from shardopt.torchft import internals
    internals.check()
