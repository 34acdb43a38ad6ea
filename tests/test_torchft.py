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
# a log handle or a child process the pytest process forgets fails the test (a leak outlives the test until exit)
pytestmark = [pytest.mark.filterwarnings("error::ResourceWarning"),
              pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")]

ROOT = Path(__file__).resolve().parents[1]
WALL_S = 150
MODEL_NUMEL = 16 * 32 + 32 + 32 * 8 + 8   # torchft_replica.model_and_params (block 64 in its LocalSteps)
TRAIN_WALL_S = 300   # train.py: 3 groups of the example GPT, 120 steps, a restart (110 s on 2 busy cores)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(command, log_path, env, cwd=None):
    """Start `command` with stdout and stderr appended to `log_path`. The child holds its own copy of the log's
    descriptor, so the pytest process closes its handle at once rather than holding one per process to exit."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _stop(procs):
    """Kill and reap every process of `procs` (a no-op for those that have exited)."""
    for proc in procs:
        proc.kill()
        proc.wait()


def _start_group(index, ranks, lighthouse, out, args):
    port, env = _port(), {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    return [_spawn([sys.executable, str(ROOT / "tests" / "torchft_replica.py"), "--replica-id", str(index),
                    "--lighthouse", lighthouse, "--out", str(out), *args],
                   out.parent / f"group{index}_rank{r}.log",   # beside the records, for a failure's reason
                   env={**env, "RANK": str(r), "WORLD_SIZE": str(ranks), "MASTER_PORT": str(port)})
            for r in range(ranks)]


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
                    _stop(group)
                    procs[i], restarts = _start_group(i, ranks, lighthouse.address(), out, base), 1
    finally:
        for group in procs.values():
            _stop(group)
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


@pytest.mark.parametrize("exchange", ["auto", pytest.param("sign_vote", marks=pytest.mark.slow),
                                      pytest.param("mean", marks=pytest.mark.slow),
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
    if exchange == "auto":   # the format follows the round's M: sign_vote's bytes at 3 groups, sign_mean's at 2
        import reference
        from shardopt.wire.comm import collective_bytes
        for M, runs_as in ((3, "sign_vote"), (2, "sign_mean")):
            begin_end = collective_bytes("all_reduce", 8, M) + collective_bytes("all_reduce", 4, M)   # §13's round
            sent = {r["bytes"] for r in records if r.get("M") == M and r["contributors"] == M}
            assert min(sent) == reference.outer_bytes(runs_as, MODEL_NUMEL, M, 64) + begin_end, (M, sent)


def test_fsdp_groups_of_two_ranks_kill_and_heal(tmp_path):
    common = ["--steps", "40", "--sync-every", "4", "--step-sleep", "0.15", "--timeout", "5", "--fsdp"]
    records = kill_restart_heal(tmp_path, 2, common, kill_step=5, ranks=2, min_replicas=1)
    final = {(r["rank"], r["hash"]) for r in records if "hash" in r and r["step"] == 40}
    assert len(final) == 2   # per shard rank, one hash across the two groups


@pytest.mark.parametrize("mode", ["signmuon", pytest.param("dion", marks=pytest.mark.slow)])
def test_per_step_kill_and_heal(tmp_path, mode):
    common = ["--mode", mode, "--steps", "40", "--step-sleep", "0.1", "--timeout", "5"]
    kill_restart_heal(tmp_path, 3, common, kill_step=5)


def test_a_group_alone_where_more_were_promised_stops_with_a_message_naming_the_fix(tmp_path):
    """One group of replica_groups=2 (the other never started, or has finished): join asks the quorum again until
    its timeout, then raises naming the fix, instead of training alone or waiting for ever."""
    records, _, codes = run_groups(tmp_path, 1, common=["--steps", "8", "--timeout", "5", "--join-timeout", "4"],
                                   per_group={0: ["--groups", "2"]}, min_replicas=1)
    log = (tmp_path / "group0_rank0.log").read_text()
    assert codes[0] == [1], (codes, log[-3000:])
    assert "only 1 of replica_groups=2 groups are in the quorum" in log and "have finished" in log, log[-3000:]
    assert not [r for r in records if "hash" in r]   # it trained nothing


@pytest.mark.slow
def test_a_straggler_sits_out_a_round_and_heals_at_the_next(tmp_path):
    common = ["--steps", "32", "--sync-every", "4", "--step-sleep", "0.1", "--timeout", "5"]
    records, restarts, codes = run_groups(tmp_path, 3, common=common, per_group={2: ["--stall-at-step", "5"]})
    assert restarts == 0 and all(c == [0] for c in codes.values()), codes
    assert_bitwise_equal_after_committed_rounds(records)
    assert any(r["M"] == 2 and r["committed"] for r in records if r.get("replica") == 0 and "M" in r)
    assert done(records, 2)[0]["heals"] >= 1   # it fell behind by a round and healed from a live group
    assert len({r["hash"] for r in records if "hash" in r and r["step"] == 32}) == 1


@pytest.mark.parametrize("steps, due", [(10, [0]), (8, [])])
def test_sync_now_ends_a_run_off_the_schedule_with_one_round_and_bitwise_equal_replicas(tmp_path, steps, due):
    """LocalSteps.sync_now over torchft (finish.py): due by the step count, one more round where the run stopped
    between two syncs (10 steps, H 4), none at a sync step (8); a second call at the same step syncs nothing."""
    records, _, codes = run_groups(tmp_path, 3, common=["--steps", str(steps), "--sync-every", "4", "--sync-now"])
    assert all(c == [0] for c in codes.values()), codes
    final = [r for r in records if r.get("final")]
    assert len(final) == 3 and all(r["due"] == due and r["again"] == [] for r in final), final
    assert len({r["hash"] for r in final}) == 1 and all(r["committed"] for r in final)
    assert all(r["rounds"] == len(due) for r in final)   # sync_now's rounds: one where due, none at a sync step


def test_a_group_restarted_into_the_others_sync_now_settles_with_them_and_ends_with_their_model(tmp_path):
    """min_replicas 3: the survivors' sync_now round (after 10 steps, H 4) waits for group 1, killed after 9 steps
    and restarted; it heals in that round, settles as they do (join.py), and its own sync_now finds nothing due."""
    common = ["--steps", "10", "--sync-every", "4", "--sync-now"]
    records, restarts, codes = run_groups(tmp_path, 3, common=common, min_replicas=3,
                                          per_group={1: ["--kill-at-step", "9"]}, restart=1)
    assert restarts == 1 and all(c == [0] for c in codes.values()), codes
    final = {r["replica"]: r for r in records if r.get("final")}
    assert [final[i]["due"] for i in range(3)] == [[0], [], [0]] and all(r["again"] == [] for r in final.values())
    assert len({r["hash"] for r in final.values()}) == 1, final
    assert done(records, 1)[0]["heals"] == 1


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


def test_a_healed_replica_takes_its_peers_double_averaging_schedule():
    """heal_counters (wire/rounds.HealCounters) of both optimizers: what a peer saves, a healed replica loads, so
    both run the double-averaging check at the same step and issue the same collectives (heal.py)."""
    import torch

    import shardopt
    from shardopt.wire.rounds import HealCounters

    def dion():
        param = torch.nn.Parameter(torch.ones(4, 4))
        return param, shardopt.Dion([param], lr=0.01)
    (param, peer), (_, healed) = dion(), dion()
    for _ in range(3):
        param.grad = torch.ones(4, 4)
        peer.step()
    healed.heal_counters.load_counters(peer.heal_counters.save_counters())
    assert isinstance(healed.heal_counters, HealCounters) and peer.steps_called == healed.steps_called == 3

    def local_steps(check):
        inner = torch.optim.SGD([torch.nn.Parameter(torch.ones(4))], lr=0.1)
        return shardopt.LocalSteps(inner, replicate_mesh=None, sync_every=2, double_averaging_check=check)
    peer, healed = local_steps(False), local_steps(True)   # the peer's check is done, the joiner's not yet
    healed.heal_counters.load_counters(peer.heal_counters.save_counters())
    assert isinstance(healed.heal_counters, HealCounters) and healed.checks.double_averaging_checked


def test_an_optimizer_without_heal_counters_cannot_heal():
    from torchft.manager import Manager

    from shardopt.torchft.heal import Healing
    with pytest.raises(TypeError, match="heal_counters"):
        Healing(object.__new__(Manager), object(), per_step=True)


def test_a_heal_payload_of_another_shardopt_version_is_refused_before_anything_changes():
    import torch
    from torchft.manager import Manager

    import shardopt
    from shardopt.torchft.heal import Healing

    def healing():
        manager = object.__new__(Manager)
        manager._load_state_dict_fns, manager._user_state_dicts = {}, {}
        param = torch.nn.Parameter(torch.ones(4, 4))
        optimizer = shardopt.Dion([param], lr=0.01)
        param.grad = torch.ones(4, 4)
        optimizer.step()
        return param, Healing(manager, optimizer, per_step=True)
    (peer_param, peer), (param, joiner) = healing(), healing()
    payload = peer.save()
    with torch.no_grad():
        param.add_(1.0)
    before = param.detach().clone()
    for stale in ({key: value for key, value in payload.items() if key != "format"}, {**payload, "format": 0}):
        with pytest.raises(ValueError, match="same shardopt version"):
            joiner.load(stale)
        assert torch.equal(param, before) and joiner.heals == 0
    joiner.load(payload)   # the same version heals: the peer's params
    assert joiner.heals == 1 and torch.equal(param, peer_param)


def test_the_torchft_privates_are_where_the_catalogue_says():
    from shardopt.torchft import internals
    internals.check()


# ---- integrations/fsdp/train.py --fault-tolerant, per-step ---------------------------------------
PER_STEP = ("--optimizer", "signmuon", "--nonmatrix-algorithm", "lion")


def _train_group(index, lighthouse, tmp_path, steps, method=PER_STEP, groups=3):
    """One replica group of train.py (one rank), `method`'s options (per-step Sign-Muon + Lion) on the byte corpus
    of _byte_corpus in tmp_path."""
    out = tmp_path / f"group{index}"
    out.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port())}
    command = [sys.executable, str(ROOT / "integrations" / "fsdp" / "train.py"), "--fault-tolerant", "--replica-id",
               str(index), "--lighthouse", lighthouse, "--min-replicas", "2", "--replica-groups", str(groups),
               *method, "--data-dir", str(tmp_path),
               "--steps", str(steps), "--warmup", "10", "--log-every", "1", "--eval-every", str(steps),
               "--eval-batches", "1", "--timeout", "5", "--quorum-timeout", "60", "--out-dir", str(out)]
    return _spawn(command, out / "log.txt", env=env, cwd=ROOT)


def _byte_corpus(tmp_path):
    text = b"".join(b"%d: To be, or not to be, that is the question.\n" % i for i in range(2000))
    (tmp_path / "train.bin").write_bytes(text)
    (tmp_path / "val.bin").write_bytes(text[:20000])
    (tmp_path / "meta.json").write_text('{"vocab_size": 256, "dtype": "uint8"}')


def _lrs(path):
    import csv
    with open(path) as f:
        return {int(row["step"]): row["lr"] for row in csv.DictReader(f) if row["lr"]}


@pytest.mark.slow   # ~2 min: three train.py groups, one killed and restarted (CI runs the slow marker)
def test_train_py_per_step_kill_restart_heals_and_finishes_the_same_steps(tmp_path):
    """Per-step Sign-Muon + Lion through train.py --fault-tolerant, 3 groups: group 1 is SIGKILLed at step 5 and
    restarted; the steps whose round broke run again (the lr schedule not advanced), the restarted group heals and
    every group ends at --steps with the same lr at every step it logged."""
    from torchft.coordination import LighthouseServer
    _byte_corpus(tmp_path)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=3000)
    steps, start = 120, time.monotonic()
    procs = {i: _train_group(i, lighthouse.address(), tmp_path, steps) for i in range(3)}
    try:
        log = tmp_path / "group1" / "log.txt"
        while f"step 5/{steps}" not in log.read_text(errors="replace"):
            assert procs[1].poll() is None and time.monotonic() - start < TRAIN_WALL_S, log.read_text()[-3000:]
            time.sleep(0.1)
        _stop([procs[1]])
        procs[1] = _train_group(1, lighthouse.address(), tmp_path, steps)
        for i, proc in procs.items():
            proc.wait(timeout=max(1.0, TRAIN_WALL_S - (time.monotonic() - start)))
    finally:
        _stop(procs.values())
        lighthouse.shutdown()
    logs = {i: (tmp_path / f"group{i}" / "log.txt").read_text(errors="replace")[-3000:] for i in procs}
    assert all(proc.returncode == 0 for proc in procs.values()), logs
    summaries = {i: json.loads((tmp_path / f"group{i}" / "summary.json").read_text()) for i in procs}
    assert all(s["steps"] == steps for s in summaries.values()), logs
    assert summaries[1]["torchft"]["heals"] == 1 and summaries[1]["torchft"]["heal_bytes_received"] > 0
    assert summaries[0]["torchft"]["rounds_discarded"] >= 1 and summaries[0]["torchft"]["steps_repeated"] >= 1
    lrs = {i: _lrs(tmp_path / f"group{i}" / "metrics.csv") for i in procs}
    assert max(lrs[0]) == steps and lrs[0] == lrs[2]
    assert all(lrs[1][step] == lrs[0][step] for step in lrs[1]), (lrs[0], lrs[1])   # one schedule


@pytest.mark.slow   # ~1 min: two train.py groups of local steps
def test_train_py_local_steps_stopping_off_the_schedule_end_with_one_more_committed_round(tmp_path):
    """train.py --fault-tolerant --local-steps 4 --steps 10 stops two steps after its last sync and ends with
    LocalSteps.sync_now's round (finish.py), committed on both groups, before the final evaluation."""
    from torchft.coordination import LighthouseServer
    _byte_corpus(tmp_path)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=3000)
    method = ("--optimizer", "muon", "--local-steps", "4", "--outer-exchange", "sign_mean")
    procs = {i: _train_group(i, lighthouse.address(), tmp_path, 10, method, groups=2) for i in range(2)}
    try:
        for proc in procs.values():
            proc.wait(timeout=TRAIN_WALL_S)
    finally:
        _stop(procs.values())
        lighthouse.shutdown()
    logs = {i: (tmp_path / f"group{i}" / "log.txt").read_text(errors="replace")[-3000:] for i in procs}
    assert all(proc.returncode == 0 for proc in procs.values()), logs
    rounds = {i: json.loads((tmp_path / f"group{i}" / "summary.json").read_text())["torchft"]["rounds"] for i in procs}
    syncs = {i: [r for r in group if not r["join"]] for i, group in rounds.items()}
    assert all(len(s) == 3 and all(r["committed"] and r["replicas"] == 2 for r in s) for s in syncs.values()), rounds
