"""fp16 AMP under a GradScaler with local gradients: an inf on one replica skips the step on every replica, the loss
scales stay equal and the replicas identical (shardopt/frameworks/gradscaler.py). A power-of-two scale makes the
unscaled gradients exact, so the run equals, bitwise, the run that leaves that batch out."""

import warnings

import pytest
import torch
import torch.distributed as dist

import shardopt

POISON_STEP = 1   # the second step (0, 1, …): rank 0's gradient holds an inf


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4))


def _optimizer(model, overlap_backward=False):
    groups = shardopt.param_groups(model, "signmuon", "lion", nonmatrix_options={"lr": 1e-2})
    return shardopt.SignMuon(groups, lr=1e-2, replicate_mesh=dist.group.WORLD, overlap_backward=overlap_backward)


def _batches(leave_out):
    for step in range(5):
        if step != leave_out:
            generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
            yield step, torch.randn(6, 8, generator=generator)


def _result(model, opt, scales):
    return {"weights": [p.detach().clone() for p in model.parameters()], "scales": scales,
            "skipped": opt.skipped_steps, "consistent": opt.replicas_consistent(),
            "state": [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]}


def _plain(poison, unscale_first=False, overlap_backward=False):
    """A plain GradScaler loop (torch's recipe); `poison`: rank 0 writes an inf at POISON_STEP, else that
    batch is left out. unscale_first: the user unscales before step (as before clipping)."""
    model = _model()
    opt = _optimizer(model, overlap_backward)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scales = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # torch: the grad_scaler keyword is being deprecated
        for step, x in _batches(None if poison else POISON_STEP):
            scaler.scale(model(x).square().mean()).backward()
            if step == POISON_STEP and dist.get_rank() == 0:
                model[0].weight.grad[0, 0] = float("inf")
            if unscale_first:
                scaler.unscale_(opt)
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            if step == POISON_STEP:   # skipped on every rank: nothing moved
                assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            scales.append(scaler.get_scale())
            opt.zero_grad()
    return _result(model, opt, scales)


def _assert_like_a_run_without_that_batch(poisoned, without):
    for got, want in zip(poisoned, without):
        assert got["skipped"] == 1 and want["skipped"] == 0
        assert got["consistent"] and want["consistent"]
        assert all(torch.equal(a, b) for a, b in zip(got["weights"], want["weights"]))
        assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                   for a, b in zip(got["state"], want["state"]))
    assert poisoned[0]["scales"] == poisoned[1]["scales"]                  # the scales stay equal
    assert poisoned[0]["scales"][POISON_STEP] == 2.0**11                   # and backed off on both ranks
    assert all(torch.equal(a, b) for a, b in zip(poisoned[0]["weights"], poisoned[1]["weights"]))


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step_unscales", "user_unscales"])
def test_gradscaler_inf_on_one_rank_skips_everywhere_and_keeps_scales_equal(pool2, unscale_first):
    _assert_like_a_run_without_that_batch(pool2.run(_plain, True, unscale_first),
                                          pool2.run(_plain, False, unscale_first))


def test_gradscaler_with_overlap_backward_skips_everywhere(pool2):
    _assert_like_a_run_without_that_batch(pool2.run(_plain, True, False, True), pool2.run(_plain, False))


def _accelerate(poison):
    """Accelerate's fp16 door as on a GPU (accelerator.backward scales, the prepared optimizer's step runs
    GradScaler.step through Accelerate's patched step, then update), with a CPU GradScaler: Accelerate makes
    none on the CPU (fp16 mixed precision there gives it no scaler), so the test hands it one."""
    import os
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    import shardopt.accelerate
    AcceleratorState._reset_state(reset_partial_state=True)   # a worker forked after another module's Accelerate
    os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29599")   # (the pool's process group exists already)
    accelerator = Accelerator(cpu=True)
    model = _model()
    opt = _optimizer(model)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    ddp_model, prepared = accelerator.prepare(model, opt)
    shardopt.accelerate.attach(accelerator, ddp_model, prepared)
    scales, skipped = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for step, x in _batches(None if poison else POISON_STEP):
            accelerator.backward(ddp_model(x).square().mean())
            if step == POISON_STEP and dist.get_rank() == 0:
                model[0].weight.grad[0, 0] = float("inf")
            prepared.step()
            scales.append(accelerator.scaler.get_scale())
            skipped.append(prepared.step_was_skipped)
            prepared.zero_grad()
    return {**_result(model, opt, scales), "step_was_skipped": skipped}


def test_accelerate_fp16_door_skips_everywhere_and_keeps_scales_equal(pool2):
    poisoned, without = pool2.run(_accelerate, True), pool2.run(_accelerate, False)
    _assert_like_a_run_without_that_batch(poisoned, without)
    for result in poisoned:
        assert result["step_was_skipped"] == [False, True, False, False, False]


def test_a_wrapper_hiding_the_grad_scaler_keyword_is_refused():
    model = _model()
    opt = shardopt.SignMuon(shardopt.param_groups(model, "signmuon", "lion", nonmatrix_options={"lr": 1e-2}), lr=1e-2)
    step = opt.step
    opt.step = lambda *args, **kwargs: step(*args, **kwargs)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 8)).sum()).backward()
    with pytest.raises(RuntimeError, match="hides the grad_scaler keyword"):
        scaler.step(opt)
