"""The torch.optim surface on one process: state_dict round trips, LR schedulers, closures, params
without gradients, add_param_group, shardopt.param_groups(model), bf16 parameters."""

import copy
import io

import pytest
import torch
from torch import nn

import shardopt
from shardopt.wire.comm import collective_bytes
from shardopt.wire.vote import resolve_vote, vote_bytes


class TinyLM(nn.Module):
    """Embedding, two Linear blocks with biases, a norm, and an untied output head."""

    def __init__(self, vocab=11, width=8, hidden=12):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        return self.lm_head(self.norm(h))


def build_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return TinyLM().to(dtype)


def build_optimizer(model, algorithm, nonmatrix_algorithm, seed=0):
    groups = shardopt.param_groups(model, algorithm, nonmatrix_algorithm, nonmatrix_options={"lr": 3e-3, "weight_decay": 0.05})
    if algorithm == "dion":
        return shardopt.Dion(groups, lr=0.02, rank_fraction=0.5, weight_decay=0.1, seed=seed)
    return shardopt.SignMuon(groups, lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.1, seed=seed)


def set_gradients(model, step):
    for index, param in enumerate(model.parameters()):
        generator = torch.Generator().manual_seed(1000 * step + index)
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)


def run_steps(model, optimizer, steps, first_step):
    for step in range(first_step, first_step + steps):
        set_gradients(model, step)
        optimizer.step()


OPTIMIZER_KINDS = [("dion", "adamw"), ("dion", "lion"), ("signmuon", "adamw"), ("signmuon", "lion")]


# ---- state_dict ---------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm, nonmatrix_algorithm", OPTIMIZER_KINDS)
def test_state_dict_round_trip_continues_bitwise_equal(algorithm, nonmatrix_algorithm):
    model = build_model()
    optimizer = build_optimizer(model, algorithm, nonmatrix_algorithm, seed=1)
    run_steps(model, optimizer, 3, first_step=0)

    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    run_steps(model, optimizer, 3, first_step=3)                   # continue without reload

    restored = build_model(seed=123)                                 # different init, overwritten by the load
    restored.load_state_dict(checkpoint["model"])
    reloaded = build_optimizer(restored, algorithm, nonmatrix_algorithm, seed=99)   # Q comes from the state, not the seed
    reloaded.load_state_dict(checkpoint["optimizer"])
    run_steps(restored, reloaded, 3, first_step=3)                   # continue after reload

    for (name, p), q in zip(model.named_parameters(), restored.parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(model.parameters(), restored.parameters()):
        state, state_reloaded = optimizer.state[p], reloaded.state[q]
        assert state.keys() == state_reloaded.keys()
        for key in state:
            assert torch.equal(state[key], state_reloaded[key]), key
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in reloaded.param_groups]


def test_state_dict_holds_the_documented_state_per_algorithm():
    model = build_model()
    optimizer = build_optimizer(model, "dion", "adamw")
    run_steps(model, optimizer, 1, first_step=0)
    state = optimizer.state_dict()["state"]
    names = optimizer.state_dict()["param_groups"]
    assert {g["algorithm"] for g in names} == {"dion", "adamw"}
    keys = {frozenset(s.keys()) for s in state.values()}
    assert keys == {frozenset({"momentum", "Q", "step"}), frozenset({"exp_avg", "exp_avg_sq", "step"})}


