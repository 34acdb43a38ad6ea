"""Bad constructor input → ValueError that names the parameter (docs/design.md §7), one process, table-driven.
(Bad gradients at step time and bad state dicts at load time: tests/test_bad_inputs.py.)"""

import pytest
import torch
from torch import nn

import shardopt


def matrix():
    return nn.Parameter(torch.randn(6, 4))


def vector():
    return nn.Parameter(torch.randn(6))


def dion(**kwargs):
    return lambda: shardopt.Dion([matrix()], **kwargs)


def signmuon(**kwargs):
    kwargs.setdefault("lr", 0.01)
    return lambda: shardopt.SignMuon([matrix()], **kwargs)


def groups(cls, *param_groups, **kwargs):
    return lambda: cls(list(param_groups), **kwargs)


CASES = {
    # shapes and dtypes
    "1-D tensor in a dion group": (groups(shardopt.Dion, {"params": [vector()]}), r"#0 of param group 0.*shape \(6,\).*'dion'.*not 2-D"),
    "1-D tensor named in a dion group": (groups(shardopt.Dion, {"params": [vector()], "param_names": ["mlp.bias"]}),
                                         r"'mlp.bias'.*not 2-D"),
    "4-D tensor in a signmuon group": (groups(shardopt.SignMuon, {"params": [nn.Parameter(torch.randn(2, 3, 4, 5))]}, lr=0.1),
                                       r"shape \(2, 3, 4, 5\).*'signmuon'.*not 2-D"),
    "integer dtype param": (lambda: shardopt.Dion([torch.zeros(4, 4, dtype=torch.int64)]), r"dtype torch\.int64"),
    "integer dtype in an adamw group": (groups(shardopt.Dion, {"params": [torch.zeros(4, dtype=torch.int32)],
                                                               "algorithm": "adamw"}), r"dtype torch\.int32"),
    # Dion hyperparameters
    "rank_fraction 0": (dion(rank_fraction=0.0), r"Invalid rank_fraction: 0\.0 .*\(0\.0, 1\.0\]"),
    "rank_fraction 1.5": (dion(rank_fraction=1.5), r"Invalid rank_fraction: 1\.5"),
    "rank_fraction negative": (dion(rank_fraction=-0.5), r"Invalid rank_fraction: -0\.5"),
    "rank_multiple_of 0": (dion(rank_multiple_of=0), r"Invalid rank_multiple_of: 0"),
    "rank_multiple_of float": (dion(rank_multiple_of=2.5), r"Invalid rank_multiple_of: 2\.5"),
    "mu 1": (dion(mu=1.0), r"Invalid mu: 1\.0"),
    "mu above 1": (dion(mu=1.5), r"Invalid mu: 1\.5"),
    "mu negative": (dion(mu=-0.1), r"Invalid mu: -0\.1"),
    "unknown qr_method": (dion(qr_method="svd"), r"Invalid qr_method: 'svd'.*'qr', 'cholesky'"),
    "epsilon 0": (dion(epsilon=0.0), r"Invalid epsilon: 0\.0"),
    # shared
    "lr negative (dion)": (dion(lr=-0.01), r"Invalid lr: -0\.01"),
    "lr negative (signmuon)": (signmuon(lr=-1.0), r"Invalid lr: -1\.0"),
    "lr not a number": (dion(lr="fast"), r"Invalid lr: 'fast'.*real number"),
    "lr bool": (dion(lr=True), r"Invalid lr: True"),
    "weight_decay negative": (dion(weight_decay=-0.1), r"Invalid weight_decay: -0\.1"),
    "unknown algorithm": (groups(shardopt.Dion, {"params": [matrix()], "algorithm": "sgd"}),
                          r"Invalid algorithm: 'sgd'.*'dion'.*'signmuon'"),
    # Sign-Muon hyperparameters
    "momentum 1": (signmuon(momentum=1.0), r"Invalid momentum: 1\.0"),
    "momentum above 1": (signmuon(momentum=2.0), r"Invalid momentum: 2\.0"),
    "unknown vote": (signmuon(vote="ring"), r"Invalid vote: 'ring'.*'allreduce_int8'"),
    "ns_steps 0": (signmuon(ns_steps=0), r"Invalid ns_steps: 0 .*integer ≥ 1"),
    "ns_steps float": (signmuon(ns_steps=2.0), r"Invalid ns_steps: 2\.0"),
    "unknown ns_dtype": (signmuon(ns_dtype="int8"), r"Invalid ns_dtype: 'int8'"),
    "unknown lr_scale": (signmuon(lr_scale="spectral"), r"Invalid lr_scale: 'spectral'.*'unit_gain'"),
    "unknown orthogonalize": (signmuon(orthogonalize="global"), r"Invalid orthogonalize: 'global'"),
    "nesterov not bool": (signmuon(nesterov=1), r"Invalid nesterov: 1"),
    "post_polar not bool": (signmuon(post_polar="yes"), r"Invalid post_polar: 'yes'"),
    # element-wise groups
    "betas[1] = 1": (groups(shardopt.Dion, {"params": [vector()], "algorithm": "adamw", "betas": (0.9, 1.0)}),
                     r"Invalid betas\[1\]: 1\.0"),
    "betas[0] negative": (groups(shardopt.Dion, {"params": [vector()], "algorithm": "lion", "betas": (-0.1, 0.99)}),
                          r"Invalid betas\[0\]: -0\.1"),
    "betas not a pair": (groups(shardopt.Dion, {"params": [vector()], "algorithm": "adamw", "betas": (0.9,)}),
                         r"Invalid betas: \(0\.9,\).*pair"),
    "adamw lr negative in group 1": (groups(shardopt.Dion, {"params": [matrix()]},
                                            {"params": [vector()], "algorithm": "adamw", "lr": -3e-4}),
                                     r"Invalid lr: -0\.0003 \(param group 1\)"),
    # NaN / inf (NaN compares False with every bound, so each range check must reject it explicitly)
    "lr NaN": (dion(lr=float("nan")), r"Invalid lr: nan .*not NaN"),
    "lr inf": (dion(lr=float("inf")), r"Invalid lr: inf .*\[0\.0, inf\)"),
    "lr NaN (signmuon)": (signmuon(lr=float("nan")), r"Invalid lr: nan"),
    "lr a tensor": (dion(lr=torch.tensor(0.01)), r"Invalid lr: a tensor \(param group 0\); pass a Python float"),
    "weight_decay NaN": (dion(weight_decay=float("nan")), r"Invalid weight_decay: nan"),
    "weight_decay inf": (dion(weight_decay=float("inf")), r"Invalid weight_decay: inf"),
    "mu NaN": (dion(mu=float("nan")), r"Invalid mu: nan"),
    "momentum NaN": (signmuon(momentum=float("nan")), r"Invalid momentum: nan"),
    "rank_fraction NaN": (dion(rank_fraction=float("nan")), r"Invalid rank_fraction: nan"),
    "epsilon NaN": (dion(epsilon=float("nan")), r"Invalid epsilon: nan"),
    "epsilon inf": (dion(epsilon=float("inf")), r"Invalid epsilon: inf"),
    "betas NaN": (groups(shardopt.Dion, {"params": [vector()], "algorithm": "adamw", "betas": (float("nan"), 0.9)}),
                  r"Invalid betas\[0\]: nan"),
    "betas a string": (groups(shardopt.Dion, {"params": [vector()], "algorithm": "lion", "betas": "0.9,0.99"}),
                       r"Invalid betas: '0\.9,0\.99'.*pair"),
    "rank_multiple_of None": (dion(rank_multiple_of=None), r"Invalid rank_multiple_of: None"),
    "lr None": (dion(lr=None), r"Invalid lr: None.*real number"),
    # optimizer options (not group hyperparameters)
    "seed float": (dion(seed=1.5), r"Invalid seed: 1\.5.*integer"),
    "seed string": (dion(seed="0"), r"Invalid seed: '0'"),
    "seed NaN": (dion(seed=float("nan")), r"Invalid seed: nan"),
    "agreement_timeout_s 0": (dion(agreement_timeout_s=0), r"Invalid agreement_timeout_s: 0.*> 0"),
    "agreement_timeout_s NaN": (dion(agreement_timeout_s=float("nan")), r"Invalid agreement_timeout_s: nan"),
    "unknown nonfinite": (dion(nonfinite="ignore"), r"Invalid nonfinite: 'ignore'.*'skip', 'raise'"),
    "max_grad_norm negative": (dion(max_grad_norm=-1.0), r"Invalid max_grad_norm: -1\.0.*≥ 0"),
    "max_grad_norm NaN": (dion(max_grad_norm=float("nan")), r"Invalid max_grad_norm: nan"),
    "max_grad_norm inf": (signmuon(max_grad_norm=float("inf")), r"Invalid max_grad_norm: inf.*0 turns clipping off"),
    "max_grad_norm string": (dion(max_grad_norm="1.0"), r"Invalid max_grad_norm: '1\.0'"),
    "maximize not bool": (dion(maximize=1), r"Invalid maximize: 1.*True or False"),
    "maximize not bool in a group": (groups(shardopt.Dion, {"params": [matrix()], "maximize": "yes"}),
                                     r"Invalid maximize: 'yes' \(param group 0\)"),
    "misspelt group key": (groups(shardopt.Dion, {"params": [matrix()], "rank_fracton": 0.25}),
                           r"param group 0 has unknown keys 'rank_fracton' \(did you mean 'rank_fraction'\?\)"),
    "torch.optim key in a group": (groups(shardopt.SignMuon, {"params": [matrix()], "dampening": 0.1}, lr=0.1),
                                   r"unknown keys 'dampening'"),
    # meshes
    "shard_mesh without DTensor params": (dion(shard_mesh=object()), r"shard_mesh was given but no parameter is a DTensor"),
    "tensor_mesh without DTensor params": (dion(tensor_mesh=object()),
                                           r"tensor_mesh was given but no parameter is a DTensor"),
    "replicate_mesh without torch.distributed": (dion(replicate_mesh=object()),
                                                 r"replicate_mesh was given but torch.distributed is not initialized"),
}


