"""The benchmark harness's pure pieces (launch/bench/): byte counting of torch's DDP hooks on 2 gloo
processes, time-to-target, CSV schemas, rate parsing, best-lr choice, the matrix-shaped conv, a campaign
ended by SIGTERM."""

import inspect
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch" / "bench"))
from workers import WorkerPool  # noqa: E402

import campaign  # noqa: E402
import convergence  # noqa: E402
import localsteps  # noqa: E402
import runs  # noqa: E402
import shardopt  # noqa: E402
import slowlink  # noqa: E402
import step_split  # noqa: E402
from shardopt.wire.comm import collective_bytes  # noqa: E402

M, N = 48, 32    # the test model: Linear(N → M) with bias: a 48×32 matrix and a 48-vector


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(2)
    yield workers
    workers.close()


def _counted_bytes_per_step(hook_name: str, local_world_size: int, steps: int, rank: int = 0):
    """Train a DDP Linear for `steps` steps with torch's hook; bytes counted in the last step."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel
    from counting import CountingAllReduce

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(N, M))
    if hook_name == "allreduce":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        model.register_comm_hook(powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                                             min_compression_rate=1), powerSGD_hook.powerSGD_hook)
    counter = CountingAllReduce(local_world_size).install()
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        counter.reset()
        model(torch.randn(4, N, generator=generator)).square().sum().backward()
        model.zero_grad()
    return counter.between_nodes, counter.within_node, counter.calls


def test_counting_allreduce_hook_bytes_equal_ring_formula_between_nodes(pool):
    between, within, calls = pool.run(_counted_bytes_per_step, "allreduce", 1, 2)[0]
    assert (between, within) == (collective_bytes("all_reduce", 4 * (M * N + M), 2), 0)
    assert calls == 1                                   # one bucket


def test_counting_puts_a_group_inside_one_node_under_within_node(pool):
    between, within, _ = pool.run(_counted_bytes_per_step, "allreduce", 2, 2)[0]
    assert (between, within) == (0, collective_bytes("all_reduce", 4 * (M * N + M), 2))


@pytest.mark.parametrize("rank", [1, 4])
def test_counting_powersgd_bytes_equal_low_rank_formula(pool, rank):
    """After its plain start, PowerSGD all-reduces P (m×r), Q (n×r) and the uncompressed bias."""
    between, _, calls = pool.run(_counted_bytes_per_step, "powersgd", 1, 3, rank)[0]
    expected = sum(collective_bytes("all_reduce", 4 * count, 2) for count in (M, M * rank, N * rank))
    assert (between, calls) == (expected, 3)


def _averaged_bytes(period: int, steps: int):
    """Bytes counted per call of torch's PeriodicModelAverager.average_parameters (local SGD's exchange)."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from counting import CountingAllReduce

    model = torch.nn.Linear(N, M)
    model(torch.ones(1, N)).sum().backward()   # the averager skips parameters without a gradient
    counter = CountingAllReduce(1).install()
    averager = PeriodicModelAverager(period=period, warmup_steps=0)
    per_step = []
    for _ in range(steps):
        counter.reset()
        averager.average_parameters(model.parameters())
        per_step.append(counter.between_nodes)
    return per_step


def test_counting_sees_local_sgd_model_averaging_every_period(pool):
    full = collective_bytes("all_reduce", 4 * (M * N + M), 2)
    assert pool.run(_averaged_bytes, 3, 6)[0] == [full, 0, 0, full, 0, 0]


def _rows(points):
    """metrics.csv rows: step 0 eval, then one row per step with step_ms, bytes and maybe a val loss."""
    rows = [{"step": "0", "step_ms": "", "replicate_bytes_per_step": "", "val_loss": "5.0"}]
    for step, step_ms, sent, val in points:
        rows.append({"step": str(step), "step_ms": str(step_ms), "replicate_bytes_per_step": str(sent),
                     "val_loss": "" if val is None else str(val)})
    return rows


def test_summarize_adds_step_times_over_windows_and_reads_the_curve():
    # windows: steps 1-2 at 100 ms (logged at 2), step 3 at 300 ms, steps 4-5 at 200 ms
    summary = runs.summarize(_rows([(2, 100, 10, 4.0), (3, 300, 10, None), (5, 200, 20, 3.0)]))
    assert summary.steps == 5 and summary.replicate_bytes_total == 2 * 10 + 10 + 2 * 20
    assert summary.step_ms == 200 and summary.final_val_loss == 3.0
    assert [c[:3] for c in summary.curve] == [(0, 0.0, 5.0), (2, pytest.approx(0.2), 4.0), (5, pytest.approx(0.9), 3.0)]