# ---- LR schedulers ------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm, nonmatrix_algorithm", [("dion", "adamw"), ("signmuon", "lion")])
def test_lambda_lr_scales_each_steps_change(algorithm, nonmatrix_algorithm):
    """With weight decay 0 and the same gradients, the state does not depend on lr, so the change
    of every parameter under LambdaLR is factor(t) times the change at constant lr."""
    factors = [1.0, 0.5, 0.25, 0.0]
    models = [build_model(), build_model()]
    optimizers = []
    for model in models:
        groups = shardopt.param_groups(model, algorithm, nonmatrix_algorithm,
                                       nonmatrix_options={"lr": 3e-3, "weight_decay": 0.0},
                                       matrix_options={"weight_decay": 0.0})
        cls = shardopt.Dion if algorithm == "dion" else shardopt.SignMuon
        optimizers.append(cls(groups, lr=0.02))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizers[0], lambda epoch: factors[epoch])
    for step, factor in enumerate(factors):
        before = [[p.detach().clone() for p in model.parameters()] for model in models]
        for model, optimizer in zip(models, optimizers):
            set_gradients(model, step)
            optimizer.step()
        for p_sched, p_const, b_sched, b_const in zip(models[0].parameters(), models[1].parameters(), *before):
            change_sched, change_const = p_sched.detach() - b_sched, p_const.detach() - b_const
            assert change_const.abs().max() > 0
            assert torch.allclose(change_sched, factor * change_const, rtol=1e-4, atol=1e-7), (step, factor)
        if factor == 0.0:
            for p, b in zip(models[0].parameters(), before[0]):
                assert torch.equal(p.detach(), b)
        scheduler.step() if step + 1 < len(factors) else None


