"""shardopt.LocalSteps (docs/design.md §10) through the user's door: 2 replicas on the gloo pool with
plain params, 2 replicas × 2 FSDP2 shards on the pool of 4. Bytes per sync are counted by the comm
layer and compared with reference.outer_bytes (the formulas, not the code); inner steps send nothing
on the replicate axis; replicas are bitwise equal after every sync; checked against float64
references of the outer loop; error feedback telescopes; a non-finite round is discarded everywhere;
kill-and-resume is bit-exact mid-round, at a sync and with an exchange in flight.
"""

import io

import pytest
import torch

import reference
import shardopt
from shardopt.wire.comm import collective_bytes
from shardopt.optim.guard import bit_hash
from shardopt.localsteps.formats import EXCHANGES

SHAPES = [(8, 6), (5,), (4, 4)]
NUMEL = sum(torch.Size(shape).numel() for shape in SHAPES)
BLOCK = 16
INNER_LR = 0.1
CHECK_BYTES = collective_bytes("all_reduce", 24, 2)   # the double-averaging check before the first inner step


# ---- helpers run on every rank ----------------------------------------------------------------------
def _params():
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for shape in SHAPES]


def _gradients(step, replica, dtype=torch.float32):
    generator = torch.Generator().manual_seed(1000 * step + replica)
    return [torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype) for shape in SHAPES]


def _inner(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=INNER_LR)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01)
    return shardopt.SignMuon([{"params": [p for p in params if p.ndim == 2]},
                              {"params": [p for p in params if p.ndim != 2], "algorithm": "lion"}], lr=0.01)


def _local_steps(kind, params, **options):
    import torch.distributed as dist
    options = {"sync_every": 2, "block": BLOCK, **options}
    return shardopt.LocalSteps(_inner(kind, params), replicate_mesh=dist.group.WORLD, **options)


def _rank():
    import torch.distributed as dist
    return dist.get_rank()


def _set_gradients(params, step, replica, poison=False):
    for param, grad in zip(params, _gradients(step, replica)):
        param.grad = torch.full_like(grad, float("nan")) if poison else grad


def _hash(tensors):
    return int(bit_hash(torch.cat([t.detach().reshape(-1).float() for t in tensors])))


# ---- workers ------------------------------------------------------------------------------------
def _bytes_per_step(exchange, steps=6, **options):
    """Replicate bytes of each step and whether the replicas are equal after it, for one format."""
    params = _params()
    opt = _local_steps("sgd", params, exchange=exchange, **{"sync_every": 3, **options})
    sent, consistent = [], []
    for step in range(1, steps + 1):
        _set_gradients(params, step, _rank())
        opt.step()
        sent.append(opt.comm_stats()["replicate"]["bytes_sent"])
        opt.reset_comm_stats()
        consistent.append(opt.replicas_consistent())
        opt.reset_comm_stats()
    return {"sent": sent, "consistent": consistent, "format_bytes": opt.sync_bytes()}


def _every_format():
    return {exchange: _bytes_per_step(exchange) for exchange in EXCHANGES}


def _auto_and_the_one_bit_formats(steps=6):
    """The params' hash after `steps` steps (sync every 3) with "auto" and with each 1-bit format, on every replica
    of this pool; the "auto" optimizer's describe()."""
    hashes = {}
    for exchange in ("auto", "sign_mean", "sign_vote"):
        params = _params()
        opt = _local_steps("sgd", params, exchange=exchange, sync_every=3)
        for step in range(1, steps + 1):
            _set_gradients(params, step, _rank())
            opt.step()
        hashes[exchange] = _hash(params)
        if exchange == "auto":
            hashes["describe"] = opt.describe()
    return hashes


def _mean_one_step_rounds(steps):
    params = _params()
    opt = _local_steps("sgd", params, sync_every=1, exchange="mean", outer_lr=1.0, outer_momentum=0.0)
    for step in range(1, steps + 1):
        _set_gradients(params, step, _rank())
        opt.step()
    return [p.detach().double() for p in params]