def test_time_to_target_is_the_first_evaluation_at_or_below_target_and_inf_otherwise():
    curve = runs.summarize(_rows([(2, 100, 0, 4.0), (4, 100, 0, 3.5), (6, 100, 0, 3.4)])).curve
    assert runs.time_to_target(curve, 3.5) == pytest.approx(0.4)
    assert runs.time_to_target(curve, 4.5) == pytest.approx(0.2)   # step 0 (5.0, untrained) never counts
    assert runs.time_to_target(curve, 3.0) == math.inf
    assert runs.time_to_target(runs.summarize(_rows([(1, 100, 0, 6.0)])).curve, 5.5) == math.inf


def test_time_to_target_adds_the_link_seconds_of_the_bytes_sent_until_then():
    curve = runs.summarize(_rows([(2, 100, 50, 4.0), (4, 100, 50, 3.5)])).curve     # 100 B by step 2, 200 by 4
    assert runs.time_to_target(curve, 3.5, seconds_per_byte=0.01) == pytest.approx(0.4 + 200 * 0.01)
    assert runs.time_to_target(curve, 3.0, seconds_per_byte=0.01) == math.inf


def _local_row(method, steps, loss, sent, processes=4):
    return {"method": method, "lr": "0.01", "scalar_lr": "0.1", "seed": "0", "steps": str(steps),
            "tokens": str(steps * 1024 * processes), "final_val_loss": loss, "replicate_bytes_total": str(sent)}


def test_localsteps_rows_are_against_ddp_adamw_at_the_same_steps_in_link_bytes():
    """shardopt's counted bytes cross the link twice (two replicate groups per node), DDP's ring once;
    the target is ddp_adamw's unrounded final loss at the same steps (its own curve reaches it)."""
    rows = [_local_row("ddp_adamw", 10, "4.0000", 8000), _local_row("local_x", 10, "3.9", 20),
            _local_row("ddp_adamw", 50, "3.0", 40000), _local_row("local_x", 50, "3.5", 100)]
    curves = {("ddp_adamw", "0.01", "0.1", "0", "10"): [(0, 0.0, 9.0, 0), (10, 2.0, 3.99996, 8000)],
              ("local_x", "0.01", "0.1", "0", "10"): [(0, 0.0, 9.0, 0), (5, 1.0, 3.95, 10), (10, 2.0, 3.9, 20)]}
    out = {(r["method"], r["steps"]): r for r in localsteps.arrange(rows, curves)}
    assert list(out[("local_x", "10")]) == localsteps.FIELDS
    assert out[("local_x", "10")]["link_bytes_total"] == 40 and out[("ddp_adamw", "10")]["link_bytes_total"] == 8000
    assert float(out[("local_x", "10")]["x_fewer_bytes"]) == 200.0
    assert float(out[("local_x", "50")]["x_fewer_bytes"]) == 200.0      # against the 50-step baseline
    assert float(out[("local_x", "10")]["time_to_target_1mbit_s"]) == pytest.approx(1.0 + 20 * 8 / 1e6, abs=0.05)
    assert float(out[("ddp_adamw", "10")]["time_to_target_1mbit_s"]) == pytest.approx(2.0 + 8000 * 8 / 1e6, abs=0.05)
    assert out[("local_x", "50")]["time_to_target_1mbit_s"] == ""          # no curve: nothing computed
    quiet = {(r["method"], r["steps"]): r for r in localsteps.arrange(rows, curves, {"local_x": 100.0})}
    assert float(quiet[("local_x", "10")]["time_to_target_1mbit_s"]) == pytest.approx(5 * 0.1 + 20 * 8 / 1e6, abs=0.05)


def test_localsteps_on_four_replicas_counts_one_crossing_per_node_and_runs_a_4_by_1_mesh():
    """--replicas 4: four nodes of one rank, so one rank's counted bytes are its node's on the link (against
    two at the benchmark's 2 × 2); the method is named …_M4 and launched on a 4 × 1 mesh; DDP methods refused."""
    rows = [_local_row("ddp_adamw", 10, "4.0", 8000), _local_row("local_x", 10, "3.9", 20),
            {**_local_row("local_x_M4", 10, "3.9", 20), "replicas": "4"}]
    out = {r["method"]: r for r in localsteps.arrange(rows, {})}
    assert (out["local_x"]["replicas"], out["local_x"]["link_bytes_total"]) == (2, 40)
    assert (out["local_x_M4"]["replicas"], out["local_x_M4"]["link_bytes_total"]) == (4, 20)
    assert float(out["local_x_M4"]["x_fewer_bytes"]) == 400.0
    every = {c.method.name: c for c in localsteps.configs(128)}
    config = localsteps.replicas_variant(every["local_muon_H30_sign_vote"], 4)
    assert (config.method.name, config.replicas) == ("local_muon_H30_sign_vote_M4", 4)
    assert localsteps.replicas_variant(every["local_muon_H30_sign_vote"], 2) == every["local_muon_H30_sign_vote"]
    command = config.method.command(0.02, None, 0, Path("out"), [], config.replicas, config.ranks_per_node)
    assert command[command.index("--replicate") + 1] == "4" and command[command.index("--shard") + 1] == "1"
    with pytest.raises(SystemExit, match="ddp_adamw runs on 4 processes at 2 and 4 replicas alike"):
        localsteps.replicas_variant(every["ddp_adamw"], 4)


