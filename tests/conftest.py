import os

import pytest

# Forked test workers run matmuls; a threaded OpenMP pool in a forked child can hang.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from workers import WorkerPool  # noqa: E402  (after the environment above: the workers inherit it)


@pytest.fixture(scope="module")
def pool2():
    """Two gloo workers, started once per test module that asks for them (tests/workers.py)."""
    pool = WorkerPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pools():
    """pools(M): gloo workers of M processes, each size started once per test module that asks."""
    made = {}

    def get(world_size):
        if world_size not in made:
            made[world_size] = WorkerPool(world_size)
        return made[world_size]

    yield get
    for pool in made.values():
        pool.close()


@pytest.fixture(scope="module")
def pool4():
    """Four gloo workers, started once per test module that asks for them."""
    pool = WorkerPool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def scenarios(request, tmp_path_factory):
    """The two ranks' results of tests/<SCENARIOS>.py under torchrun (SCENARIOS: a name the test module sets)."""
    from two_processes import run_scenarios
    return run_scenarios(request.module.SCENARIOS, tmp_path_factory.mktemp(request.module.SCENARIOS))


@pytest.fixture(scope="session")
def deepspeed_cpu_ops():
    """DeepSpeed's CPU accelerator compiles a small C++ op (its shared-memory comm) at the first deepspeed.comm
    init: about a minute on 2 cores, then cached in TORCH_EXTENSIONS_DIR. Built here, once, in the test process
    before a module's worker pool forks (a session fixture comes before module ones), so that no test's
    wall-clock bound pays for the compile on a fresh machine. Nothing to build where the accelerator has no
    such op."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops import __compatible_ops__
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and __compatible_ops__.get(builder.NAME, False):
        builder.load()
