"""integrations/fsdp/train.py under torchrun (2 or 4 CPU processes, gloo): it trains (also in bf16 with
accumulation and clipping), logs (CSV, TensorBoard), and resumes exactly, lr scheduler included.

Backend: train.py (world.py) runs NCCL whenever CUDA is visible, so every run here hides the GPUs
(CUDA_VISIBLE_DEVICES="") and runs gloo on the CPU, whatever the machine has. The tests named
`nccl` opt into NCCL, one GPU per rank: they run with SHARDOPT_TEST_NCCL=1 (launch/gpu_smoke.sh sets it)
on a machine with a GPU for each rank, and skip, saying which is missing, otherwise."""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "integrations" / "fsdp" / "train.py"
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "8",
        "--warmup", "5", "--log-every", "5", "--eval-every", "10", "--eval-batches", "2"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A small byte corpus in the prepared layout (train.bin / val.bin), so no download is needed."""
    directory = tmp_path_factory.mktemp("data")
    text = b"".join(b"%d: To be, or not to be, that is the question.\n" % i for i in range(2000))
    (directory / "train.bin").write_bytes(text[:90_000])
    (directory / "val.bin").write_bytes(text[90_000:])
    (directory / "meta.json").write_text('{"vocab_size": 256, "dtype": "uint8"}')
    return directory


NCCL_OPT_IN = "SHARDOPT_TEST_NCCL"


def needs_nccl(ranks: int) -> None:
    """Skip the calling test unless NCCL is opted into ($SHARDOPT_TEST_NCCL=1) and `ranks` GPUs are visible
    (train.py puts LOCAL_RANK on GPU LOCAL_RANK)."""
    if os.environ.get(NCCL_OPT_IN) != "1":
        pytest.skip(f"NCCL runs are opt-in: {NCCL_OPT_IN}=1 (launch/gpu_smoke.sh sets it) on a machine with "
                    f"≥ {ranks} GPU(s); without it this module runs gloo on the CPU")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < ranks:
        pytest.skip(f"{ranks} NCCL rank(s) need {ranks} GPU(s), one per rank; {visible} visible")


def run_env(nccl: bool = False, **extra) -> dict:
    """The environment of a train.py process: this checkout first on PYTHONPATH (not an installed copy), one
    OpenMP thread, and the GPUs hidden (gloo on the CPU) unless `nccl` (the caller ran needs_nccl)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **extra}
    if not nccl:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def train(data_dir, out_dir, *extra, nproc=2, timeout=180, nccl=False, env=None):
    """torchrun of train.py with `nproc` ranks on gloo, or NCCL when `nccl`; `env` added to run_env's."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(TRAIN), "--data-dir", str(data_dir), "--out-dir", str(out_dir), *TINY, *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=run_env(nccl, **(env or {})),
                          cwd=ROOT)
    assert done.returncode == 0, f"train.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def metrics(out_dir) -> list[dict]:
    with (Path(out_dir) / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def checkpoint_tensors(path, target) -> dict:
    """Every tensor of a DCP checkpoint (read on this single process through a torch.save file `target`)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(path, target)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}.{index}", item)
    walk("", torch.load(target, weights_only=True))
    return flat


DION = ["--optimizer", "dion", "--steps", "20", "--checkpoint-every", "10"]


@pytest.fixture(scope="module")
def whole_runs(data_dir, tmp_path_factory):
    """mesh (replicate, shard) → out dir of an uninterrupted 20-step Dion run with checkpoints at 10 and 20."""
    runs = {}

    def run(replicate, shard):
        if (replicate, shard) not in runs:
            out_dir = tmp_path_factory.mktemp(f"whole_{replicate}x{shard}")
            train(data_dir, out_dir, *DION, "--replicate", str(replicate), "--shard", str(shard))
            runs[replicate, shard] = out_dir
        return runs[replicate, shard]
    return run


