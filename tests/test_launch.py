"""The multi-node launchers: launch/torchrun_multinode.sh, launch/slurm/*.sbatch.

The first test reads the torchrun command line the launcher builds from a SLURM environment (fake
`scontrol` and Python, no root, a second). The second runs launch/selftest_slurm.py: a two-node
SLURM cluster in two network namespaces on this machine, torchrun across them with and without
SLURM, FSDP and DeepSpeed (2-4 minutes). It needs root; CI runs it as root.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch" / "torchrun_multinode.sh"
SELFTEST = ROOT / "launch" / "selftest_slurm.py"
SELFTEST_TIMEOUT_S = 900


def fake_commands(tmp_path: Path) -> dict:
    """PATH with a `scontrol` that expands "n[1-2]", and a PYTHON that prints its arguments and some of its
    environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames n[1-2]" ] && printf "n1\\nn2\\n"\n')
    (bin_dir / "python").write_text('#!/bin/sh\nfor a in "$@"; do echo "arg $a"; done\n'
                                    'echo "env $OMP_NUM_THREADS $GLOO_SOCKET_IFNAME $NCCL_SOCKET_IFNAME"\n')
    for name in ("scontrol", "python"):
        (bin_dir / name).chmod(stat.S_IRWXU)
    settings = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC_PER_NODE", "RDZV_ID", "OMP_NUM_THREADS",
                "SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_") and key not in settings}
    return dict(env, PATH=f"{bin_dir}:{env['PATH']}", PYTHON=str(bin_dir / "python"))


def test_torchrun_multinode_takes_rendezvous_and_node_rank_from_slurm(tmp_path):
    env = dict(fake_commands(tmp_path), SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="n[1-2]", SLURM_NNODES="2",
               SLURM_NODEID="1", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NUM_NODES="2", SLURM_GPUS_ON_NODE="4",
               SLURM_CPUS_PER_TASK="32", SOCKET_IFNAME="eth7",
               MASTER_ADDR="localhost", NODE_RANK="0")   # left over from a single-node run: not used under SLURM
    out = subprocess.run([str(LAUNCHER), "train.py", "--steps", "3"], env=env, capture_output=True, text=True,
                         timeout=30, check=True).stdout
    args = [line[4:] for line in out.splitlines() if line.startswith("arg ")]
    assert args[:2] == ["-m", "torch.distributed.run"]
    assert {"--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=n1:21234",
            "--rdzv-id=1234", "--rdzv-conf=is_host=0,join_timeout=600", "--max-restarts=0"} <= set(args)
    assert args[-3:] == ["train.py", "--steps", "3"]
    assert "env 8 eth7 eth7" in out     # OMP_NUM_THREADS = 32 CPUs / 4 processes; both libraries on SOCKET_IFNAME

    env.update(SLURM_NODEID="0")
    out = subprocess.run([str(LAUNCHER), "train.py"], env=env, capture_output=True, text=True, timeout=30).stdout
    assert "arg --rdzv-conf=is_host=1,join_timeout=600" in out  # node 0 serves the rendezvous


def test_torchrun_multinode_refuses_several_tasks_per_node(tmp_path):
    env = dict(fake_commands(tmp_path), SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n[1-2]", SLURM_NNODES="2",
               SLURM_NODEID="0", SLURM_STEP_NUM_TASKS="16", SLURM_STEP_NUM_NODES="2")
    done = subprocess.run([str(LAUNCHER), "train.py"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "one task per node" in done.stderr


def test_torchrun_multinode_without_slurm_needs_master_addr(tmp_path):
    env = dict(fake_commands(tmp_path), NNODES="2", NODE_RANK="0")
    done = subprocess.run([str(LAUNCHER), "train.py"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert "set MASTER_ADDR" in done.stderr


def why_the_cluster_cannot_run() -> str | None:
    """Why this machine cannot hold the two-namespace cluster, or None if it can."""
    if os.geteuid() != 0:
        return "not root: the SLURM self-test creates network namespaces and runs SLURM daemons (CI runs it as root)"
    if not shutil.which("unshare") or subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode:
        return "network namespaces are unavailable here (`unshare --net true` fails), so `ip netns` cannot work"
    if not shutil.which("ip") and not shutil.which("apt-get"):
        return "`ip` (iproute2) is not installed and there is no apt-get to install it"
    return None


@pytest.mark.timeout(SELFTEST_TIMEOUT_S + 180)
def test_two_node_slurm_cluster_runs_torchrun_and_both_sbatch_scripts(tmp_path):
    reason = why_the_cluster_cannot_run()
    if reason:
        pytest.skip(reason)
    summary = tmp_path / "summary.json"
    process = subprocess.Popen([sys.executable, str(SELFTEST), "--summary", str(summary)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = process.communicate(timeout=SELFTEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.terminate()            # the self-test stops its cluster on SIGTERM
        out, _ = process.communicate(timeout=120)
        pytest.fail(f"the self-test ran past {SELFTEST_TIMEOUT_S} s:\n{out[-10000:]}")
    print(out)
    assert process.returncode == 0, out[-10000:]
    result = json.loads(summary.read_text())
    assert result["problems"] == []
    assert [run["exit_status"] for run in result["runs"]] == [0, 0, 0]
    for run in result["runs"]:
        assert [node["node_rank"] for node in run["nodes"]] == [0, 1], run
        assert run["loss_last"][1] < run["loss_first"][1], run
        assert run["link_bytes_node2_tx"] >= 20 * run["replicate_bytes_per_step"], run