def test_localsteps_on_eight_replicas_runs_eight_nodes_of_one_rank_against_ddp_on_eight_ranks():
    """--replicas 8 (or 3): that many nodes of one rank, the per-step peers too (…_M8, on 8 processes, twice the
    tokens per step); a row's baseline is ddp_adamw at its own steps and tokens: ddp_adamw_M8 for the M8 rows."""
    rows = [_local_row("ddp_adamw", 10, "4.0", 8000), _local_row("ddp_adamw_M8", 10, "3.8", 7000, 8),
            _local_row("ddp_adamw_M8", 10, "3.9", 9999, 8), {**_local_row("local_x_M8", 10, "3.9", 35, 8), "replicas": "8"}]
    out = {(r["method"], r["replicate_bytes_total"]): r for r in localsteps.arrange(rows, {})}
    assert out[("local_x_M8", "35")]["link_bytes_total"] == 35 and float(out[("local_x_M8", "35")]["x_fewer_bytes"]) == 200.0
    assert out[("ddp_adamw_M8", "7000")]["link_bytes_total"] == 7000   # DDP's ring: one crossing, at any rank count
    every = {c.method.name: c for c in localsteps.configs(128, replicas=8)}
    for name, replicas in (("ddp_adamw", 8), ("local_defaults", 8), ("local_defaults", 3)):
        config = localsteps.replicas_variant(every[name], replicas)
        assert (config.method.name, config.processes, config.ranks_per_node) == (f"{name}_M{replicas}", replicas, 1)
    assert every["local_defaults"].exchange.startswith("sign_vote")     # "auto" at 8 replicas


def test_localsteps_configs_cover_every_inner_exchange_and_period_once():
    configs = localsteps.configs(128)
    names = [c.method.name for c in configs]
    assert len(names) == len(set(names))
    local = {(c.inner, c.H, c.exchange) for c in configs if c.H}
    for H in (10, 30, 100):
        assert {(i, H, e) for i in ("signmuon", "dion", "muon") for e in localsteps.FORMATS} <= local
        assert ("adamw", H, "mean") in local
    muloco = next(c for c in configs if c.method.name == "muloco_H30")
    assert ("--local-steps", "30") == muloco.method.args[2:4] and "int4" in muloco.method.args


def test_summarize_refuses_a_run_without_a_trained_evaluation():
    with pytest.raises(ValueError, match="--eval-every"):
        runs.summarize(_rows([]))


def test_csv_schemas_are_the_issues_columns_with_the_scalar_lr_and_write_csv_rejects_others(tmp_path):
    assert runs.SLOWLINK_FIELDS == ["method", "rate_mbit", "procs_per_node", "lr", "scalar_lr", "steps", "step_ms",
                                    "replicate_bytes_per_step", "wire_bytes_per_step", "time_to_target_s",
                                    "final_val_loss"]
    assert runs.CONVERGENCE_FIELDS == ["method", "lr", "scalar_lr", "seed", "steps", "final_val_loss",
                                       "replicate_bytes_total"]
    good = dict(zip(runs.CONVERGENCE_FIELDS, ["dion_1/4", "0.02", "0.03", 0, 10, "3.1", 100]))
    campaign.write_csv(tmp_path / "c.csv", runs.CONVERGENCE_FIELDS, [good])
    assert campaign.read_csv(tmp_path / "c.csv") == [{k: str(v) for k, v in good.items()}]
    with pytest.raises(ValueError, match="schema"):
        campaign.write_csv(tmp_path / "bad.csv", runs.CONVERGENCE_FIELDS, [{**good, "extra": 1}])
    unlimited = slowlink.row(runs.methods(64)[0], math.inf, 1, 3e-3, 0.03, runs.summarize(_rows([(2, 100, 10, 4.0)])),
                             3.0)
    assert list(unlimited) == runs.SLOWLINK_FIELDS and unlimited["time_to_target_s"] == "inf"
    assert unlimited["wire_bytes_per_step"] == "" and unlimited["scalar_lr"] == "0.03"
    with pytest.raises(ValueError, match="link_tx_bytes"):      # over the link a run must have logged the counter
        slowlink.row(runs.methods(64)[0], 100.0, 1, 3e-3, None, runs.summarize(_rows([(2, 100, 10, 4.0)])), 3.0)