def assert_learns(out_dir):
    rows = metrics(out_dir)
    assert [int(r["step"]) for r in rows] == [0, 5, 10, 15, 20]
    train_losses = [float(r["train_loss"]) for r in rows[1:]]
    val_losses = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    assert train_losses[-1] < train_losses[0] - 0.5, train_losses
    assert val_losses[-1] < val_losses[0] - 0.5, val_losses
    assert (Path(out_dir) / "summary.json").exists()
    return rows


def test_dion_between_replicas_lowers_the_loss_and_logs_bytes(whole_runs):
    rows = assert_learns(whole_runs(2, 1))
    assert all(int(r["replicate_bytes_per_step"]) > 0 for r in rows[1:])


def test_signmuon_inside_fsdp_lowers_the_loss_and_profiles_the_chosen_steps(data_dir, tmp_path):
    train(data_dir, tmp_path, "--optimizer", "signmuon", "--replicate", "1", "--shard", "2", "--steps", "20",
          "--profile-optimizer", "11", "14")
    rows = assert_learns(tmp_path)
    assert all(int(r["replicate_bytes_per_step"]) == 0 for r in rows[1:])
    with (tmp_path / "optimizer_profile.csv").open() as f:
        profile = {row["op"]: row for row in csv.DictReader(f)}
    # Newton–Schulz's batched products, a few a step; the last row is the time outside any op
    assert float(profile["aten::baddbmm"]["ms_per_step"]) > 0 and float(profile["aten::baddbmm"]["calls_per_step"]) >= 5
    assert list(profile)[-1] == "(outside any op)"


def test_local_steps_ending_off_a_sync_step_saves_identical_replicas(data_dir, tmp_path):
    """Issue 39.2: --local-steps 4, --steps 6: the last step syncs (LocalSteps.sync_now), so both replicas'
    checkpoints of step 6 hold bitwise the same weights (each replica writes its own, checkpoint.py)."""
    train(data_dir, tmp_path, "--optimizer", "signmuon", "--steps", "6", "--local-steps", "4", "--outer-exchange",
          "sign_mean", "--checkpoint-every", "6", "--replicate", "2", "--shard", "1", "--log-every", "3",
          "--eval-every", "6")
    replicas = [checkpoint_tensors(tmp_path / "checkpoints" / "step_000006" / f"replica_{r}", tmp_path / f"r{r}.pt")
                for r in range(2)]
    weights = [{k: v for k, v in replica.items() if k.startswith(".model.")} for replica in replicas]
    assert weights[0] and weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_mismatched_mesh_is_a_clear_error(data_dir):
    """Checked before any process group starts (so without torchrun, as torchrun's WORLD_SIZE says)."""
    command = [sys.executable, str(TRAIN), "--data-dir", str(data_dir), "--replicate", "3", "--shard", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT, env=run_env(WORLD_SIZE="2"))
    assert done.returncode != 0
    assert "--replicate 3 × --shard 1 = 3 ranks, but the world size is 2" in done.stderr