def _error_feedback(exchange, steps, **options):
    """At each sync: Δ (θ_outer − θ after the inner step), e before and after; returns them flat."""
    params = _params()
    opt = _local_steps("sgd", params, exchange=exchange, **options)
    after_inner = {}
    inner_step = opt.inner.step

    def recording_step(closure=None):
        inner_step(closure)
        after_inner["theta"] = torch.cat([p.detach().reshape(-1).clone() for p in params])
    opt.inner.step = recording_step
    rounds = []
    for step in range(1, steps + 1):
        _set_gradients(params, step, _rank())
        if step > 1 and step % 2 == 0:
            outer = torch.cat([opt.state[p]["outer_params"].reshape(-1).clone() for p in params])
            error = torch.cat([opt.state[p]["outer_error"].reshape(-1).clone() for p in params])
            opt.step()
            rounds.append({"delta": outer - after_inner["theta"], "error_before": error,
                           "error_after": torch.cat([opt.state[p]["outer_error"].reshape(-1).clone() for p in params])})
        else:
            opt.step()
    return rounds


def _nonfinite_round():
    params = _params()
    opt = _local_steps("sgd", params, exchange="int8")
    saved = None
    for step in range(1, 7):
        _set_gradients(params, step, _rank(), poison=step == 4 and _rank() == 1)
        opt.step()
        if step == 2:
            saved = [p.detach().clone() for p in params]
        if step == 4:
            after_discard = [p.detach().clone() for p in params]
    return {"reset": all(torch.equal(a, b) for a, b in zip(saved, after_discard)), "discarded": opt.discarded_rounds,
            "finite": all(bool(torch.isfinite(p).all()) for p in params), "consistent": opt.replicas_consistent(),
            "hash": _hash(params)}


def _resume(kind, stop, total, **options):
    """Hashes of the params after `total` steps straight, and after `stop` steps, a state dict through
    torch.save, a new optimizer over new params, and the rest."""
    params = _params()
    opt = _local_steps(kind, params, **options)
    for step in range(1, total + 1):
        _set_gradients(params, step, _rank())
        opt.step()
    straight = _hash(params)
    params = _params()
    opt = _local_steps(kind, params, **options)
    for step in range(1, stop + 1):
        _set_gradients(params, step, _rank())
        opt.step()
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    for step in range(stop + 1, total + 1):   # the saved optimizer itself goes on as if nothing happened
        _set_gradients(params, step, _rank())
        opt.step()
    kept_going = _hash(params)
    params = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    opt = _local_steps(kind, params, **options)
    opt.load_state_dict(saved["optimizer"])
    for step in range(stop + 1, total + 1):
        _set_gradients(params, step, _rank())
        opt.step()
    return {"straight": straight, "resumed": _hash(params), "kept_going": kept_going,
            "consistent": opt.replicas_consistent()}


def _overlap_mean(steps):
    params = _params()
    opt = _local_steps("sgd", params, sync_every=1, exchange="mean", outer_lr=1.0, outer_momentum=0.0, overlap=True)
    outer_equal = []
    for step in range(1, steps + 1):
        _set_gradients(params, step, _rank())
        opt.step()
        outer_equal.append(opt.replicas_consistent())
    return {"params": [p.detach().double() for p in params], "outer_equal": outer_equal}


def _fragments(fragments):
    return _bytes_per_step("sign_vote", steps=8, sync_every=4, fragments=fragments, double_averaging_check=False)


def _stop_off_a_sync(steps, sync_every, **options):
    """`steps` steps with `sync_every` (the last not a sync step), then sync_now twice; the replicate bytes of
    each call, what it synced, the replicas' equality before and after, the params (float64) and whether they
    equal θ_outer; then two more steps, to the next scheduled sync."""
    params = _params()
    opt = _local_steps("sgd", params, sync_every=sync_every, **options)
    for step in range(1, steps + 1):
        _set_gradients(params, step, _rank())
        opt.step()
    before, hash_before = opt.replicas_consistent(), _hash(params)
    sent, synced = [], []
    for _ in range(2):
        opt.reset_comm_stats()
        synced.append(opt.sync_now())
        sent.append(opt.comm_stats()["replicate"]["bytes_sent"])
    equal_outer = all(torch.equal(p.detach(), opt.state[p]["outer_params"]) for p in params)
    after, final = opt.replicas_consistent(), [p.detach().double() for p in params]
    for step in range(steps + 1, steps + 3):
        _set_gradients(params, step, _rank())
        opt.step()
    return {"before": before, "after": after, "sent": sent, "synced": synced, "params": final,
            "equal_outer": equal_outer, "format_bytes": opt.sync_bytes(), "hash": _hash(params), "hash_before": hash_before,
            "consistent_later": opt.replicas_consistent()}


