"""A NaN/inf gradient on one rank: every rank skips the step (or raises), and no state changes."""

import pytest
import torch
import torch.distributed as dist

import shardopt


def _train(algorithm, skip_batch, poison_step, nonfinite="skip"):
    """6 steps on a 2×2 HSDP mesh; at `poison_step` rank 1 writes inf into one gradient entry;
    the batch numbered `skip_batch` is left out entirely."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4))
    fully_shard(model, mesh=mesh["shard"])
    groups = shardopt.param_groups(model, algorithm, nonmatrix_options={"lr": 1e-2})
    cls = shardopt.Dion if algorithm == "dion" else shardopt.SignMuon
    kwargs = {"rank_fraction": 0.5} if algorithm == "dion" else {"lr": 1e-2}
    opt = cls(groups, replicate_mesh=mesh["replicate"], nonfinite=nonfinite, **kwargs)
    states_before = None
    error = None
    for batch in range(1, 7):
        if batch == skip_batch:
            continue
        generator = torch.Generator().manual_seed(100 * batch + dist.get_rank())
        x = torch.randn(6, 8, generator=generator)
        model(x).square().mean().backward()
        if batch == poison_step:
            if dist.get_rank() == 1:
                model[0].weight.grad.to_local()[0, 0] = float("inf")
            states_before = _snapshot(opt)
            try:
                opt.step()
            except FloatingPointError as raised:
                error = str(raised)
            assert _equal(_snapshot(opt), states_before)
        else:
            opt.step()
        opt.zero_grad()
    weights = [p.full_tensor() for p in model.parameters()]
    return {"weights": weights, "skipped": opt.skipped_steps, "error": error, "state": _snapshot(opt)}


def _snapshot(opt):
    return [{k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in s.items()}
            for s in opt.state.values()]


def _equal(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("algorithm", ["dion", "signmuon"])
def test_inf_on_one_rank_skips_step_everywhere_like_a_run_without_that_batch(pool4, algorithm):
    poisoned = pool4.run(_train, algorithm, None, 3)
    without = pool4.run(_train, algorithm, 3, None)
    for got, want in zip(poisoned, without):
        assert got["skipped"] == 1 and want["skipped"] == 0
        assert all(torch.equal(a, b) for a, b in zip(got["weights"], want["weights"]))
        assert _equal(got["state"], want["state"])


def test_nonfinite_raise_raises_on_every_rank_and_names_the_param(pool4):
    results = pool4.run(_train, "dion", None, 3, "raise")
    for rank, result in enumerate(results):
        assert result["error"] is not None and "no state was changed" in result["error"]
        # rank 1 holds the inf: it names the param; rank 3 holds rows of the same matrix but finite ones
        assert ("'0.weight'" in result["error"]) == (rank == 1)


def test_invalid_nonfinite_option_is_rejected():
    with pytest.raises(ValueError, match="Invalid nonfinite: 'ignore'"):
        shardopt.Dion([torch.nn.Parameter(torch.randn(4, 4))], nonfinite="ignore")


def _host_reads(opt, monkeypatch) -> int:
    """Device values one opt.step() reads back to the host: aten._local_scalar_dense (.item(), bool(t),
    int(t)) and Tensor.tolist (which reads a CPU tensor without a dispatch), the CPU step counters aside."""
    from torch.utils._python_dispatch import TorchDispatchMode
    counters = {state["step"].data_ptr() for state in opt.state.values()}
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda tensor: reads.append("tolist") or tolist(tensor))

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._local_scalar_dense and args[0].data_ptr() not in counters:
                reads.append(str(func))
            return func(*args, **(kwargs or {}))
    with Count():
        opt.step()
    return len(reads)


@pytest.mark.parametrize("algorithm", ["dion", "signmuon"])
def test_a_step_reads_the_device_once_also_when_it_skips_and_names_the_params(algorithm, monkeypatch, caplog):
    """One host sync per step (the agreed flag and this rank's non-finite params, read together), also on a
    skipped step with several bad params: not one read per param (shardopt/optim/agreement.py)."""
    params = [torch.nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(i))) for i in range(4)]
    opt = (shardopt.Dion if algorithm == "dion" else shardopt.SignMuon)(params, lr=1e-2)
    for param in params:
        param.grad = torch.ones_like(param)
    opt.step()
    assert _host_reads(opt, monkeypatch) == 1
    params[1].grad[0, 0], params[3].grad[2, 1] = float("nan"), float("inf")
    with caplog.at_level("WARNING", logger="shardopt"):
        assert _host_reads(opt, monkeypatch) == 1
    assert opt.skipped_steps == 1 and "params #1 of param group 0, #3 of param group 0" in caplog.text