def test_help_lists_the_everyday_options():
    done = subprocess.run([sys.executable, str(TRAIN), "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=run_env())
    assert done.returncode == 0, done.stderr
    for option in ("--bf16", "--grad-accum", "--clip", "--tensorboard", "MixedPrecisionPolicy", "max_grad_norm"):
        assert option in done.stdout, option


@pytest.mark.parametrize("option, value", [("--grad-accum", "0"), ("--clip", "-1")])
def test_bad_accumulation_or_clip_is_a_clear_error(data_dir, option, value):
    command = [sys.executable, str(TRAIN), "--data-dir", str(data_dir), option, value]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT, env=run_env())
    assert done.returncode != 0 and f"{option} {int(value) if option == '--grad-accum' else float(value)}" in done.stderr


def test_config_file_over_the_defaults_and_the_command_line_over_it(data_dir, tmp_path):
    """A --config JSON overrides the defaults files (integrations/gpt.json, fsdp/defaults.json), the command
    line overrides the config; a key no defaults file has is a clear error; the old --scalar-* spellings set
    the --nonmatrix-* options, with one deprecation warning. (A world of one: plain python, no torchrun.)"""
    env = run_env()
    config = tmp_path / "run.json"
    config.write_text('{"steps": 2, "nonmatrix_lr": 0.5, "optimizer": "signmuon"}')
    command = [sys.executable, str(TRAIN), "--data-dir", str(data_dir), "--out-dir", str(tmp_path / "out"), *TINY,
               "--config", str(config), "--scalar-lr", "0.02"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["steps"], summary["optimizer"], summary["scalar_lr"]) == (2, "signmuon", 0.02)
    assert done.stderr.count("DeprecationWarning: --scalar-lr is renamed --nonmatrix-lr") == 1
    config.write_text('{"stepz": 2}')
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert done.returncode != 0 and "unknown keys ['stepz']" in done.stderr


def test_overlay_plot_of_several_runs(tmp_path):
    """integrations/plot.py (the demo's compare.png): one figure from several runs' metrics.csv."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[train]')")
    runs = []
    for name, bytes_per_step in (("adamw", 1000), ("signmuon", 100)):
        run = tmp_path / name
        run.mkdir()
        lines = ["step,train_loss,val_loss,replicate_bytes"] + [
            f"{step},{3 - step / 20},{'' if step % 10 else 3.1 - step / 20},{step * bytes_per_step}" for step in range(0, 21, 5)]
        (run / "metrics.csv").write_text("\n".join(lines) + "\n")
        runs.append(str(run))
    out = tmp_path / "compare.png"
    done = subprocess.run([sys.executable, str(ROOT / "integrations" / "plot.py"), *runs, "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def tensorboard_scalars(log_dir) -> dict:
    """tag → [(step, value)] of every scalar in a TensorBoard log directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_bf16_accumulation_and_clip_on_2x2_keep_replicas_bit_identical(data_dir, tmp_path):
    """--bf16 --grad-accum 2 --clip on 2 replicas × 2 shards: it learns, the clip is active (the agreed
    norm exceeds MAX), the replicas' weights are checked bitwise equal after every step (the script
    stops with an error otherwise), and TensorBoard gets loss, lr, grad norm and bytes."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[train]')")
    output = train(data_dir, tmp_path, "--optimizer", "signmuon", "--replicate", "2", "--shard", "2", "--steps", "20",
                   "--bf16", "--grad-accum", "2", "--clip", "1.0", "--check-replicas-every", "1", "--tensorboard",
                   nproc=4, timeout=300)
    assert "bf16 compute" in output and "(2 micro-batches), clip 1.0" in output
    rows = assert_learns(tmp_path)
    norms = [float(r["grad_norm"]) for r in rows[1:]]
    assert all(norm > 1.0 for norm in norms), norms
    assert int(rows[-1]["tokens"]) == 20 * 2 * 8 * 16 * 4   # steps × micro-batches × batch × context × ranks
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    for tag in ("loss/train", "loss/val", "lr", "grad_norm", "bytes/replicate_per_step", "bytes/replicate_total"):
        assert [step for step, _ in scalars[tag]] == [int(r["step"]) for r in rows if r[tag_field(tag)] != ""], tag
    assert scalars["grad_norm"][-1][1] == pytest.approx(norms[-1], rel=1e-5)


def tag_field(tag: str) -> str:
    return {"loss/train": "train_loss", "loss/val": "val_loss", "bytes/replicate_per_step": "replicate_bytes_per_step",
            "bytes/replicate_total": "replicate_bytes"}.get(tag, tag)


def scheduler_state(checkpoint, target) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(checkpoint, target)
    return torch.load(target, weights_only=True)["scheduler"]


@pytest.mark.parametrize("replicate, shard", [(2, 1), (1, 2)])
def test_resume_continues_bitwise_on_the_same_trajectory(data_dir, tmp_path, whole_runs, replicate, shard):
    """20 steps in one go vs. stop at 10 then --resume: the same checkpoint at step 20, bit for bit."""
    mesh = ["--replicate", str(replicate), "--shard", str(shard)]
    whole_dir = whole_runs(replicate, shard)
    train(data_dir, tmp_path / "split", *DION, *mesh, "--stop-at", "10")
    assert not (tmp_path / "split" / "checkpoints" / "step_000020").exists()
    output = train(data_dir, tmp_path / "split", *DION, *mesh, "--resume")
    assert "resume: loaded" in output and "(step 10, lr scheduler at step 10)" in output
    assert scheduler_state(tmp_path / "split" / "checkpoints" / "step_000010", tmp_path / "s.pt")["last_epoch"] == 10
    lrs = lambda rows: [(r["step"], r["lr"]) for r in rows]   # a scheduler restarted at 0 would warm up again
    assert lrs(metrics(whole_dir)) == lrs(metrics(tmp_path / "split"))

    whole = checkpoint_tensors(whole_dir / "checkpoints" / "step_000020", tmp_path / "whole.pt")
    split = checkpoint_tensors(tmp_path / "split" / "checkpoints" / "step_000020", tmp_path / "split.pt")
    assert whole.keys() == split.keys()
    assert any(key.startswith(".model.") for key in whole) and any("momentum" in key for key in whole)
    different = [key for key in whole if not torch.equal(whole[key], split[key])]
    assert not different, different
    final = lambda rows: [(r["step"], r["train_loss"], r["val_loss"]) for r in rows if int(r["step"]) >= 15]
    assert final(metrics(whole_dir)) == final(metrics(tmp_path / "split"))


def test_checkpoint_momenta_own_sends_nothing_resumes_bitwise_and_refuses_another_replica_count(data_dir, tmp_path):
    """--checkpoint-momenta own (issue 39.1): each replica saves its own momenta, 0 bytes; stopping at 6 and
    resuming ends, per replica, with the straight run's step-10 checkpoint bit for bit; --replicate 1 is refused."""
    own = ["--optimizer", "signmuon", "--nonmatrix-algorithm", "lion", "--steps", "10", "--checkpoint-every", "2",
           "--checkpoint-momenta", "own", "--log-every", "2", "--eval-every", "10"]
    mesh = ["--replicate", "2", "--shard", "1"]
    train(data_dir, tmp_path / "whole", *own, *mesh, "--summary-csv", str(tmp_path / "whole.csv"))
    train(data_dir, tmp_path / "split", *own, *mesh, "--stop-at", "6")
    assert "(step 6, lr scheduler at step 6)" in train(data_dir, tmp_path / "split", *own, *mesh, "--resume")
    for replica in range(2):
        folder = Path("checkpoints") / "step_000010" / f"replica_{replica}"
        whole = checkpoint_tensors(tmp_path / "whole" / folder, tmp_path / "w.pt")
        split = checkpoint_tensors(tmp_path / "split" / folder, tmp_path / "s.pt")
        assert whole.keys() == split.keys() and any("momentum" in key for key in whole)
        assert [key for key in whole if not torch.equal(whole[key], split[key])] == []
    with open(tmp_path / "whole.csv") as f:
        summary = next(csv.DictReader(f))
    assert summary["checkpoint_momenta"] == "own" and summary["checkpoint_bytes"] == "0"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(TRAIN),
               "--data-dir", str(data_dir), "--out-dir", str(tmp_path / "split"), *TINY, *own, "--replicate", "1",
               "--shard", "2", "--resume"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=run_env(), cwd=ROOT)
    assert done.returncode != 0 and "2 per-replica checkpoints" in done.stdout + done.stderr, done.stderr[-3000:]