def _double_averaged_step():
    """A DDP model (gradients all-reduced over both replicas) under LocalSteps with AdamW: the error at step 1,
    params and optimizer state untouched, the check's bytes counted."""
    import torch.distributed as dist
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(6, 4))
    opt = shardopt.LocalSteps(torch.optim.AdamW(model.parameters(), lr=0.01), replicate_mesh=dist.group.WORLD,
                              sync_every=4, exchange="sign_mean")
    model(torch.randn(3, 6, generator=torch.Generator().manual_seed(_rank()))).square().sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
        error = None
    except shardopt.DoubleAveragingError as raised:
        error = str(raised)
    return {"error": error, "steps": opt.steps, "inner_state": len(opt.inner.state), "outer_state": len(opt.state),
            "unchanged": all(torch.equal(a, p) for a, p in zip(before, model.parameters())),
            "sent": opt.comm_stats()["replicate"]["bytes_sent"]}


def _refused(kind):
    import torch.distributed as dist
    params = _params()
    try:
        if kind == "inner":
            shardopt.LocalSteps(shardopt.SignMuon(params[:1], lr=0.01, replicate_mesh=dist.group.WORLD),
                                replicate_mesh=dist.group.WORLD, sync_every=2)
        else:
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
            shardopt.LocalSteps(torch.optim.SGD(model.parameters(), lr=0.1), replicate_mesh=dist.group.WORLD,
                                sync_every=2, model=model)
    except ValueError as error:
        return str(error)
    return None


# ---- tests --------------------------------------------------------------------------------------
def test_every_format_counts_its_formula_sends_nothing_between_syncs_and_keeps_replicas_equal(pool2):
    results = pool2.run(_every_format)
    for exchange in EXCHANGES:
        if exchange == "lowrank":   # the two matrices by their factors, the vector by sign_vote
            expected = reference.outer_bytes(exchange, 5, 2, BLOCK, matrices=[(8, 6), (4, 4)])
        else:
            expected = reference.outer_bytes(exchange, NUMEL, 2, BLOCK)
        for rank in range(2):
            result = results[rank][exchange]
            assert result["format_bytes"] == [expected], exchange
            assert result["sent"] == [CHECK_BYTES, 0, expected, 0, 0, expected], (exchange, result["sent"])
            assert result["consistent"][2] and result["consistent"][5], exchange
        assert not all(results[0][exchange]["consistent"]), f"{exchange}: replicas drift between syncs"


@pytest.mark.parametrize("pool, replicas, runs_as, other", [("pool2", 2, "sign_mean", "sign_vote"),
                                                            ("pool4", 4, "sign_vote", "sign_mean")])
def test_auto_runs_sign_mean_at_two_replicas_and_sign_vote_from_three(request, pool, replicas, runs_as, other):
    for result in request.getfixturevalue(pool).run(_auto_and_the_one_bit_formats):
        assert result["auto"] == result[runs_as] != result[other], result
        assert f"exchange 'auto' ('{runs_as}' at {replicas} replicas)" in result["describe"], result["describe"]


def test_mean_every_step_with_outer_lr_one_is_data_parallel_sgd(pool2):
    steps = 3
    results = pool2.run(_mean_one_step_rounds, steps)
    theta = [p.detach().double() for p in _params()]
    for step in range(1, steps + 1):
        grads = [_gradients(step, replica, torch.float64) for replica in range(2)]
        theta = [t - INNER_LR * (g0 + g1) / 2 for t, g0, g1 in zip(theta, *grads)]
    for rank in range(2):
        for got, want in zip(results[rank], theta):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _sign_vote_compressed(x):
    blocks = torch.nn.functional.pad(x, (0, -x.numel() % BLOCK)).view(-1, BLOCK)
    counts = torch.full((blocks.shape[0],), float(BLOCK))
    counts[-1] = x.numel() - BLOCK * (blocks.shape[0] - 1)
    return torch.sign(x) * (blocks.abs().sum(1) / counts).repeat_interleave(BLOCK)[:x.numel()]


