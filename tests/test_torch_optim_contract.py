"""What torch's own optimizer suite (test/test_optim.py, test/inductor/test_compiled_optimizers.py)
expects of an optimizer, and frameworks rely on, held for every algorithm a group can choose.
Test names follow torch's."""

import copy
import pickle

import pytest
import torch
from torch import nn

import shardopt

# (optimizer class, matrix algorithm, non-matrix algorithm, options)
CASES = [(shardopt.Dion, "dion", "adamw", {"rank_fraction": 0.5}), (shardopt.Dion, "dion", "lion", {}),
         (shardopt.SignMuon, "signmuon", "lion", {"lr": 0.01}), (shardopt.SignMuon, "muon", "adamw", {"lr": 0.01})]
IDS = [f"{matrix}-{nonmatrix}" for _, matrix, nonmatrix, _ in CASES]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8))


def _build(case, model, **options):
    cls, matrix, nonmatrix, defaults = case
    return cls(shardopt.param_groups(model, matrix, nonmatrix), seed=7, bucket_bytes=1000, **defaults, **options)


def _train(model, optimizer, steps, start=0):
    for step in range(start, start + steps):
        model.zero_grad()
        model(torch.arange(5) + step).pow(2).sum().backward()
        optimizer.step()


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_deepcopy_copies_all_public_attrs(case):
    """copy.deepcopy and pickle keep every setting (seed, bucket cap, axes, policies), and the copy's
    next step is bitwise the original's (torch's __getstate__ keeps only defaults, state, groups)."""
    model = _model()
    optimizer = _build(case, model, nonfinite="raise", double_averaging_check_every=5)
    _train(model, optimizer, 2)
    for copied_model, copied in (copy.deepcopy((model, optimizer)), pickle.loads(pickle.dumps((model, optimizer)))):
        assert (copied.seed, copied.bucket_bytes, copied.nonfinite, copied.double_averaging_check_every) == \
            (7, 1000, "raise", 5)
        assert [axis.size for axis in copied.axes] == [1, 1, 1]
        original_model, original = copy.deepcopy((model, optimizer))
        _train(original_model, original, 2, start=2)
        _train(copied_model, copied, 2, start=2)
        assert _same(original_model, copied_model)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_can_load_older_state_dict(case):
    """A state dict saved before a group key existed (here: without maximize) loads with this
    optimizer's default for it, and the next step runs and equals the uninterrupted one."""
    model, twin = _model(), _model()
    optimizer, twin_optimizer = _build(case, model), _build(case, twin)
    _train(model, optimizer, 2)
    _train(twin, twin_optimizer, 2)
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        del group["maximize"]
    optimizer.load_state_dict(state)
    assert all(group["maximize"] is False for group in optimizer.param_groups)
    _train(model, optimizer, 1, start=2)
    _train(twin, twin_optimizer, 1, start=2)
    assert _same(model, twin)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_load_state_dict_pre_hook_and_prepend(case):
    """Pre-hooks run before shardopt's checks: a hook can repair a state dict, and what a hook
    returns is checked (a wrong-shaped momentum is refused, nothing loaded)."""
    model = _model()
    optimizer = _build(case, model)
    _train(model, optimizer, 1)
    good = optimizer.state_dict()
    broken = copy.deepcopy(good)
    first = next(iter(broken["state"]))
    key = next(k for k in broken["state"][first] if k != "step")
    broken["state"][first][key] = torch.zeros(99)
    handle = optimizer.register_load_state_dict_pre_hook(lambda opt, state: copy.deepcopy(good))
    optimizer.load_state_dict(broken)                            # repaired by the hook
    handle.remove()
    handle = optimizer.register_load_state_dict_pre_hook(lambda opt, state: broken, prepend=True)
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match=f"{key!r} has shape \\(99,\\)"):
        optimizer.load_state_dict(good)
    handle.remove()
    after = optimizer.state_dict()
    assert all(torch.equal(before["state"][i][k], after["state"][i][k]) for i in before["state"] for k in before["state"][i])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_compiled_optimizer_step_matches_eager(case):
    """torch.compile(opt.step) runs (the step is an explicit graph break: it issues collectives and
    reads one agreed flag on the host) and gives bitwise the eager step's weights."""
    compiled_model, eager_model = _model(), _model()
    compiled, eager = _build(case, compiled_model), _build(case, eager_model)
    step = torch.compile(compiled.step)
    for i in range(2):
        for model in (compiled_model, eager_model):
            model.zero_grad()
            model(torch.arange(5) + i).pow(2).sum().backward()
        step()
        eager.step()
    assert _same(compiled_model, eager_model)