def test_checkpoint_resumes_on_another_mesh(data_dir, tmp_path, whole_runs):
    """A step-10 checkpoint of 2 replicas × 1 shard continues on 1 replica × 2 shards. (Dion with
    decoupled momenta follows the mean gradient exactly, so the run matches a 1 × 2 run to rounding.)"""
    shutil.copytree(whole_runs(2, 1) / "checkpoints" / "step_000010", tmp_path / "checkpoints" / "step_000010")
    output = train(data_dir, tmp_path, *DION, "--replicate", "1", "--shard", "2", "--resume")
    assert "resume: loaded" in output and "(step 10, lr scheduler at step 10)" in output
    resumed = float(metrics(tmp_path)[-1]["val_loss"])
    reference = float(metrics(whole_runs(1, 2))[-1]["val_loss"])
    assert abs(resumed - reference) < 1e-3, (resumed, reference)


def test_fsdp_over_tensor_parallel_trains_like_fsdp_alone(data_dir, tmp_path, whole_runs):
    """--tp 2: every block tensor-parallel over 2 ranks under FSDP2 over 2 shard ranks (4 processes);
    the layout works end to end (Dion on _StridedShard and (Shard(0), Shard(1)) weights, DCP checkpoints)
    and the run follows the 1 × 2 run without TP: the same initial val loss (the model computes the same
    function), and losses within 1e-3 (Dion's Q₀ of c_attn differs: its rows are stored reordered;
    measured 1.4e-4 after 20 steps). AdamW on the matrices matched the 1 × 2 run to all 6 logged digits."""
    output = train(data_dir, tmp_path, *DION, "--replicate", "1", "--shard", "2", "--tp", "2", nproc=4, timeout=300)
    assert "mesh 1 replicate × 2 shard × 2 tensor" in output
    rows, reference = metrics(tmp_path), metrics(whole_runs(1, 2))
    assert rows[0]["val_loss"] == reference[0]["val_loss"]
    for row, want in zip(rows[1:], reference[1:]):
        assert abs(float(row["train_loss"]) - float(want["train_loss"])) <= 1e-3 * float(want["train_loss"])
    assert (tmp_path / "checkpoints" / "step_000020" / ".metadata").exists()


