#!/usr/bin/env python3
"""Self-test of the multi-node launchers on one Linux machine: a two-node SLURM cluster in network namespaces.

    sudo python launch/selftest_slurm.py [--keep] [--summary summary.json]     # 2-4 minutes; needs root

Run it with the Python that has torch, shardopt and DeepSpeed: the training processes use it too.
tests/test_launch.py runs it as a subprocess. In order:

  1. installs what is missing (apt-get: slurm-wlm slurmctld slurmd slurm-client munge iproute2;
     nothing if all are there), prepares the example data (integrations/data.py) and builds
     DeepSpeed's CPU communication op, both once and cached;
  2. two nodes: launch/netns/twonode.sh up: namespaces <prefix>1/2 with 10.77.0.1/2 on a veth pair
     limited to 100mbit by tc tbf;
  3. a SLURM cluster of the two: munged, slurmctld and one slurmd per node, started here, with key,
     socket, config, state and logs in one temporary directory;
  4. torchrun without SLURM: launch/torchrun_multinode.sh in each namespace (`ip netns exec`: one
     hostname for both, so LOCAL_ADDR is set), 20 steps of HSDP, --replicate 2 across the link and
     --shard 2 within each node;
  5. sbatch --nodes=2 launch/slurm/train_fsdp.sbatch, 20 steps, --replicate 2 across the link;
  6. sbatch --nodes=2 launch/slurm/train_deepspeed.sbatch, 20 steps of Dion (dion_bf16.json);

and checks every run: exit status 0, a torchrun on each node (under SLURM: on two different hosts),
the global ranks split between them, the loss falling over the 20 steps, and at least one replica's
worth of the optimizer's exchange counted on the wire (the veth's byte counters). Every wait has a
time limit. Whatever happens, it ends by stopping everything it started, by PID (the daemons, and
every process left in the two namespaces), deleting the namespaces and the temporary directory
(--keep keeps the directory: logs, slurm.conf). The daemons also die with this process if it is
killed outright (PR_SET_PDEATHSIG), and a small reaper process then clears the namespaces and the
temporary directory.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TWONODE = str(ROOT / "launch" / "netns" / "twonode.sh")
PACKAGES = ["slurm-wlm", "slurmctld", "slurmd", "slurm-client", "munge", "iproute2"]
COMMANDS = ["sbatch", "sinfo", "srun", "scontrol", "slurmctld", "slurmd", "munged", "ip", "tc"]
STEPS = 20
TINY_GPT = ["--steps", str(STEPS), "--n-layer", "2", "--n-embd", "64", "--batch-size", "8",
            "--log-every", "5", "--eval-every", "0", "--warmup", "2"]
RUN_TIMEOUT_S = 240          # each training run
started = time.monotonic()


def say(message: str) -> None:
    print(f"[selftest {time.monotonic() - started:5.0f} s] {message}", flush=True)


def die_with_parent() -> None:
    """In a child, before exec: have the kernel SIGKILL it when this process dies, however that happens."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG


def adopt_orphans() -> None:
    """Make this process the parent of its descendants' orphans (slurmd's slurmstepd forks twice), so
    that `reap_orphans` can collect them: an init that does not reap (as in many containers) would
    keep them as zombies."""
    ctypes.CDLL(None, use_errno=True).prctl(36, 1)               # PR_SET_CHILD_SUBREAPER


def reap_orphans() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:     # no children left
            return
        if pid == 0:                  # only live ones left
            return