def test_wire_bytes_are_the_link_counter_between_the_first_and_last_trained_rows():
    rows = _rows([(1, 100, 10, None), (2, 100, 10, None), (5, 100, 10, 4.0)])
    for row, counter in zip(rows, ["", "9000", "9500", "11000"]):     # 9000 by step 1: the start-up
        row["link_tx_bytes"] = counter
    assert runs.summarize(rows).wire_bytes_per_step == (11000 - 9000) / (5 - 1)
    row = slowlink.row(runs.methods(64)[0], 10.0, 1, 3e-3, None, runs.summarize(rows), 3.0)
    assert row["wire_bytes_per_step"] == 500
    assert runs.summarize(rows[:2]).wire_bytes_per_step is None          # one trained row: no interval


def test_a_campaign_replaces_its_rows_and_keeps_the_others():
    kept = [{"method": "a", "rate_mbit": "10", "procs_per_node": "1", "x": "old"},
            {"method": "a", "rate_mbit": "10", "procs_per_node": "2", "x": "old"}]
    new = [{"method": "a", "rate_mbit": "10", "procs_per_node": 1, "x": "new"},
           {"method": "b", "rate_mbit": "10", "procs_per_node": 1, "x": "new"}]
    assert [(r["procs_per_node"], r["x"]) for r in campaign.merged(kept, new, slowlink.SLOWLINK_KEY)] == \
        [("2", "old"), (1, "new"), (1, "new")]


def test_link_tx_bytes_sums_every_interface_but_loopback(tmp_path):
    from integrations import netdev
    dev = tmp_path / "dev"
    dev.write_text("Inter-|   Receive |  Transmit\n face |bytes packets|bytes packets\n"
                   "    lo:  50 1 0 0 0 0 0 0  50 1 0 0 0 0 0 0\n"
                   "   so0: 700 9 0 0 0 0 0 0 300 4 0 0 0 0 0 0\n"
                   "  eth0:  10 1 0 0 0 0 0 0  20 1 0 0 0 0 0 0\n")
    assert netdev.link_tx_bytes(dev) == 320
    assert netdev.link_tx_bytes(tmp_path / "absent") is None


def test_rate_strings_parse_to_mbit_and_bad_ones_are_refused():
    assert [slowlink.rate_mbit(r) for r in ("1gbit", "100mbit", "10mbit", "500kbit")] == [1000, 100, 10, 0.5]
    with pytest.raises(ValueError, match="rate"):
        slowlink.rate_mbit("100")


def test_best_table_picks_the_setting_with_the_lowest_mean_over_seeds():
    rows = [{"method": "a", "lr": lr, "scalar_lr": scalar, "seed": s, "steps": 1, "final_val_loss": loss,
             "replicate_bytes_total": 1}
            for lr, scalar, s, loss in [("1", "0.1", 0, "3.0"), ("1", "0.1", 1, "3.4"), ("2", "0.1", 0, "3.1"),
                                        ("2", "0.1", 1, "3.2"), ("2", "0.3", 0, "3.3"), ("2", "0.3", 1, "3.3")]]
    best = convergence.best_table(rows)
    assert [(b["method"], b["lr"], b["scalar_lr"], b["final_val_loss_mean"]) for b in best] == [("a", "2", "0.1", "3.1500")]
    for row in rows[:2]:            # rows read back from the CSV hold seeds as strings, new ones as ints
        row["seed"] = str(row["seed"])
    assert convergence.best_table(rows)[0]["lr"] == "2"
    rows[4]["final_val_loss"] = rows[5]["final_val_loss"] = "3.0"     # the scalar lr decides between equal lrs
    assert convergence.best_table(rows)[0]["scalar_lr"] == "0.3"


def test_methods_pass_their_scalar_lr_and_a_one_lr_method_refuses_one(tmp_path):
    by_name = {m.name: m for m in runs.methods(64)}
    argv = by_name["ddp_adamw"].command(1e-3, None, 0, tmp_path, [], 2, 1)
    assert argv[argv.index("--nonmatrix-lr") + 1] == f"{by_name['ddp_adamw'].scalar_lr:g}"      # the default, explicit
    argv = by_name["signmuon_lion"].command(1e-3, 0.02, 0, tmp_path, [], 2, 1)
    assert argv[argv.index("--nonmatrix-lr") + 1] == "0.02"
    assert "--nonmatrix-lr" not in by_name["signsgd"].command(1e-3, None, 0, tmp_path, [], 2, 1)
    with pytest.raises(ValueError, match="scalar_lr must be None"):
        by_name["signsgd"].command(1e-3, 0.02, 0, tmp_path, [], 2, 1)
    assert runs.local_run_dir(tmp_path, by_name["ddp_adamw"], 1e-3, 0.02, 1, 2).name == "ddp_adamw_lr0.001_slr0.02_seed1_p2"