KILL_RUN = ["--optimizer", "signmuon", "--steps", "40", "--checkpoint-every", "10", "--replicate", "2", "--shard", "2",
            "--timeout", "30", "--check-replicas-every", "10"]


def _kill_one_rank_after_checkpoint(data_dir, out_dir, *extra, max_restarts=0, bound=120):
    """Start a 4-rank run, SIGKILL one worker once the step-10 checkpoint is complete; return
    (torchrun's exit code, seconds from the kill to torchrun's exit, output)."""
    import signal
    import time
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               "--max-restarts", str(max_restarts), str(TRAIN), "--data-dir", str(data_dir), "--out-dir",
               str(out_dir), *TINY, *KILL_RUN, *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                               env=run_env(), start_new_session=True)
    try:
        marker = Path(out_dir) / "checkpoints" / "step_000010" / ".metadata"
        deadline = time.monotonic() + bound
        while not marker.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.01)
        assert marker.exists(), "the run never wrote its step-10 checkpoint"
        workers = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
        assert len(workers) == 4, workers
        os.kill(int(workers[1]), signal.SIGKILL)
        killed_at = time.monotonic()
        output, _ = process.communicate(timeout=bound)
        return process.returncode, time.monotonic() - killed_at, output
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def whole_kill_run(data_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("whole_2x2")
    train(data_dir, out_dir, *KILL_RUN, nproc=4, timeout=300)
    return out_dir


def _same_final_checkpoint(whole_dir, out_dir, tmp_path, step=40):
    """The two runs' checkpoints at `step`: the same tensors (model, optimizer state), bit for bit."""
    whole = checkpoint_tensors(whole_dir / "checkpoints" / f"step_{step:06d}", tmp_path / "whole.pt")
    resumed = checkpoint_tensors(out_dir / "checkpoints" / f"step_{step:06d}", tmp_path / "resumed.pt")
    assert whole.keys() == resumed.keys()
    assert any(key.startswith(".model.") for key in whole) and any("momentum" in key for key in whole)
    assert not [key for key in whole if not torch.equal(whole[key], resumed[key])]


def test_killed_rank_stops_the_job_and_resume_reaches_the_same_weights(data_dir, tmp_path, whole_kill_run):
    code, seconds, output = _kill_one_rank_after_checkpoint(data_dir, tmp_path / "run")
    assert code != 0, output[-2000:]
    assert seconds < 60, f"the job took {seconds:.0f} s to stop after a rank died"
    assert not (tmp_path / "run" / "checkpoints" / "step_000040").exists()
    resumed = train(data_dir, tmp_path / "run", *KILL_RUN, "--resume", nproc=4, timeout=300)
    assert "resume: loaded" in resumed
    _same_final_checkpoint(whole_kill_run, tmp_path / "run", tmp_path)


def test_torchrun_max_restarts_resumes_automatically(data_dir, tmp_path, whole_kill_run):
    code, _, output = _kill_one_rank_after_checkpoint(data_dir, tmp_path / "run", "--resume", max_restarts=1)
    assert code == 0, output[-3000:]
    assert "resume: loaded" in output
    _same_final_checkpoint(whole_kill_run, tmp_path / "run", tmp_path)


# ---- NCCL (opt-in, one GPU per rank) and the exchange during backward ----------------------------
OVERLAP_RUN = ["--steps", "6", "--checkpoint-every", "6", "--log-every", "1", "--eval-every", "6"]


@pytest.mark.parametrize("backend, optimizer, replicate, shard", [
    ("gloo", "signmuon", 1, 1), ("nccl", "signmuon", 1, 1), ("nccl", "dion", 2, 1), ("nccl", "signmuon", 1, 2)],
    ids=["gloo_1rank", "nccl_1rank", "nccl_2ranks_dion_2x1", "nccl_2ranks_signmuon_1x2"])
def test_overlap_backward_on_and_off_are_bitwise_equal(data_dir, tmp_path, backend, optimizer, replicate, shard):
    """--overlap-backward off and on: every logged loss equal to its last digit and the final checkpoint
    (model and optimizer state) equal bit for bit. On NCCL under TORCH_CUDA_SANITIZER=1, so that a
    stream race of the work started during backward (FSDP2's reduce-scatter stream → the step's) stops
    the run with the sanitizer's report."""
    ranks, nccl = replicate * shard, backend == "nccl"
    if nccl:
        needs_nccl(ranks)
    for overlap in ("off", "on"):
        output = train(data_dir, tmp_path / overlap, "--optimizer", optimizer, "--replicate", str(replicate), "--shard",
                       str(shard), *OVERLAP_RUN, "--overlap-backward", overlap, nproc=ranks, nccl=nccl,
                       env={"TORCH_CUDA_SANITIZER": "1"} if nccl else None, timeout=300)
        assert f"shard × 1 tensor on {'cuda' if nccl else 'cpu'}" in output, output[-2000:]
    losses = lambda rows: [(r["step"], r["train_loss"], r["val_loss"]) for r in rows]
    assert len(metrics(tmp_path / "on")) == 7 and losses(metrics(tmp_path / "on")) == losses(metrics(tmp_path / "off"))
    _same_final_checkpoint(tmp_path / "off", tmp_path / "on", tmp_path, step=6)


def test_nccl_2ranks_dion_between_replicas_learns_and_counts_the_bytes_gloo_counts(data_dir, tmp_path, whole_runs):
    """Dion on 2 replicas over NCCL (2 GPUs): it learns as on gloo, and the communication layer counts
    the same replicate-axis bytes per step as the gloo run of the same mesh."""
    needs_nccl(2)
    output = train(data_dir, tmp_path, *DION, "--replicate", "2", "--shard", "1", nccl=True)
    assert "shard × 1 tensor on cuda" in output
    rows = assert_learns(tmp_path)
    assert [r["replicate_bytes_per_step"] for r in rows] == [r["replicate_bytes_per_step"] for r in metrics(whole_runs(2, 1))]