def test_step_lr_changes_signmuon_step_size():
    param = nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    optimizer = shardopt.SignMuon([param], lr=0.1, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    for expected in (0.1, 0.01, 0.001):
        before = param.detach().clone()
        param.grad = torch.randn(6, 4, dtype=torch.float64)
        optimizer.step()
        assert torch.allclose((param.detach() - before).abs(), torch.full((6, 4), expected, dtype=torch.float64),
                              rtol=1e-9, atol=0)
        scheduler.step()


# ---- closure, params without grad ----------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ["dion", "signmuon"])
def test_step_with_closure_returns_loss_and_uses_its_gradients(algorithm):
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    models = [build_model(), build_model()]
    optimizers = [build_optimizer(m, algorithm, "adamw") for m in models]

    def closure():
        optimizers[0].zero_grad()
        loss = nn.functional.cross_entropy(models[0](tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        return loss

    for _ in range(2):
        loss = optimizers[0].step(closure)
        optimizers[1].zero_grad()
        manual = nn.functional.cross_entropy(models[1](tokens).flatten(0, 1), targets.flatten())
        manual.backward()
        optimizers[1].step()
        assert isinstance(loss, torch.Tensor) and loss.requires_grad
        assert torch.equal(loss.detach(), manual.detach())
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    assert optimizers[0].step() is None


@pytest.mark.parametrize("algorithm, nonmatrix_algorithm", OPTIMIZER_KINDS)
def test_params_without_grad_are_skipped_without_state(algorithm, nonmatrix_algorithm):
    model = build_model()
    optimizer = build_optimizer(model, algorithm, nonmatrix_algorithm)
    frozen = {"up.weight", "up.bias"}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    set_gradients(model, 0)
    for name, p in model.named_parameters():
        if name in frozen:
            p.grad = None
    optimizer.step()
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, before[name]), name
            assert len(optimizer.state[p]) == 0, name
        else:
            assert not torch.equal(p, before[name]), name
            assert int(optimizer.state[p]["step"]) == 1


def test_step_without_any_gradient_changes_nothing_and_warns_once(caplog):
    """A step where no param has a gradient (e.g. FSDP2 HSDP with set_requires_all_reduce(False) on a
    2-D mesh, which keeps the gradients inside FSDP2) is a no-op, as in torch.optim, but says so once."""
    model = build_model()
    optimizer = build_optimizer(model, "dion", "adamw")
    before = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level("WARNING", logger="shardopt"):
        optimizer.step()
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not optimizer.state
    assert caplog.text.count("no parameter has a gradient on any rank") == 1
    assert "fully_shard(model, mesh=mesh['shard'])" in caplog.text


def test_adamw_param_that_gets_its_first_grad_late_uses_its_own_step_count():
    """Bias correction uses each parameter's own step: its first update equals AdamW's first step."""
    a = nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    b = nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    reference_b = nn.Parameter(b.detach().clone())
    optimizer = shardopt.Dion([{"params": [a, b], "algorithm": "adamw", "lr": 0.01, "weight_decay": 0.1}])
    reference = torch.optim.AdamW([reference_b], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                  foreach=False)
    for step in range(3):
        a.grad = torch.randn(5, dtype=torch.float64)
        optimizer.step()
    b.grad = torch.randn(3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    reference_b.grad = b.grad.clone()
    a.grad = torch.randn(5, dtype=torch.float64)
    optimizer.step()
    reference.step()
    assert int(optimizer.state[a]["step"]) == 4 and int(optimizer.state[b]["step"]) == 1
    assert torch.allclose(b.detach(), reference_b.detach(), rtol=0, atol=1e-14)


# ---- add_param_group -----------------------------------------------------------------------------

def test_add_param_group_fills_defaults_and_is_used_by_step():
    w1 = nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    w2 = nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    bias = nn.Parameter(torch.randn(6, dtype=torch.float64))
    optimizer = shardopt.SignMuon([w1], lr=0.1, weight_decay=0.0)
    optimizer.add_param_group({"params": [w2], "lr": 0.5})
    optimizer.add_param_group({"params": [bias], "algorithm": "lion", "lr": 0.25})
    group = optimizer.param_groups[1]
    assert group["algorithm"] == "signmuon" and group["momentum"] == 0.9 and group["weight_decay"] == 0.0
    before = [p.detach().clone() for p in (w1, w2, bias)]
    for p in (w1, w2, bias):
        p.grad = torch.randn_like(p)
    optimizer.step()
    for p, b, lr in zip((w1, w2, bias), before, (0.1, 0.5, 0.25)):
        assert torch.allclose((p.detach() - b).abs(), torch.full_like(b, lr), rtol=1e-9, atol=0)


@pytest.mark.parametrize("group, match", [
    ({"rank_fraction": 2.0}, "rank_fraction"),
    ({"lr": -1.0}, "lr"),
    ({"algorithm": "sgd"}, "algorithm"),
    ({"mu": 1.0}, "mu"),
    ({"shape": "1-D"}, "not 2-D"),
    ({"dtype": "int"}, "dtype"),
])
def test_add_param_group_rejects_bad_group_and_leaves_optimizer_unchanged(group, match):
    w = nn.Parameter(torch.randn(6, 4))
    optimizer = shardopt.Dion([w], lr=0.01)
    if group.pop("shape", None):
        new = nn.Parameter(torch.randn(6))
    elif group.pop("dtype", None):
        new = torch.ones(6, 4, dtype=torch.int64)
    else:
        new = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match=match):
        optimizer.add_param_group({"params": [new], **group})
    assert len(optimizer.param_groups) == 1
    w.grad = torch.randn_like(w)
    optimizer.step()                                                 # still usable
    if new.dtype.is_floating_point:                                  # nothing of the failed group stays behind:
        fixed = {"params": [new], "algorithm": "dion" if new.ndim == 2 else "adamw"}
        optimizer.add_param_group(fixed)                             # the same param can be added again
        assert len(optimizer.param_groups) == 2
        new.grad = torch.randn_like(new)
        optimizer.step()
        assert int(optimizer.state[new]["step"]) == 1


def test_add_param_group_rejects_param_already_in_a_group():
    w = nn.Parameter(torch.randn(6, 4))
    optimizer = shardopt.Dion([w])
    with pytest.raises(ValueError, match="more than one parameter group"):
        optimizer.add_param_group({"params": [w]})
    assert len(optimizer.param_groups) == 1


# ---- param_groups(model) -------------------------------------------------------------------------

class TiedModel(nn.Module):
    """The output projection is declared before the embedding and shares its weight, under a name
    that is not a head name, so only the tie can make it non-matrix."""

    def __init__(self):
        super().__init__()
        self.decoder = nn.Linear(8, 11, bias=False)
        self.tok = nn.Embedding(11, 8)
        self.decoder.weight = self.tok.weight
        self.proj = nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 3)
        self.rms = nn.RMSNorm(8)
        self.batch_norm = nn.BatchNorm1d(8)
        self.gate = nn.Parameter(torch.ones(()))
        self.mix = nn.Parameter(torch.ones(8, 8))
        self.classifier = nn.Linear(8, 3)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)