def test_a_finished_run_is_read_back_only_with_the_same_arguments_and_code(tmp_path, monkeypatch):
    started = []
    log = tmp_path / "run" / "log.txt"
    log.parent.mkdir()

    def start():
        started.append(1)
    assert campaign._reusable_run(["--lr", "1"], log, True, start) and len(started) == 1
    assert not campaign._reusable_run(["--lr", "1"], log, True, start) and len(started) == 1     # read back
    assert campaign._reusable_run(["--lr", "2"], log, True, start) and len(started) == 2         # other arguments
    assert campaign._reusable_run(["--lr", "2"], log, False, start) and len(started) == 3        # reuse off
    monkeypatch.setattr(campaign, "code_version", lambda: "other code")
    assert campaign._reusable_run(["--lr", "2"], log, True, start) and len(started) == 4         # other code


def test_a_failed_run_leaves_no_done_marker_so_it_is_run_again(tmp_path):
    log = tmp_path / "run" / "log.txt"
    log.parent.mkdir()
    campaign._reusable_run(["--lr", "1"], log, True, lambda: None)

    def fail():
        raise RuntimeError("run failed")
    with pytest.raises(RuntimeError):
        campaign._reusable_run(["--lr", "2"], log, True, fail)
    assert not (log.parent / "done").exists() and not campaign.finished(log.parent, ["--lr", "1"])


def test_rows_are_retargeted_from_the_curve_of_their_own_run(tmp_path):
    out = slowlink.run_dir(tmp_path, 1, 100.0, "dion_1/4")
    out.mkdir(parents=True)
    metrics = _rows([(2, 100, 10, 4.0), (4, 100, 10, 3.0)])
    campaign.write_csv(out / "metrics.csv", list(metrics[0]), metrics)
    row = {"method": "dion_1/4", "rate_mbit": "100", "procs_per_node": "1", "steps": "4", "final_val_loss": "3.0000",
           "time_to_target_s": "0.2"}
    assert slowlink.retargeted([row], {1: 3.5}, tmp_path)[0]["time_to_target_s"] == "0.4"
    assert slowlink.retargeted([row], {2: 3.5}, tmp_path)[0]["time_to_target_s"] == "0.2"   # no target for 1 proc
    other = {**row, "final_val_loss": "2.9000"}         # the folder holds another run: nothing to recompute from
    assert slowlink.row_curve(other, tmp_path) is None
    assert slowlink.retargeted([other], {1: 3.5}, tmp_path)[0]["time_to_target_s"] == "0.2"


def test_powersgd_matched_rank_sends_dion_quarter_bytes():
    # Dion 1/4 of an n_embd-wide matrix: r = n/4 numbers in bf16 per (m + n); PowerSGD: fp32
    assert runs.powersgd_matched_rank(256) == 32
    assert 4 * runs.powersgd_matched_rank(256) == runs.DION_WIRE_ITEMSIZE * 64


def test_unknown_method_names_are_refused_with_the_known_ones():
    with pytest.raises(SystemExit, match="known: ddp_adamw"):
        runs.select(runs.methods(64), ["adam"])


def test_polar_variant_labels_and_passes_the_newton_schulz_options_and_refuses_other_methods():
    by_name = {m.name: m for m in runs.methods(128)}
    variant = runs.polar_variant(by_name["signmuon_lion"], 2, "polar_express")
    assert variant.name == "signmuon_lion_ns2_polar_express"
    assert variant.args[-4:] == ("--ns-steps", "2", "--ns-coefficients", "polar_express")
    assert (variant.lr, variant.scalar_lr) == (by_name["signmuon_lion"].lr, by_name["signmuon_lion"].scalar_lr)
    for name in ("ddp_adamw", "dion_1/4"):
        with pytest.raises(SystemExit, match=rf"{name} has no Newton–Schulz step"):
            runs.polar_variant(by_name[name], 2, "quintic")


def test_matrix_conv_is_conv2d_and_its_weight_lands_in_the_matrix_group():
    import shardopt
    from fashion_mnist import CNN, MatrixConv2d
    conv = MatrixConv2d(3, 5, 3, padding=1)
    x = torch.randn(2, 3, 8, 8)
    expected = torch.nn.functional.conv2d(x, conv.weight.detach().reshape(5, 3, 3, 3), padding=1)
    torch.testing.assert_close(conv(x), expected)
    groups = shardopt.param_groups(CNN(), "dion", "adamw")
    assert groups[0]["param_names"] == ["conv1.weight", "conv2.weight", "fc.weight"]