def _int4_compressed(x):
    blocks = torch.nn.functional.pad(x, (0, -x.numel() % (2 * BLOCK))).view(-1, BLOCK)
    scale = blocks.abs().amax(1, keepdim=True) / 7
    return (torch.clamp(torch.round(blocks / scale), -7, 7) * scale).reshape(-1)[:x.numel()]


def _sign_mean_compressed(x):
    return torch.where(x > 0, 1.0, -1.0) * _sign_vote_compressed(x).abs()


TOPK_DENSITY = 0.25   # 4 of each block of 16


def _topk_compressed(x):
    """Per block of 16 the 4 largest |x|, each sent as ±s (|x| ≥ ¾·s) or ±s/2, s the block's max |x|; 0 elsewhere."""
    blocks = torch.nn.functional.pad(x, (0, -x.numel() % BLOCK)).view(-1, BLOCK)
    out = torch.zeros_like(blocks)
    for row, block in enumerate(blocks):
        s = float(block.abs().max())
        for i in sorted(range(BLOCK), key=lambda i: -abs(float(block[i])))[:4]:
            magnitude = s if abs(float(block[i])) >= 0.75 * s else s / 2
            out[row, i] = magnitude if block[i] > 0 else -magnitude
    return out.reshape(-1)[:x.numel()]


@pytest.mark.parametrize("exchange, compressed", [("sign_vote", _sign_vote_compressed), ("int4", _int4_compressed),
                                                  ("sign_mean", _sign_mean_compressed), ("topk", _topk_compressed)])
def test_error_feedback_keeps_what_the_wire_dropped_and_telescopes(pool2, exchange, compressed):
    results = pool2.run(_error_feedback, exchange, 6, density=TOPK_DENSITY)
    for rounds in results:
        assert len(rounds) == 3
        for sync in rounds:
            x = sync["delta"] + sync["error_before"]
            torch.testing.assert_close(sync["error_after"], x - compressed(x), rtol=0, atol=1e-6)
        sent = sum(sync["delta"] + sync["error_before"] - sync["error_after"] for sync in rounds)
        torch.testing.assert_close(sent + rounds[-1]["error_after"], sum(sync["delta"] for sync in rounds),
                                   rtol=0, atol=1e-5)


def _sign_mean_syncs(steps, exchange="sign_mean", **options):
    """Each sync (every step, outer lr 1, no momentum) on both replicas: θ_outer and e before it (the
    initial params and 0 at the first), this replica's gradient, θ_outer after it."""
    params = _params()
    opt = _local_steps("sgd", params, sync_every=1, exchange=exchange, outer_lr=1.0, outer_momentum=0.0, **options)

    def flat(key):
        return torch.cat([opt.state[p][key].reshape(-1).clone() for p in params])
    syncs = []
    for step in range(1, steps + 1):
        _set_gradients(params, step, _rank())
        before = (flat("outer_params"), flat("outer_error")) if opt.state else \
            (torch.cat([p.detach().reshape(-1).clone() for p in params]), torch.zeros(NUMEL))
        opt.step()
        syncs.append({"outer_before": before[0], "error_before": before[1], "outer_after": flat("outer_params"),
                      "grad": torch.cat([g.reshape(-1) for g in _gradients(step, _rank())])})
    return syncs


def test_sign_mean_moves_by_the_mean_of_both_replicas_scaled_signs(pool2):
    """θ_outer ← θ_outer − (c(x_0) + c(x_1))/2 with c the scaled sign and x_r = lr·g_r + e_r (one inner
    SGD step per round): no vote, no coin."""
    results = pool2.run(_sign_mean_syncs, 3)
    for sync in range(3):
        x = [INNER_LR * results[r][sync]["grad"] + results[r][sync]["error_before"] for r in range(2)]
        want = results[0][sync]["outer_before"] - (_sign_mean_compressed(x[0]) + _sign_mean_compressed(x[1])) / 2
        for rank in range(2):
            torch.testing.assert_close(results[rank][sync]["outer_after"], want, rtol=0, atol=1e-6)