def start_reaper(env: dict[str, str], work: Path | None) -> subprocess.Popen:
    """A process in its own session that, if this one ends without cleaning up (SIGKILL skips
    `finally`), runs `twonode.sh down` (which kills by PID what is left in the namespaces: torchrun's
    workers do not die with their agent) and removes `work`. It waits for end-of-file on a pipe whose
    write end only this process holds, open here until it exits. After a clean-up, kill it."""
    read_end, _ = os.pipe()
    reaper = subprocess.Popen(["sh", "-c", 'read -r _; "$0" down; [ -z "$1" ] || rm -rf "$1"', TWONODE,
                               str(work or "")], stdin=read_end, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    os.close(read_end)
    return reaper


def install(timeout: float) -> None:
    """apt-get install the packages that provide the missing commands; nothing if none is missing."""
    missing = [command for command in COMMANDS if not shutil.which(command)]
    if not missing:
        return
    say(f"installing {' '.join(PACKAGES)} (missing: {' '.join(missing)})")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    policy = Path("/usr/sbin/policy-rc.d")     # (where absent) keeps the packages from starting daemons
    own_policy = not policy.exists()
    if own_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True, timeout=timeout)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
                       env=env, check=True, timeout=timeout, stdout=subprocess.DEVNULL)
    finally:
        if own_policy:
            policy.unlink()


def training_env(python: str) -> dict[str, str]:
    """The environment of every command here, and (through sbatch) of the jobs."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    # where launch/env.sh caches DeepSpeed's JIT-built ops: built once, not in every run
    env.setdefault("SHARDOPT_CACHE", str(ROOT / ".cache"))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(env["SHARDOPT_CACHE"]) / "torch_extensions"))
    env.update(PYTHON=python, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               LOGLEVEL="INFO",        # torchrun logs each node's global ranks
               RDZV_TIMEOUT="120")
    return env


def wait_for(what: str, ready, timeout: float, interval: float = 0.25) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


class TwoNodeCluster:
    """The two namespaces, munged, slurmctld and two slurmd; `close()` stops all of it by PID."""

    def __init__(self, work: Path, env: dict[str, str]):
        self.work = work
        self.prefix = f"so{os.getpid()}n"          # namespaces, hostnames and SLURM node names
        self.env = dict(env, NETNS_PREFIX=self.prefix, NETNS_STATE=str(work / "netns"),
                        SLURM_CONF=str(work / "slurm.conf"))
        self.daemons: list[tuple[str, subprocess.Popen]] = []

    def host(self, n: int) -> str:
        return f"{self.prefix}{n}"

    def on_node(self, n: int, *command: str) -> list[str]:
        """`command`, run on node n: in its namespace, with its hostname and /etc/hosts."""
        return [TWONODE, "node", str(n), *command]

    def start(self, name: str, command: list[str]) -> None:
        with open(self.work / f"{name}.log", "w") as log:
            process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                       preexec_fn=die_with_parent)
        self.daemons.append((name, process))

    def up(self) -> None:
        subprocess.run([TWONODE, "up", "100mbit"], env=self.env, check=True, timeout=30)
        key, socket = self.work / "munge.key", self.work / "munge.socket"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        # --force: munged objects to its socket's directory being private (0700), which here is on purpose
        self.start("munged", ["munged", "--foreground", "--force", f"--socket={socket}", f"--key-file={key}",
                              f"--pid-file={self.work / 'munged.pid'}", f"--seed-file={self.work / 'munged.seed'}",
                              f"--log-file={self.work / 'munged.log'}"])
        wait_for("munged's socket", socket.exists, 15)
        (self.work / "slurm.conf").write_text(self.slurm_conf(socket))
        self.start("slurmctld", self.on_node(1, "slurmctld", "-D"))
        for n in (1, 2):
            (self.work / "spool" / self.host(n)).mkdir(parents=True)
            self.start(f"slurmd-{n}", self.on_node(n, "slurmd", "-D"))
        try:
            wait_for("both SLURM nodes idle", self.idle, 60, interval=0.5)
        except TimeoutError:
            for name, _ in self.daemons:
                print(f"---- {name}.log\n" + (self.work / f"{name}.log").read_text()[-3000:], flush=True)
            raise

    def slurm_conf(self, munge_socket: Path) -> str:
        work = self.work
        return "\n".join([
            "ClusterName=shardopt-selftest",
            f"SlurmctldHost={self.host(1)}(10.77.0.1)",
            "SlurmUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={munge_socket}", "CredType=cred/munge",
            # no systemd and no cgroup delegation in here: track job processes through /proc
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none", "ReturnToService=2", "SlurmdParameters=config_overrides",
            f"StateSaveLocation={work / 'state'}", f"SlurmdSpoolDir={work / 'spool' / '%n'}",
            f"SlurmctldPidFile={work / 'slurmctld.pid'}", f"SlurmdPidFile={work / 'slurmd-%n.pid'}",
            *(f"NodeName={self.host(n)} NodeAddr=10.77.0.{n} CPUs={os.cpu_count()} State=UNKNOWN" for n in (1, 2)),
            "PartitionName=selftest Nodes=ALL Default=YES MaxTime=10 State=UP",
        ]) + "\n"

    def idle(self) -> bool:
        states = subprocess.run(self.on_node(1, "sinfo", "--noheader", "--Node", "--format=%T"), env=self.env,
                                timeout=10, capture_output=True, text=True).stdout.split()
        return states == ["idle", "idle"]

    def link_bytes(self) -> tuple[int, int]:
        """(TX, RX) bytes of node 2's end of the link."""
        out = subprocess.run([TWONODE, "bytes", "2"], env=self.env, check=True, timeout=10,
                             capture_output=True, text=True).stdout.split()
        return int(out[0]), int(out[1])

    def close(self) -> None:
        for name, process in reversed(self.daemons):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    say(f"{name} (PID {process.pid}) ignored SIGTERM; SIGKILL")
                    process.kill()
                    process.wait(10)
        # deletes what there is of the namespaces, after ending by PID whatever is left in them (job steps, torchruns)
        subprocess.run([TWONODE, "down"], env=self.env, timeout=60)