@pytest.mark.parametrize("default_dtype", [torch.bfloat16, torch.float16])
def test_set_default_dtype_works_with_step_counter(default_dtype):
    """The step counter is float32 whatever the default dtype (a bf16 counter stops at 256, so the
    per-step coin seeds would repeat)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        weight = nn.Parameter(torch.randn(4, 4, dtype=torch.float32))
        optimizer = shardopt.SignMuon([weight], lr=1e-3)
        for _ in range(300):
            weight.grad = torch.ones_like(weight)
            optimizer.step()
    finally:
        torch.set_default_dtype(previous)
    assert optimizer.state[weight]["step"].dtype == torch.float32 and int(optimizer.state[weight]["step"]) == 300


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_step_on_meta_params(case):
    """Params on the meta device step (shapes only: no host read, no factorization on meta)."""
    with torch.device("meta"):
        model = _model()
    optimizer = _build(case, model)
    for param in model.parameters():
        param.grad = torch.empty_like(param)
    optimizer.step()
    assert all(optimizer.state[p]["step"] == 1 for p in model.parameters())


def test_add_param_group_without_names_to_groups_with_names():
    """Groups from shardopt.param_groups carry param_names; a group added without them gets names
    (torch.optim needs names in every group or in none) and steps."""
    model = _model()
    optimizer = shardopt.Dion(shardopt.param_groups(model, "dion", "lion"))
    extra = nn.Parameter(torch.randn(3, 3))
    optimizer.add_param_group({"params": [extra]})
    assert optimizer.param_groups[-1]["param_names"] == ["param_groups[2][0]"]
    extra.grad = torch.ones_like(extra)
    optimizer.step()
    assert optimizer.state[extra]["step"] == 1


def test_unnamed_param_error_names_its_group_once():
    with pytest.raises(ValueError) as error:
        shardopt.Dion([{"params": [nn.Parameter(torch.zeros(2, 2))]},
                       {"params": [torch.zeros(2, 2, dtype=torch.int64)], "algorithm": "adamw"}])
    assert str(error.value).count("param group 1") == 1


MOMENTUM_KEY = {"dion": "mu", "signmuon": "momentum", "muon": "momentum"}


@pytest.mark.parametrize("scheduler", ["cyclic", "onecycle"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cycle_lr_and_onecycle_lr_cycle_every_algorithms_momentum(case, scheduler):
    """CyclicLR / OneCycleLR with cycle_momentum write betas[0] of every group (our defaults have
    "betas"); the matrix group's own momentum (Dion's mu, Sign-Muon's and Muon's momentum) follows it,
    and the step uses it: bitwise the run whose momentum is set by hand to the same values."""
    model, by_hand = _model(), _model()
    optimizer, reference = _build(case, model), _build(case, by_hand)
    if scheduler == "cyclic":
        schedule = torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=1e-3, max_lr=1e-2, step_size_up=2,
                                                     base_momentum=0.8, max_momentum=0.9)
    else:
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=6,
                                                       base_momentum=0.8, max_momentum=0.9)
    key = MOMENTUM_KEY[case[1]]
    seen = set()
    for step in range(5):
        for group, manual in zip(optimizer.param_groups, reference.param_groups):
            manual["lr"], manual["betas"] = group["lr"], group["betas"]
            if group["algorithm"] == case[1]:
                manual[key] = group["betas"][0]
        _train(model, optimizer, 1, start=step)
        _train(by_hand, reference, 1, start=step)
        matrix_group = next(g for g in optimizer.param_groups if g["algorithm"] == case[1])
        assert matrix_group[key] == matrix_group["betas"][0]
        seen.add(round(matrix_group[key], 6))
        schedule.step()
    assert len(seen) >= 3                       # it did cycle
    assert _same(model, by_hand)


def test_momentum_is_left_alone_without_a_momentum_schedule():
    """No cycle_momentum: betas[0] of a matrix group is not the momentum; setting it changes nothing."""
    model = _model()
    optimizer = _build(CASES[2], model)
    torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=1e-3, max_lr=1e-2, cycle_momentum=False)
    group = optimizer.param_groups[0]
    momentum = group["momentum"]
    group["betas"] = (0.5, 0.99)
    _train(model, optimizer, 1)
    assert group["momentum"] == momentum != 0.5