def test_topk_moves_by_the_mean_of_both_replicas_decoded_picks_bitwise_equal(pool2):
    """θ_outer ← θ_outer − (c(x_0) + c(x_1))/2 with c the top-k compressor (_topk_compressed), the same
    bits on both replicas."""
    results = pool2.run(_sign_mean_syncs, 3, "topk", density=TOPK_DENSITY)
    for sync in range(3):
        x = [INNER_LR * results[r][sync]["grad"] + results[r][sync]["error_before"] for r in range(2)]
        want = results[0][sync]["outer_before"] - (_topk_compressed(x[0]) + _topk_compressed(x[1])) / 2
        assert torch.equal(results[0][sync]["outer_after"], results[1][sync]["outer_after"])
        torch.testing.assert_close(results[0][sync]["outer_after"], want, rtol=0, atol=1e-6)


def test_nonfinite_round_is_discarded_on_every_replica(pool2):
    results = pool2.run(_nonfinite_round)
    for result in results:
        assert result["reset"] and result["discarded"] == 1 and result["finite"] and result["consistent"]
    assert results[0]["hash"] == results[1]["hash"]


@pytest.mark.parametrize("kind, stop, options", [
    ("adamw", 3, dict(exchange="int4")),                                   # mid-round
    ("signmuon", 4, dict(exchange="sign_vote")),                           # at a sync
    ("adamw", 5, dict(exchange="lowrank")),                                # the warm-started Q too
    ("adamw", 3, dict(exchange="sign_vote", overlap=True, fragments=2)),   # exchanges in flight
])
def test_kill_and_resume_is_bit_exact(pool2, kind, stop, options):
    results = pool2.run(_resume, kind, stop, 8, **options)
    for result in results:
        assert result["straight"] == result["resumed"] == result["kept_going"] and result["consistent"]
    assert (results[0]["straight"] == results[1]["straight"]) != bool(options.get("overlap"))   # step 8 syncs


def test_overlap_applies_each_round_one_round_late(pool2):
    """float64 reference of docs/design.md §10's overlap rule, H = 1, "mean", outer lr 1, momentum 0."""
    steps = 4
    results = pool2.run(_overlap_mean, steps)
    outer = [p.detach().double() for p in _params()]
    theta = [list(outer), list(outer)]
    start = [list(outer), list(outer)]
    pending = None
    for step in range(1, steps + 1):
        for replica in range(2):
            theta[replica] = [t - INNER_LR * g for t, g in zip(theta[replica], _gradients(step, replica, torch.float64))]
        if pending is not None:
            outer = [o - d for o, d in zip(outer, pending)]
        pending = [(s0 - t0 + s1 - t1) / 2 for s0, t0, s1, t1 in zip(start[0], theta[0], start[1], theta[1])]
        for replica in range(2):
            theta[replica] = [o + t - s for o, t, s in zip(outer, theta[replica], start[replica])]
            start[replica] = list(theta[replica])
    for replica, result in enumerate(results):
        assert all(result["outer_equal"])
        for got, want in zip(result["params"], theta[replica]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_fragments_split_the_sync_bytes(pool2):
    whole, split = pool2.run(_fragments, 1)[0], pool2.run(_fragments, 2)[0]
    assert whole["sent"] == [0, 0, 0, whole["format_bytes"][0]] * 2
    first, second = split["format_bytes"]
    assert split["sent"] == [0, first, 0, second] * 2
    assert max(split["sent"]) < 0.75 * max(whole["sent"])


FLAG_BYTES = collective_bytes("all_reduce", 4, 2)   # sync_now's agreement on what is due (one fragment)


def test_stopping_off_a_sync_step_then_sync_now_gives_identical_replicas(pool2):
    """sync_every 4, 6 steps: the replicas differ; sync_now sends one round (+ the due flags) and leaves them
    bitwise equal at θ_outer; a second call sends the flags only; training goes on to the next sync."""
    results = pool2.run(_stop_off_a_sync, 6, 4, exchange="sign_mean")
    for result in results:
        assert not result["before"] and result["after"] and result["equal_outer"] and result["consistent_later"]
        assert result["synced"] == [[0], []]
        assert result["sent"] == [result["format_bytes"][0] + FLAG_BYTES, FLAG_BYTES], result["sent"]
    assert results[0]["hash_before"] != results[1]["hash_before"]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))
    assert results[0]["hash"] == results[1]["hash"]   # step 8: the next scheduled sync


