"""A pool of gloo worker processes, started once per test module and reused by many tests.

    pool = WorkerPool(4)                 # 4 forked processes, process group initialized once
    results = pool.run(fn, arg1, ...)    # fn(arg1, ...) on every rank; list of return values by rank
    pool.close()

`fn` must be a module-level function (it is sent by name). Each run has a
wall-clock bound: if any rank raises or the bound passes, the pool is torn
down (ranks may be stuck in a collective) and the error is raised here with
every rank's traceback; the next `run` starts a fresh pool.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import tempfile
import time
import traceback

_CONTEXT = multiprocessing.get_context("fork")


def _worker(rank: int, world_size: int, store_path: str, timeout_s: float, conn) -> None:
    import sys

    import torch
    import torch.distributed as dist

    # Under pytest's capture sys.stderr is a file whose descriptor is not 2. Tools that silence a child
    # process by redirecting descriptor sys.stderr.fileno() then miss it: DeepSpeed's op-builder probe
    # links a test program against libaio (its NVMe-offload op; unused here), and `ld: cannot find -laio`
    # reached the captured output. Descriptor 2 is captured by pytest all the same.
    sys.stderr = sys.__stderr__
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    while True:
        message = conn.recv_bytes()
        if not message:
            break
        fn, args, kwargs = pickle.loads(message)
        try:
            reply = (True, fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
            reply = (False, f"rank {rank}:\n{traceback.format_exc()}")
        conn.send_bytes(pickle.dumps(reply))
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int, collective_timeout_s: float = 60.0):
        self.world_size = world_size
        self.collective_timeout_s = collective_timeout_s
        self.processes = []

    def _start(self) -> None:
        # Import once in the parent so forked workers do not each pay for it (torch.optim loads
        # torch._dynamo on first use: seconds per process).
        import torch._dynamo  # noqa: F401
        import torch.distributed.tensor  # noqa: F401
        self._tmp = tempfile.TemporaryDirectory(prefix="shardopt-pool-")
        store_path = os.path.join(self._tmp.name, "store")
        self.connections = []
        for rank in range(self.world_size):
            parent, child = _CONTEXT.Pipe()
            process = _CONTEXT.Process(target=_worker, args=(rank, self.world_size, store_path,
                                                             self.collective_timeout_s, child), daemon=True)
            process.start()
            self.processes.append(process)
            self.connections.append(parent)

    def run(self, fn, *args, timeout_s: float = 120.0, **kwargs) -> list:
        if not self.processes:
            self._start()
        message = pickle.dumps((fn, args, kwargs))
        for connection in self.connections:
            connection.send_bytes(message)
        deadline = time.monotonic() + timeout_s
        replies = [None] * self.world_size
        pending = set(range(self.world_size))
        while pending and time.monotonic() < deadline:
            for rank in list(pending):
                if self.connections[rank].poll(0.01):
                    replies[rank] = pickle.loads(self.connections[rank].recv_bytes())
                    pending.discard(rank)
                elif not self.processes[rank].is_alive():
                    replies[rank] = (False, f"rank {rank}: process died (exit code {self.processes[rank].exitcode})")
                    pending.discard(rank)
        failures = [reply[1] for reply in replies if reply is not None and not reply[0]]
        if pending or failures:
            self.close()
            hung = f"ranks {sorted(pending)} did not finish within {timeout_s:.0f} s\n" if pending else ""
            raise RuntimeError(f"{fn.__name__} failed on the worker pool:\n{hung}" + "\n".join(failures))
        return [reply[1] for reply in replies]

    def close(self) -> None:
        for connection, process in zip(self.connections if self.processes else [], self.processes):
            try:
                connection.send_bytes(b"")
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        self.processes = []
        if hasattr(self, "_tmp"):
            self._tmp.cleanup()