def test_rows_measured_at_another_setting_than_the_best_are_superseded():
    rows = [{"method": "a", "lr": "0.001", "scalar_lr": "0.1"}, {"method": "a", "lr": "0.001", "scalar_lr": "0.003"},
            {"method": "s", "lr": "0.002", "scalar_lr": ""}, {"method": "b", "lr": "9", "scalar_lr": "9"}]
    kept, superseded = slowlink.split_superseded(rows, {"a": (1e-3, 0.1), "s": (2e-3, None)})
    assert kept == [rows[0], rows[2], rows[3]] and superseded == [rows[1]]     # b has no best: kept


def test_the_csv_is_ordered_by_procs_then_method_then_rate():
    rows = [{"method": m, "procs_per_node": p, "rate_mbit": r} for m, p, r in
            [("b", "2", "10"), ("a", "1", "10"), ("x", "1", "inf"), ("a", "1", "inf"), ("b", "1", "100")]]
    assert [(r["method"], r["procs_per_node"], r["rate_mbit"]) for r in slowlink.ordered(rows, ["a", "b"])] == \
        [("a", "1", "inf"), ("a", "1", "10"), ("b", "1", "100"), ("x", "1", "inf"), ("b", "2", "10")]


def _fashion_method_steps(method: str, steps: int):
    """`method` of fashion_mnist.py on its CNN for `steps` steps of random images (no data set needed):
    (bytes between the 2 ranks in the last step, whether the replicas are bitwise equal after synchronize())."""
    import peers
    from fashion_mnist import CNN, method_peer
    torch.manual_seed(0)
    model = CNN()
    peer = method_peer(model, method, 1e-3, seed=0)
    generator = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    for _ in range(steps):
        x, y = torch.randn(4, 1, 28, 28, generator=generator), torch.randint(10, (4,), generator=generator)
        torch.nn.functional.cross_entropy(peer.net(x), y).backward()
        peer.step()
        sent = peer.sent()[0]
    peer.synchronize()
    equal = peers.replicas_equal(model)
    peer.close()
    return sent, equal


def test_every_fashion_mnist_method_keeps_replicas_equal_and_sends_its_bytes(pool):
    """Each method's replicas agree bitwise after local data differed (local SGD's after its final average),
    and its counted bytes per step are ordered as its wire format says: full-precision mean > PowerSGD
    rank 16 > rank 1 and Dion 1/4 > 1/16 > the 1-bit votes; local SGD sends nothing in a step between its
    model averages (its 23rd: after 20 plain DDP steps it averages at the 21st, then every 8th)."""
    import fashion_mnist
    sent = {}
    for method in fashion_mnist.METHODS:
        steps = 23 if method == "localsgd" else 3
        between, equal = pool.run(_fashion_method_steps, method, steps)[0]
        assert equal, f"{method}: replicas differ"
        sent[method] = between
    numel = sum(p.numel() for p in fashion_mnist.CNN().parameters())
    full = collective_bytes("all_reduce", 4 * numel, 2)
    assert sent["adamw"] == sent["muon"] and 0 <= sent["adamw"] - full <= 16     # + shardopt's few control bytes
    assert sent["adamw"] > sent["powersgd_rank16"] > sent["powersgd_rank1"] > 0
    assert sent["dion_1/4"] > sent["dion_1/16"] > sent["signmuon"] > 0 and sent["signsgd"] > 0
    assert sent["localsgd"] == 0
    assert 0.5 < sent["powersgd_rank16"] / sent["dion_1/4"] < 2        # the matched rank: comparable bytes


def test_local_defaults_passes_localsteps_signature_defaults_but_sync_every():
    from shardopt.localsteps.formats import outer_format
    default = {n: p.default for n, p in inspect.signature(shardopt.LocalSteps).parameters.items()}
    config = next(c for c in localsteps.configs(128) if c.method.name == "local_defaults")
    args = dict(zip(config.method.args[::2], config.method.args[1::2]))
    assert args == {"--optimizer": "muon", "--local-steps": "30", "--outer-exchange": default["exchange"],
                    "--outer-lr": f"{default['outer_lr']:g}", "--outer-momentum": f"{default['outer_momentum']:g}",
                    "--outer-block": str(default["block"] or outer_format(default["exchange"]).block)}
    assert (config.H, config.outer_lr, config.outer_momentum) == (30, default["outer_lr"], default["outer_momentum"])
    four = next(c for c in localsteps.configs(128, replicas=4) if c.method.name == "local_defaults")
    assert (config.exchange, four.exchange) == ("sign_mean, block 128", "sign_vote, block 128")   # what "auto" runs