@pytest.mark.parametrize("momentum", [0.0, 0.6])
def test_sync_now_with_mean_and_outer_lr_one_applies_the_last_round_without_momentum(pool2, momentum):
    """"mean", outer lr 1, Nesterov momentum μ: the step-2 sync moves θ by (1 + μ)·Δ̄₂ (b = Δ̄₂); sync_now after
    step 3 applies that part round's Δ̄₃ without the momentum (Fragment.settle): θ = θ₀ − (1 + μ)·Δ̄₂ − Δ̄₃, the
    replicas' float64 mean at μ = 0 (Δ̄: lr × the replicas' mean gradients over the round)."""
    results = pool2.run(_stop_off_a_sync, 3, 2, exchange="mean", outer_lr=1.0, outer_momentum=momentum)
    theta = [p.detach().double() for p in _params()]
    mean_step = lambda step: [INNER_LR * (g0 + g1) / 2 for g0, g1 in zip(*(_gradients(step, replica, torch.float64)
                                                                           for replica in range(2)))]
    first = [a + b for a, b in zip(mean_step(1), mean_step(2))]
    want = [t - (1 + momentum) * d2 - d3 for t, d2, d3 in zip(theta, first, mean_step(3))]
    for result in results:
        for got, expected in zip(result["params"], want):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("options", [dict(overlap=True), dict(fragments=2), dict(overlap=True, fragments=2)])
def test_sync_now_with_overlap_or_fragments_leaves_identical_replicas(pool2, options):
    results = pool2.run(_stop_off_a_sync, 6, 4, exchange="sign_vote", **options)
    for result in results:
        assert result["after"] and result["equal_outer"] and result["synced"][1] == [], result["synced"]
        assert result["consistent_later"] or options.get("fragments")   # (fragment 0 moved at steps 7-8)
    assert results[0]["hash_before"] != results[1]["hash_before"]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


def test_sync_now_at_a_sync_step_sends_only_the_flags(pool2):
    for result in pool2.run(_stop_off_a_sync, 4, 4, exchange="sign_mean"):
        assert result["before"] and result["after"] and result["synced"] == [[], []]
        assert result["sent"] == [FLAG_BYTES, FLAG_BYTES]


def test_double_averaging_under_ddp_is_refused_at_step_1_before_anything_changes(pool2):
    for result in pool2.run(_double_averaged_step):
        assert result["error"] is not None and "at step 1" in result["error"], result["error"]
        assert "No optimizer state was changed" in result["error"]
        assert "LocalSteps(double_averaging_check=False)" in result["error"]
        assert result["unchanged"] and result["steps"] == 0 and result["inner_state"] == 0 and result["outer_state"] == 0
        assert result["sent"] == CHECK_BYTES


def test_bad_inputs_name_the_parameter(pool2):
    params = _params()
    sgd = torch.optim.SGD(params, lr=0.1)
    for options, name in [(dict(sync_every=0), "sync_every"), (dict(sync_every=2, exchange="fp8"), "exchange"),
                          (dict(sync_every=2, fragments=3), "fragments"), (dict(sync_every=2, outer_lr=0), "outer_lr"),
                          (dict(sync_every=2, outer_momentum=1.0), "outer_momentum"),
                          (dict(sync_every=2, state_dtype=torch.float16), "state_dtype"),
                          (dict(sync_every=2, state_device="cuda"), "state_device")]:
        with pytest.raises(ValueError, match=name):
            shardopt.LocalSteps(sgd, replicate_mesh=None, **options)
    with pytest.raises(ValueError, match="inner"):
        shardopt.LocalSteps(params, replicate_mesh=None, sync_every=2)
    inner, ddp = pool2.run(_refused, "inner"), pool2.run(_refused, "model")
    assert all(message and "inner" in message and "replicate_mesh" in message for message in inner)
    assert all(message and "model" in message and "DistributedDataParallel" in message for message in ddp)