# ---- the three runs: each returns (exit status, its log with every line labelled by node) ------------
def torchrun_without_slurm(cluster: TwoNodeCluster) -> tuple[int, str]:
    """HSDP, 2 replicas × 2 shards: one torchrun per namespace with 2 processes (one replica) each."""
    processes = []
    for n in (1, 2):
        env = dict(cluster.env, MASTER_ADDR="10.77.0.1", NNODES="2", NODE_RANK=str(n - 1),
                   LOCAL_ADDR=f"10.77.0.{n}", NPROC_PER_NODE="2")
        with open(cluster.work / f"torchrun-node{n}.log", "w") as log:
            processes.append(subprocess.Popen(
                ["ip", "netns", "exec", cluster.host(n), str(ROOT / "launch" / "torchrun_multinode.sh"),
                 "integrations/fsdp/train.py", "--replicate", "2", "--shard", "2", "--optimizer", "dion",
                 *TINY_GPT, "--out-dir", str(cluster.work / "runs" / "torchrun")],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            say(f"torchrun (PID {process.pid}) still running after {RUN_TIMEOUT_S} s; SIGKILL")
            process.kill()
            codes.append(process.wait(10))
    logs = [(cluster.work / f"torchrun-node{n}.log").read_text() for n in (1, 2)]
    labelled = "\n".join(f"{node}: {line}" for node, log in enumerate(logs) for line in log.splitlines())
    return next((code for code in codes if code), 0), labelled


def sbatch(cluster: TwoNodeCluster, script: str, *arguments: str) -> tuple[int, str]:
    """`sbatch --nodes=2 script arguments`, submitted on node 1, then `scontrol show job` until it has
    ended (sbatch --wait polls at 2, 10, 42 s: too coarse here). srun --label labels the log by node."""
    submitted = subprocess.run(
        cluster.on_node(1, "sbatch", "--parsable", "--nodes=2", f"--time={RUN_TIMEOUT_S // 60}",
                        f"--output={cluster.work / Path(script).stem}-%j.out", script, *arguments),
        cwd=ROOT, env=cluster.env, timeout=30, check=True, capture_output=True, text=True)
    job = submitted.stdout.strip().split(";")[0]
    fields = {}

    def ended() -> bool:
        shown = subprocess.run(cluster.on_node(1, "scontrol", "--oneliner", "show", "job", job), env=cluster.env,
                               timeout=10, capture_output=True, text=True).stdout
        fields.update(re.findall(r"(\w+)=(\S*)", shown))
        return fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING")

    try:   # SLURM itself ends the job at --time
        wait_for(f"job {job} ({script})", ended, RUN_TIMEOUT_S + 60, interval=0.5)
        code, signal_number = (int(part) for part in fields["ExitCode"].split(":"))
        exit_status = code or (128 + signal_number if signal_number else 0) or int(fields["JobState"] != "COMPLETED")
    except TimeoutError as timeout:
        say(str(timeout))
        exit_status = 124
    say(f"{script}: job {job} {fields.get('JobState')}, exit code {fields.get('ExitCode')}")
    logs = sorted(cluster.work.glob(f"{Path(script).stem}-*.out"))
    return exit_status, "".join(path.read_text() for path in logs)


# ---- reading a run's log -------------------------------------------------------------------------
LABEL = re.compile(r"^(\d+): ")
NODE_LINE = re.compile(r"torchrun_multinode: node (\d+) of \d+ on (\S+):")
RANKS_LINE = re.compile(r"global_ranks=\[([\d, ]*)\]")
# rank 0's step lines: FSDP "step 5/20: train loss 5.1531, ..., replicate 214,272 B/step, ..."
# and DeepSpeed "step     5 | loss 4.0123 | lr ... | sent    12,345 B"
LOSS_LINE = re.compile(r"step\s+(\d+)(?:/\d+: train|\s+\|) loss ([\d.]+)")
REPLICATE_BYTES = re.compile(r"(?:replicate|sent)\s+([\d,]+) B")


def read_log(text: str) -> dict:
    """Per node: its node rank, host and global ranks; rank 0's (step, loss) and replicate bytes per step."""
    nodes, losses, replicate = {}, [], None
    for line in text.splitlines():
        label = LABEL.match(line)
        node = nodes.setdefault(label.group(1) if label else "", {"node_rank": None, "host": None, "global_ranks": []})
        if found := NODE_LINE.search(line):
            node.update(node_rank=int(found.group(1)), host=found.group(2))
        if found := RANKS_LINE.search(line):
            node["global_ranks"] = [int(rank) for rank in found.group(1).split(",") if rank.strip()]
        if found := LOSS_LINE.search(line):
            losses.append((int(found.group(1)), float(found.group(2))))
            if found := REPLICATE_BYTES.search(line):
                replicate = int(found.group(1).replace(",", ""))
    return {"nodes": sorted((node for node in nodes.values() if node["node_rank"] is not None),
                            key=lambda node: node["node_rank"]),
            "losses": losses, "replicate_bytes_per_step": replicate}


def check(run: dict, world: int, distinct_hosts: bool) -> list[str]:
    problems = []
    if run["exit_status"] != 0:
        problems.append(f"exit status {run['exit_status']}")
    nodes = run["nodes"]
    if [node["node_rank"] for node in nodes] != [0, 1]:
        problems.append(f"expected a torchrun on node 0 and on node 1, saw {nodes}")
    if distinct_hosts and len({node["host"] for node in nodes}) != 2:
        problems.append(f"expected two different hosts, saw {[node['host'] for node in nodes]}")
    ranks = sorted(rank for node in nodes for rank in node["global_ranks"])
    if ranks != list(range(world)) or not all(node["global_ranks"] for node in nodes):
        problems.append(f"expected the global ranks 0..{world - 1} split over both nodes, saw {nodes}")
    first, last = run["loss_first"], run["loss_last"]
    if last is None or last[0] != STEPS:
        problems.append(f"no loss reported for step {STEPS} (last: {last})")
    elif not last[1] < first[1]:
        problems.append(f"the loss did not fall: {first} -> {last}")
    per_step, sent = run["replicate_bytes_per_step"], run["link_bytes_node2_tx"]
    if per_step is None:
        problems.append("no replicate bytes per step in the log")
    elif sent < STEPS * per_step:
        problems.append(f"node 2 sent {sent:,} B over the link: less than one replica's exchange, "
                        f"{STEPS} steps × {per_step:,} B")
    return problems


def measure(cluster: TwoNodeCluster, name: str, launch) -> dict:
    """Run `launch`, and what its log and the link's byte counters say about it."""
    say(f"{name} ...")
    tx_before, rx_before = cluster.link_bytes()
    tick = time.monotonic()
    exit_status, text = launch()
    wall = time.monotonic() - tick
    tx, rx = cluster.link_bytes()
    (cluster.work / f"{name.split(':')[0].replace(' ', '_')}.log").write_text(text)
    parsed = read_log(text)
    losses = parsed["losses"]
    return {"run": name, "exit_status": exit_status, "wall_s": round(wall, 1), "nodes": parsed["nodes"],
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
            "replicate_bytes_per_step": parsed["replicate_bytes_per_step"],
            "link_bytes_node2_tx": tx - tx_before, "link_bytes_node2_rx": rx - rx_before, "log": text}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, slurm.conf)")
    parser.add_argument("--summary", type=Path, help="write the measurements to this JSON file")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the training processes")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("selftest_slurm: needs root (network namespaces, SLURM daemons)", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):   # end through `finally`, which cleans up
        signal.signal(sig, lambda number, frame: sys.exit(128 + number))

    adopt_orphans()
    install(timeout=300)
    env = training_env(args.python)
    subprocess.run([args.python, str(ROOT / "integrations" / "data.py")], env=env, check=True, timeout=300)
    built = subprocess.run([args.python, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                           env=env, timeout=600, stdout=subprocess.DEVNULL)
    if built.returncode:
        say("could not build DeepSpeed's shared-memory op ahead; the DeepSpeed run will try (and take longer)")
    work = Path(tempfile.mkdtemp(prefix="shardopt-selftest-"))
    cluster = TwoNodeCluster(work, env)
    reaper = start_reaper(cluster.env, None if args.keep else work)
    runs = [   # (name, world size, under SLURM, launch)
        ("torchrun without SLURM: HSDP 2 replicate x 2 shard", 4, False,
         lambda: torchrun_without_slurm(cluster)),
        ("sbatch train_fsdp.sbatch: 2 replicate x 1 shard", 2, True,
         lambda: sbatch(cluster, "launch/slurm/train_fsdp.sbatch", "--replicate", "2", "--shard", "1",
                        "--optimizer", "dion", *TINY_GPT, "--out-dir", str(work / "runs" / "fsdp"))),
        ("sbatch train_deepspeed.sbatch: dion_bf16.json", 2, True,
         lambda: sbatch(cluster, "launch/slurm/train_deepspeed.sbatch",
                        "--deepspeed_config", "integrations/deepspeed/dion_bf16.json", "--steps", str(STEPS))),
    ]
    results, problems = [], []
    try:
        say(f"two nodes {cluster.host(1)} (10.77.0.1) and {cluster.host(2)} (10.77.0.2); SLURM and munge in {work}")
        cluster.up()
        say("SLURM: both nodes idle")
        for name, world, under_slurm, launch in runs:
            result = measure(cluster, name, launch)
            found = check(result, world, distinct_hosts=under_slurm)
            log = result.pop("log")
            results.append(result)
            problems += [f"{name}: {problem}" for problem in found]
            say(f"{name}: exit {result['exit_status']}, {result['wall_s']:.0f} s; "
                + "; ".join(f"node {node['node_rank']} on {node['host']}: ranks {node['global_ranks']}"
                            for node in result["nodes"])
                + f"; loss {result['loss_first']} -> {result['loss_last']} (step, loss); node 2 sent "
                  f"{result['link_bytes_node2_tx']:,} B, received {result['link_bytes_node2_rx']:,} B on the link")
            if found:
                print("\n".join(f"  FAILED: {problem}" for problem in found) + "\n---- log (end)\n" + log[-6000:],
                      flush=True)
    except BaseException as error:
        problems.append(f"stopped by {type(error).__name__}: {error}")
        raise
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)     # let the clean-up finish
        say("stopping the cluster")
        cluster.close()
        reaper.kill()
        reaper.wait()
        reap_orphans()
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
        if args.summary:
            args.summary.write_text(json.dumps({"runs": results, "problems": problems,
                                                "wall_s": round(time.monotonic() - started, 1)}, indent=2) + "\n")
    say(f"{'FAILED' if problems else 'passed'}: {len(results)} runs")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