def test_topk_at_sign_mean_b128s_density_sends_its_bytes_within_a_percent():
    from shardopt.localsteps.formats import outer_format
    from shardopt.localsteps.traffic import sync_bytes
    from shardopt.wire.comm import CountingAxis
    numel, density = 1_320_064, localsteps.topk_density_at(localsteps.SIGN_MEAN_B128_BITS)
    sent = {name: sync_bytes(outer_format(name, **options), numel, CountingAxis("replicate", 4))
            for name, options in (("sign_mean", {"block": 128}), ("topk", {"density": density}))}
    assert abs(sent["topk"] / sent["sign_mean"] - 1) < 0.01, sent
    assert localsteps.topk_density_at(localsteps.SIGN_MEAN_B128_BITS, block=128) != density   # (the block counts)


def test_sizes_takes_every_horizon_and_the_outer_variants_on_its_fixed_four_replicas(monkeypatch, tmp_path):
    import sizes
    seen = []
    monkeypatch.setattr(sizes, "run_one", lambda finals, config, size, lr, seed, args: seen.append(
        (size, config.method.name, config.replicas, config.method.args[-4:])))
    monkeypatch.setattr(sys, "argv", ["sizes.py", "--sizes", "S", "--configs", "local_muon_H5_sign_mean_b128",
                                      "--outer-lrs", "0.7", "1", "--outer-momenta", "0", "--csv", str(tmp_path / "x.csv")])
    sizes.main()
    assert seen == [("S", f"local_muon_H5_sign_mean_b128_olr{lr}_m0", 4, ("--outer-lr", lr, "--outer-momentum", "0"))
                    for lr in ("0.7", "1")]


def test_overlap_variant_labels_and_passes_the_option_and_refuses_ddp_and_local_methods():
    by_name = {m.name: m for m in runs.methods(128)}
    variant = runs.overlap_variant(by_name["dion_1/4"])
    assert variant.name == "dion_1/4_overlap" and variant.args[-2:] == ("--overlap-backward", "on")
    assert (variant.lr, variant.scalar_lr) == (by_name["dion_1/4"].lr, by_name["dion_1/4"].scalar_lr)
    local = {c.method.name: c.method for c in localsteps.configs(128)}
    for method in (by_name["ddp_adamw"], local["muloco_H30"]):
        with pytest.raises(SystemExit, match=rf"{method.name} is not one of shardopt's per-step optimizers"):
            runs.overlap_variant(method)


def test_slowlink_catalogue_takes_per_step_and_local_methods_at_the_best_lrs_with_their_variants():
    _, args = slowlink.parse_arguments(["--methods", "ddp_adamw", "signmuon_lion", "local_muon_H10_sign_mean_b128",
                                        "--overlap-backward", "--ns-steps", "3", "--ns-coefficients", "polar_express",
                                        "--outer-lrs", "0.7", "1", "--outer-momenta", "0"])
    chosen = slowlink.catalogue(args, {"signmuon_lion": (0.01, 0.05)})
    assert [m.name for m in chosen] == ["ddp_adamw", "signmuon_lion", "signmuon_lion_ns3_polar_express",
                                        "signmuon_lion_overlap", "signmuon_lion_ns3_polar_express_overlap",
                                        "local_muon_H10_sign_mean_b128_olr0.7_m0", "local_muon_H10_sign_mean_b128_olr1_m0"]
    assert [(m.lr, m.scalar_lr) for m in chosen[1:5]] == [(0.01, 0.05)] * 4      # every variant at the same lrs
    assert chosen[4].args[-4:] == ("--ns-coefficients", "polar_express", "--overlap-backward", "on")
    assert chosen[5].args[-4:] == ("--outer-lr", "0.7", "--outer-momentum", "0")
    _, args = slowlink.parse_arguments(["--methods", "dion_1/4", "muloco_H30", "--outer-overlap", "--fragments", "3"])
    assert [m.name for m in slowlink.catalogue(args, {})] == ["dion_1/4", "muloco_H30_overlap_f3"]
    _, args = slowlink.parse_arguments(["--methods", "ddp_adamw", "local_adam"])
    with pytest.raises(SystemExit, match=r"--methods: unknown local_adam; known: ddp_adamw.*muloco_H30"):
        slowlink.catalogue(args, {})