def names_of(group):
    return set(group["param_names"])


def test_param_groups_classifies_embeddings_tied_heads_norms_biases_and_non_2d_as_nonmatrix():
    model = TiedModel()
    groups = shardopt.param_groups(model, "dion", "adamw")
    matrix, nonmatrix = groups
    assert matrix["algorithm"] == "dion" and nonmatrix["algorithm"] == "adamw"
    assert names_of(matrix) == {"proj.weight", "mix"}
    assert names_of(nonmatrix) == {"decoder.weight", "proj.bias", "conv.weight", "conv.bias", "rms.weight",
                                "batch_norm.weight", "batch_norm.bias", "gate", "classifier.weight",
                                "classifier.bias"}
    for group in groups:
        assert len(group["param_names"]) == len(group["params"])
        for name, param in zip(group["param_names"], group["params"]):
            assert model.get_parameter(name) is param
    tied = nonmatrix["params"][nonmatrix["param_names"].index("decoder.weight")]
    assert tied is model.tok.weight
    assert sum(p is tied for g in groups for p in g["params"]) == 1


def test_param_groups_untied_lm_head_and_options_and_nonmatrix_names():
    model = TinyLM()
    groups = shardopt.param_groups(model, "signmuon", "lion", matrix_options={"lr": 0.02},
                                   nonmatrix_options={"lr": 1e-3}, nonmatrix_names=("down.",))
    matrix, nonmatrix = groups
    assert names_of(matrix) == {"up.weight"}
    assert {"lm_head.weight", "embed.weight", "norm.weight", "norm.bias", "up.bias", "down.weight",
            "down.bias"} == names_of(nonmatrix)
    assert (matrix["algorithm"], matrix["lr"], nonmatrix["algorithm"], nonmatrix["lr"]) == ("signmuon", 0.02, "lion", 1e-3)
    optimizer = shardopt.SignMuon(groups, lr=0.1)
    assert optimizer.param_groups[0]["lr"] == 0.02 and optimizer.param_groups[1]["lr"] == 1e-3


@pytest.mark.parametrize("nonmatrix_algorithm", ["adamw", "lion"])
def test_param_groups_verbose_prints_each_groups_replicate_bytes(capsys, nonmatrix_algorithm):
    """One line per group with its bytes per step (the traffic formulas at `replicas`), the whole
    model against a float32 all-reduce, and why params were made non-matrix."""
    groups = shardopt.param_groups(TiedModel(), "dion", nonmatrix_algorithm, verbose=True, replicas=4)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 5
    matrix_numel, nonmatrix_numel = (sum(p.numel() for p in g["params"]) for g in groups)
    matrix_bytes = collective_bytes("all_reduce", 4 * matrix_numel, 4)   # rank_fraction 1: the gradient mean
    nonmatrix_bytes = collective_bytes("all_reduce", 4 * nonmatrix_numel, 4) if nonmatrix_algorithm == "adamw" \
        else vote_bytes(resolve_vote("auto", nonmatrix_numel, 4), nonmatrix_numel, 4)
    assert lines[0].startswith("shardopt:     dion: 2 tensors") and f"{matrix_bytes:,} B/step" in lines[0]
    assert f"{nonmatrix_algorithm}: 10 tensors" in lines[1] and f"{nonmatrix_bytes:,} B/step" in lines[1]
    total = matrix_bytes + nonmatrix_bytes + collective_bytes("all_reduce", 4, 4)
    assert f"4 replicas: {total:,} B/step" in lines[2]
    assert lines[3].startswith(f"shardopt: double-averaging check: +{collective_bytes('all_reduce', 24, 4)} B")
    assert "embedding" in lines[4] and "norm" in lines[4]
    optimizer = shardopt.Dion(groups)
    assert optimizer.replicate_bytes_per_step(4) == [matrix_bytes, nonmatrix_bytes]
    assert optimizer.describe(4).splitlines() == lines[:4]