# ---- FSDP2 / HSDP: 2 replicas × 2 shards, DCP ------------------------------------------------------
class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weights = torch.nn.ParameterList(_params())


def _hsdp(kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _Model()
    fully_shard(model, mesh=mesh["shard"])
    params = list(model.parameters())
    inner = _inner(kind, params) if kind != "signmuon" else shardopt.SignMuon(
        [{"params": [p for p in params if p.ndim == 2]}, {"params": [p for p in params if p.ndim != 2],
                                                            "algorithm": "lion"}], lr=0.01, shard_mesh=mesh["shard"])
    opt = shardopt.LocalSteps(inner, replicate_mesh=mesh["replicate"], sync_every=2, exchange="int8", block=BLOCK)
    return mesh, model, params, opt


def _hsdp_gradients(mesh, params, step):
    from torch.distributed.tensor import DTensor
    replica, shard = mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")
    for param, grad in zip(params, _gradients(step, replica)):
        rows = -(-grad.shape[0] // 2)
        piece = grad[shard * rows:(shard + 1) * rows]
        param.grad = DTensor.from_local(piece, param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())


def _hsdp_run(kind, directory, stop=3, total=6):
    """Bytes per step and replica equality of a straight run; then a run stopped at `stop`, saved with
    DCP, loaded into a new model and optimizer and continued: the weights' hashes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    mesh, model, params, opt = _hsdp(kind)
    sent, consistent = [], []
    for step in range(1, total + 1):
        _hsdp_gradients(mesh, params, step)
        opt.step()
        sent.append(opt.comm_stats()["replicate"]["bytes_sent"])
        opt.reset_comm_stats()
        consistent.append(opt.replicas_consistent())
        opt.reset_comm_stats()
    straight = _hash([p.to_local() for p in params])
    local_numel = sum(p.to_local().numel() for p in params)
    outer_is_dtensor = type(opt.state_dict()["state"][0]["outer_params"]).__name__ == "DTensor"
    mesh, model, params, opt = _hsdp(kind)
    for step in range(1, stop + 1):
        _hsdp_gradients(mesh, params, step)
        opt.step()
    # every replica's weights, inner state and error feedback are its own: one DCP checkpoint per replica,
    # written by that replica's shard ranks (DCP would keep one copy of what looks replicated)
    replica = f"{directory}/replica_{mesh.get_local_rank('replicate')}"
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=replica, process_group=mesh["shard"].get_group())
    mesh, model, params, opt = _hsdp(kind)
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=replica, process_group=mesh["shard"].get_group())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step in range(stop + 1, total + 1):
        _hsdp_gradients(mesh, params, step)
        opt.step()
    return {"sent": sent, "consistent": consistent, "local_numel": local_numel, "straight": straight,
            "resumed": _hash([p.to_local() for p in params]), "outer_is_dtensor": outer_is_dtensor}


@pytest.mark.parametrize("kind", ["signmuon", "adamw"])
def test_hsdp_sends_the_formula_per_shard_and_resumes_through_dcp(pool4, tmp_path, kind):
    results = pool4.run(_hsdp_run, kind, str(tmp_path / "checkpoint"))
    for rank, result in enumerate(results):
        expected = reference.outer_bytes("int8", result["local_numel"], 2, BLOCK)
        assert result["sent"] == [CHECK_BYTES, expected, 0, expected, 0, expected], (rank, result["sent"])
        assert result["consistent"][1::2] == [True] * 3 and result["outer_is_dtensor"]
        assert result["resumed"] == result["straight"]
    assert results[0]["straight"] == results[2]["straight"] and results[1]["straight"] == results[3]["straight"]
    assert results[0]["local_numel"] != results[1]["local_numel"] or results[0]["straight"] != results[1]["straight"]