@pytest.mark.parametrize("build, match", list(CASES.values()), ids=list(CASES))
def test_bad_input_raises_value_error_naming_the_parameter(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("kwargs", [dict(rank_fraction=1.0), dict(rank_fraction=1e-3), dict(mu=0.0), dict(lr=0.0),
                                    dict(weight_decay=0.0), dict(qr_method="cholesky"), dict(rank_multiple_of=128)])
def test_boundary_values_that_are_allowed_for_dion(kwargs):
    shardopt.Dion([matrix()], **kwargs)


@pytest.mark.parametrize("kwargs", [dict(momentum=0.0), dict(ns_steps=1), dict(vote="alltoall_1bit"),
                                    dict(ns_dtype="bfloat16"), dict(lr_scale="unit_gain"), dict(orthogonalize="full")])
def test_boundary_values_that_are_allowed_for_signmuon(kwargs):
    shardopt.SignMuon([matrix()], lr=0.01, **kwargs)


def test_defaults_an_algorithm_does_not_read_are_not_validated():
    """An adamw group inherits the optimizer's defaults (rank_fraction, vote, ...) without error."""
    shardopt.Dion([{"params": [vector()], "algorithm": "adamw"}], rank_fraction=0.25, vote="alltoall_1bit")


@pytest.mark.parametrize("group, message", [
    ({"algorithm": "adamw", "vote": "alltoall_1bit"}, r"Invalid vote in param group 0 \(algorithm 'adamw'\).*'lion'"),
    ({"algorithm": "adamw", "ns_steps": 0}, r"Invalid ns_steps in param group 0 \(algorithm 'adamw'\)"),
    ({"algorithm": "lion", "wire_dtype": torch.float32}, r"Invalid wire_dtype in param group 0 \(algorithm 'lion'\)"),
])
def test_a_key_set_on_a_group_whose_algorithm_does_not_read_it_raises(group, message):
    with pytest.raises(ValueError, match=message):
        shardopt.Dion([{"params": [vector()], **group}])


@pytest.mark.parametrize("kwargs, message", [
    ({"wire_dtype": torch.float16}, r"Invalid wire_dtype: 'float16' \(param group 1\); allowed: 'bfloat16', 'float32'"),
    ({"wire_dtype": "int8"}, r"Invalid wire_dtype: 'int8'"),
    ({"vote": "allreduce_2bit"}, r"Invalid vote: 'allreduce_2bit' \(param group 0\)"),
])
def test_bad_wire_dtype_or_vote_names_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        shardopt.Dion([{"params": [vector()], "algorithm": "lion"}, {"params": [matrix()]}], **kwargs)


def test_wire_dtype_given_as_torch_dtype_is_held_as_its_name():
    optimizer = shardopt.Dion([matrix()], wire_dtype=torch.float32)
    assert optimizer.param_groups[0]["wire_dtype"] == "float32"


def test_lion_group_with_an_integer_tensor_names_the_group():
    with pytest.raises(ValueError, match=r"param group 1 \('lion'\) has dtype torch.int64"):
        shardopt.SignMuon([{"params": [matrix()]},
                           {"params": [torch.zeros(3, dtype=torch.int64)], "algorithm": "lion"}], lr=0.01)


@pytest.mark.parametrize("flag", ["foreach", "fused", "capturable", "differentiable"])
@pytest.mark.parametrize("value", [True, False])
def test_torch_optim_flags_are_refused_with_what_shardopt_does_instead(flag, value):
    """foreach=/fused=/capturable=/differentiable= are not ignored: a TypeError says why (None passes)."""
    with pytest.raises(TypeError, match=rf"{flag}={value} is a torch.optim option shardopt does not take: .*Remove {flag}="):
        shardopt.SignMuon([matrix()], lr=0.01, **{flag: value})
    shardopt.Dion([matrix()], **{flag: None})


def test_a_rejected_group_leaves_the_optimizer_unchanged():
    opt = shardopt.Dion([matrix()])
    with pytest.raises(ValueError, match="Invalid lr: nan"):
        opt.add_param_group({"params": [matrix()], "lr": float("nan")})
    assert len(opt.param_groups) == 1 and len(opt._param_index) == 1


def test_signmuon_requires_lr():
    with pytest.raises(TypeError, match="lr"):
        shardopt.SignMuon([matrix()])