def test_param_groups_quiet_by_default(capsys):
    shardopt.param_groups(TiedModel(), "dion")
    assert capsys.readouterr().out == ""


def test_param_groups_leaves_out_empty_groups():
    groups = shardopt.param_groups(nn.Linear(4, 4, bias=False), "dion")
    assert [g["algorithm"] for g in groups] == ["dion"]


@pytest.mark.parametrize("kwargs, match", [({"matrix_algorithm": "adamw"}, "matrix_algorithm"),
                                           ({"nonmatrix_algorithm": "dion"}, "nonmatrix_algorithm")])
def test_param_groups_rejects_wrong_algorithm_kind(kwargs, match):
    with pytest.raises(ValueError, match=match):
        shardopt.param_groups(TinyLM(), **kwargs)


def test_param_groups_model_trains_every_param_with_dion():
    model = TiedModel()
    optimizer = shardopt.Dion(shardopt.param_groups(model, "dion"), rank_fraction=0.5)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) == (not p.requires_grad), name


# ---- bf16 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm, nonmatrix_algorithm", OPTIMIZER_KINDS)
def test_bf16_params_keep_bf16_state_and_finite_updates(algorithm, nonmatrix_algorithm):
    model = build_model(dtype=torch.bfloat16)
    optimizer = build_optimizer(model, algorithm, nonmatrix_algorithm)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    run_steps(model, optimizer, 3, first_step=0)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.isfinite(p).all(), name
        assert not torch.equal(p, before[name]), name
        for key, value in optimizer.state[p].items():
            if key != "step":
                assert value.dtype == torch.bfloat16, (name, key)
                assert torch.isfinite(value).all(), (name, key)


def test_same_shape_matrices_of_different_dtypes_are_all_updated():
    """Buckets are keyed by layout, dtype and device: a float32 and a float64 matrix of one shape
    both get their update (neither bucket replaces the other)."""
    a = torch.nn.Parameter(torch.randn(6, 4))
    b = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    before = [a.detach().clone(), b.detach().clone()]
    optimizer = shardopt.Dion([a, b], lr=0.1)
    a.grad, b.grad = torch.randn(6, 4), torch.randn(6, 4, dtype=torch.float64)
    optimizer.step()
    assert not torch.equal(a, before[0]) and not torch.equal(b, before[1])
    assert set(optimizer.state[a]) == set(optimizer.state[b]) == {"momentum", "Q", "step"}


def test_param_groups_scalar_keywords_before_0_3_still_work_with_a_deprecation_warning():
    new = shardopt.param_groups(TiedModel(), "signmuon", nonmatrix_algorithm="lion", nonmatrix_options={"lr": 1e-3},
                                nonmatrix_names=("proj",))
    with pytest.warns(DeprecationWarning, match="scalar_options=...\\) is deprecated; use nonmatrix_options"):
        old = shardopt.param_groups(TiedModel(), "signmuon", scalar_algorithm="lion", scalar_options={"lr": 1e-3},
                                    scalar_names=("proj",))
    assert [(g["algorithm"], g["param_names"], g.get("lr")) for g in old] == \
        [(g["algorithm"], g["param_names"], g.get("lr")) for g in new]
    with pytest.raises(TypeError, match="unexpected keyword argument 'scalar_lr'"):
        shardopt.param_groups(TiedModel(), scalar_lr=1e-3)
