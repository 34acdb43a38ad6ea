"""What a new user feeds a step or a load, table-driven, one process: each bad gradient and each bad
state dict gets a ValueError naming the param/tensor and the fix, raised before any state or weight
changes; the torch.optim habit `maximize` works for every algorithm.
(Constructor arguments: tests/test_validation.py.)"""

import copy

import pytest
import torch
from torch import nn

import shardopt
from shardopt.algorithms.registry import algorithm as registered

ALGORITHMS = ("dion", "signmuon", "muon", "adamw", "lion")


def build(algorithm: str, seed: int = 0, **options) -> tuple[shardopt.ShardOptimizer, list[nn.Parameter]]:
    """An optimizer with one `algorithm` group of a tall and a wide matrix (element-wise algorithms: a
    matrix and a vector), named params, fixed weights."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(8, 4), (4, 12)] if algorithm in ("dion", "signmuon", "muon") else [(8, 4), (6,)]
    params = [nn.Parameter(torch.randn(*shape, generator=generator)) for shape in shapes]
    group = {"params": params, "param_names": ["w0", "w1"], "algorithm": algorithm}
    hyper = dict(rank_fraction=0.5, lr=0.01) if algorithm == "dion" else dict(lr=0.01)
    return shardopt.Dion([group], **hyper, **options), params


def set_grads(params, step: int, sign: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    grads = [sign * torch.randn(p.shape, generator=generator) for p in params]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    return grads


def snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"])


def assert_unchanged(before, opt, params):
    weights, state = before
    assert all(torch.equal(w, p) for w, p in zip(weights, params))
    now = opt.state_dict()["state"]
    assert now.keys() == state.keys()
    for index in state:
        assert all(torch.equal(torch.as_tensor(state[index][k]), torch.as_tensor(now[index][k])) for k in state[index])


# ---- step: gradients ------------------------------------------------------------------------------
def sparse(param):
    param.grad = torch.randn(param.shape).to_sparse()


def other_dtype(param):
    param.grad_dtype = None          # torch 2.13 lets a user lift its own dtype check
    param.grad = torch.randn(param.shape, dtype=torch.float64)


def integer(param):
    param.grad_dtype = None
    param.grad = torch.ones(param.shape, dtype=torch.int32)


def other_shape(param):
    param.grad = torch.zeros_like(param)
    param.grad.data = torch.zeros(param.shape[0] + 1, *param.shape[1:])   # torch checks `.grad =`, not `.data =`


GRADIENT_CASES = {
    "sparse gradient on a dion matrix": ("dion", sparse, r"param 'w0' has a torch.sparse_coo gradient.*sparse=False"),
    "sparse gradient in an adamw group": ("adamw", sparse, r"param 'w0' has a torch.sparse_coo gradient"),
    "float64 gradient on a float32 param": ("signmuon", other_dtype,
                                            r"param 'w0' has dtype torch.float32 but its gradient has dtype torch.float64"),
    "int32 gradient (lion)": ("lion", integer, r"param 'w0' has dtype torch.float32 but its gradient has dtype torch.int32"),
    "gradient of another shape (muon)": ("muon", other_shape, r"param 'w0' has shape \(8, 4\) but its gradient has shape \(9, 4\)"),
}


@pytest.mark.parametrize("algorithm, spoil, match", list(GRADIENT_CASES.values()), ids=list(GRADIENT_CASES))
def test_bad_gradient_is_refused_before_any_state_changes(algorithm, spoil, match):
    opt, params = build(algorithm)
    set_grads(params, 0)
    opt.step()                                   # state exists: a partial step would show
    set_grads(params, 1)
    spoil(params[0])
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert_unchanged(before, opt, params)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_non_contiguous_gradients_give_the_same_step(algorithm):
    """A transposed-storage gradient (as autograd can produce) is read by value, not by layout."""
    results = []
    for contiguous in (True, False):
        opt, params = build(algorithm)
        for step in range(3):
            grads = set_grads(params, step)
            if not contiguous:
                for param, grad in zip(params, grads):
                    param.grad = grad.T.contiguous().T if grad.ndim == 2 else grad[::1]
                    assert param.grad.ndim == 1 or not param.grad.is_contiguous()
            opt.step()
        results.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))


# ---- torch.optim habits: maximize -------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_maximize_steps_like_minimizing_the_negated_gradient(algorithm):
    """maximize=True with gradient g moves exactly as maximize=False with −g, and leaves .grad as it was."""
    up, up_params = build(algorithm, maximize=True)
    down, down_params = build(algorithm)
    for step in range(3):
        grads = set_grads(up_params, step)
        set_grads(down_params, step, sign=-1.0)
        up.step()
        down.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(up_params, grads))
    assert all(torch.equal(a, b) for a, b in zip(up_params, down_params))
    assert not all(torch.equal(a, b) for a, b in zip(up_params, build(algorithm)[1]))   # it moved


def test_maximize_is_a_group_option():
    matrix, vector = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(6))
    opt = shardopt.Dion([{"params": [matrix]}, {"params": [vector], "algorithm": "adamw", "maximize": True}])
    assert [g["maximize"] for g in opt.param_groups] == [False, True]


# ---- load: state dicts --------------------------------------------------------------------------------
def stepped(algorithm="dion", **options):
    opt, params = build(algorithm, **options)
    for step in range(2):
        set_grads(params, step)
        opt.step()
    return opt, params


def saved(algorithm="dion", **options) -> dict:
    return copy.deepcopy(stepped(algorithm, **options)[0].state_dict())


def edit(algorithm, change):
    """A state dict saved by a stepped `algorithm` optimizer, modified by change(state_dict)."""
    def make():
        state_dict = saved(algorithm)
        change(state_dict)
        return state_dict
    return make


def torch_adamw_state():
    params = [nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4, 12))]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt.state_dict()


STATE_CASES = {   # name: (algorithm of the loading optimizer, state dict maker, error)
    "a list": ("dion", lambda: [1, 2], r"not an optimizer state dict \(got list\)"),
    "no 'state'": ("dion", edit("dion", lambda sd: sd.pop("state")), r"not an optimizer state dict \(got \['param_groups'\]\)"),
    "a torch.optim.AdamW state": ("dion", torch_adamw_state, r"param group 0 of the state dict has no 'algorithm'.*torch.optim"),
    "a SignMuon state into Dion": ("dion", lambda: saved("signmuon"),
                                   r"group 0 of the state dict holds 'signmuon' state but this optimizer's group 0 runs 'dion'"),
    "two param groups": ("dion", edit("dion", lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0], params=[]))),
                         r"the state dict has 2 param groups, this optimizer 1"),
    "one param fewer": ("dion", edit("dion", lambda sd: sd["param_groups"][0]["params"].pop()),
                        r"param group 0 of the state dict has 1 params, this optimizer's 2"),
    "NaN lr in the saved group": ("dion", edit("dion", lambda sd: sd["param_groups"][0].update(lr=float("nan"))),
                                  r"Invalid lr: nan \(param group 0\)"),
    "Q missing": ("dion", edit("dion", lambda sd: sd["state"][0].pop("Q")),
                  r"state of param 'w0' \('dion'\) has keys \['momentum', 'step'\].*missing \['Q'\]"),
    "an AdamW key in a Dion param": ("dion", edit("dion", lambda sd: sd["state"][1].update(exp_avg_sq=torch.zeros(4, 12))),
                                     r"param 'w1' \('dion'\).*unexpected \['exp_avg_sq'\].*another algorithm"),
    "step missing": ("adamw", edit("adamw", lambda sd: sd["state"][1].pop("step")), r"param 'w1' \('adamw'\).*missing \['step'\]"),
    "step NaN": ("lion", edit("lion", lambda sd: sd["state"][0].update(step=torch.tensor(float("nan")))),
                 r"param 'w0' \('lion'\): 'step' is tensor\(nan\); expected a finite count ≥ 0"),
    "step negative": ("muon", edit("muon", lambda sd: sd["state"][0].update(step=-1)), r"'step' is -1"),
    "momentum transposed": ("signmuon", edit("signmuon", lambda sd: sd["state"][0].update(momentum=torch.zeros(4, 8))),
                            r"param 'w0' \('signmuon'\): 'momentum' has shape \(4, 8\) but this optimizer expects \(8, 4\)"),
    "Q of another rank": ("dion", edit("dion", lambda sd: sd["state"][1].update(Q=torch.zeros(4, 3))),
                          r"param 'w1' \('dion'\): 'Q' has shape \(4, 3\) but this optimizer expects \(4, 2\).*rank_fraction"),
    "integer exp_avg_sq": ("adamw", edit("adamw", lambda sd: sd["state"][0].update(exp_avg_sq=torch.zeros(8, 4, dtype=torch.int64))),
                           r"'exp_avg_sq' has dtype torch.int64; optimizer state is floating point"),
    "momentum as a list": ("muon", edit("muon", lambda sd: sd["state"][1].update(momentum=[[0.0] * 12] * 4)),
                           r"param 'w1' \('muon'\): 'momentum' is a list, not a tensor"),
    "state entry not a dict": ("dion", edit("dion", lambda sd: sd["state"].update({0: torch.zeros(8, 4)})),
                               r"the state of param 'w0' \('dion'\) is a Tensor, not a dict"),
    "state of an unknown param": ("dion", edit("dion", lambda sd: sd["state"].update({7: {}})),
                                  r"state for param 7, which no param group lists"),
}


@pytest.mark.parametrize("algorithm, make, match", list(STATE_CASES.values()), ids=list(STATE_CASES))
def test_bad_state_dict_is_refused_before_anything_loads(algorithm, make, match):
    """Loaded into a stepped optimizer running `algorithm`: the error, and its state untouched."""
    opt, params = stepped(algorithm)
    before = snapshot(opt, params)
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(make())
    assert_unchanged(before, opt, params)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups_before


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_saved_state_loads_into_a_fresh_optimizer_and_continues_identically(algorithm):
    original, params = stepped(algorithm)
    fresh, fresh_params = build(algorithm)
    with torch.no_grad():
        for mine, theirs in zip(fresh_params, params):
            mine.copy_(theirs)
    fresh.load_state_dict(copy.deepcopy(original.state_dict()))
    for opt, ps in ((original, params), (fresh, fresh_params)):
        set_grads(ps, 5)
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, fresh_params))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_state_keys_table_matches_what_a_step_creates(algorithm):
    """load_state_dict checks against each record's state_keys: they must list exactly the state each algorithm keeps."""
    opt, params = stepped(algorithm)
    assert all(set(opt.state[p]) == set(registered(algorithm).state_keys) | {"step"} for p in params)


# ---- no host reads added to a step --------------------------------------------------------------------
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


def _reads_in_one_step(monkeypatch, algorithm, *, check, **options) -> int:
    """How many times a step reads a tensor value back to the host (each would be a device sync on CUDA)."""
    import shardopt.optim.agreement as agreement_module
    opt, params = build(algorithm, **options)
    set_grads(params, 0)
    opt.step()                                   # state created: count a steady-state step
    set_grads(params, 1)
    if not check:
        monkeypatch.setattr(agreement_module, "check_gradients", lambda labeled: None)
    count = [0]
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count[0] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    opt.step()
    monkeypatch.undo()
    return count[0]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_gradient_checks_and_clipping_add_no_host_reads_to_a_step(monkeypatch, algorithm):
    """The step-time gradient checks read metadata only and max_grad_norm keeps its factor on the
    device: a step reads back exactly as many values as one without either."""
    baseline = _reads_in_one_step(monkeypatch, algorithm, check=False)
    assert baseline >= 1                         # (the non-finite decision, which does need one)
    assert _reads_in_one_step(monkeypatch, algorithm, check=True) == baseline
    assert _reads_in_one_step(monkeypatch, algorithm, check=True, max_grad_norm=0.5) == baseline