def test_step_profile_sums_the_ops_of_the_profiled_steps_only_and_the_time_outside_them(tmp_path):
    from integrations.step_profile import OUTSIDE, StepProfile
    profile = StepProfile(first=2, last=3)
    a = torch.randn(64, 64)
    for step in range(1, 6):
        with profile.step(step):
            for _ in range(3):
                torch.mm(a, a)
    rows = profile.rows()
    by_op = {row["op"]: row for row in rows}
    assert profile.steps == 2 and by_op["aten::mm"]["calls_per_step"] == "3"     # steps 2 and 3, 3 products each
    assert rows[-1]["op"] == OUTSIDE and float(rows[0]["ms_per_step"]) >= float(rows[1]["ms_per_step"])
    total = sum(float(row["ms_per_step"]) for row in rows)        # ops + outside = the profiled steps' wall time
    assert abs(total - 1000 * profile.wall_s / profile.steps) < 0.01
    profile.write(tmp_path / "p.csv")
    assert [row["op"] for row in campaign.read_csv(tmp_path / "p.csv")] == [row["op"] for row in rows]
    with pytest.raises(ValueError, match="1 ≤ FIRST ≤ LAST"):
        StepProfile(first=3, last=2)


def test_step_split_puts_each_op_in_one_category_and_sums_them():
    cases = {"aten::baddbmm": 0, "aten::linalg_qr": 1, "c10d::allgather_base_": 2, "aten::random_": 3,
             "aten::bitwise_and": 4, "aten::__lshift__": 4, "aten::copy_": 5, "aten::view": 6, "aten::lerp_": 7,
             "(outside any op)": 8, "Optimizer.step#SignMuon.step": 8}
    for op, index in cases.items():
        assert step_split.category(op) == step_split.CATEGORIES[index], op
    totals = step_split.split([{"op": "aten::bmm", "ms_per_step": "2.5"}, {"op": "aten::mm", "ms_per_step": "1"},
                               {"op": "aten::gt", "ms_per_step": "0.5"}])
    assert totals[step_split.CATEGORIES[0]] == 3.5 and totals[step_split.CATEGORIES[4]] == 0.5
    assert sum(totals.values()) == 4.0 and list(totals) == step_split.CATEGORIES


def test_step_ops_counts_a_sign_muon_step_whose_ops_do_not_grow_with_the_replicas(tmp_path):
    """launch/bench/step_ops.py on the demo GPT at 4 and 8 replicas (both "alltoall_1bit"): the same ops per
    step, one host sync (the agreed non-finite flag), the votes' collectives uint8 on the params' device."""
    import subprocess
    out, collectives = tmp_path / "ops.csv", tmp_path / "collectives.csv"
    subprocess.run([sys.executable, str(ROOT / "launch" / "bench" / "step_ops.py"), "--model", "demo", "--replicas", "4",
                    "8", "--algorithms", "signmuon", "--csv", str(out), "--collectives-csv", str(collectives)],
                   check=True, capture_output=True, timeout=300)
    rows = campaign.read_csv(out)
    assert [row["replicas"] for row in rows] == ["4", "8"]
    assert rows[0]["aten_ops_per_step"] == rows[1]["aten_ops_per_step"] and int(rows[0]["aten_ops_per_step"]) > 0
    assert {row["host_syncs_per_step"] for row in rows} == {"1"}
    votes = [row for row in campaign.read_csv(collectives) if row["collective"] in ("alltoall_base", "allgather_base")]
    assert votes and {(row["dtype"], row["device"]) for row in votes} == {("uint8", "cpu")}


def _running(pid: int) -> bool:
    """Whether pid is a process that has not ended (a zombie waiting for its parent has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
def test_a_terminated_campaign_kills_its_runs_and_their_children(tmp_path):
    """`pkill -f sizes.py` sends SIGTERM: the run (a session of its own, as torchrun in _run) and the
    process it started (as torchrun's workers) must end with the campaign, not train on unseen."""
    pids = tmp_path / "pids"
    run = ("import subprocess, sys, time; child = subprocess.Popen(['sleep', '300']); "
           f"open({str(pids)!r}, 'w').write(f'{{child.pid}} ' + str(__import__('os').getpid())); time.sleep(300)")
    driver = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'launch' / 'bench')!r}]; import campaign; "
              f"from pathlib import Path; campaign._run([[sys.executable, '-c', {run!r}]], "
              f"Path({str(tmp_path / 'log.txt')!r}), 300)")
    campaign_process = subprocess.Popen([sys.executable, "-c", driver], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and len(pids.read_text().split()) == 2):
            assert time.monotonic() < deadline and campaign_process.poll() is None, "the run did not start"
            time.sleep(0.1)
        started = [int(p) for p in pids.read_text().split()]
        assert all(_running(p) for p in started)
        campaign_process.send_signal(signal.SIGTERM)
        code = campaign_process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_running(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in started if _running(p)], "the run or its child outlived the campaign"
        assert code == 128 + signal.SIGTERM      # exits as a shell reports a SIGTERM, after its cleanup
    finally:
        campaign_process.kill()
        for pid in [int(p) for p in pids.read_text().split()] if pids.exists() else []:
            if _running(pid):
                os.kill(pid, 9)
