"""One record per algorithm, looked up by name: adding an algorithm is one record and one
`register` call (here a Nesterov Sign-Muon defined by this test, with no library change)."""

import dataclasses

import pytest
import torch

import shardopt
from shardopt.algorithms import registry, signmuon


def nesterov_options(group: dict) -> dict:
    """Sign-Muon's step options with Nesterov momentum always on."""
    return {**signmuon.options(group), "nesterov": True}


NESTEROV_SIGN_MUON = dataclasses.replace(
    signmuon.SIGN_MUON, name="signmuon_nesterov", options=nesterov_options,
    hyperparameters={key: value for key, value in signmuon.SIGN_MUON.hyperparameters.items() if key != "nesterov"})


@pytest.fixture
def nesterov_registered():
    registry.register(NESTEROV_SIGN_MUON)
    yield
    registry.unregister(NESTEROV_SIGN_MUON.name)


def _weights(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((8, 6), (8, 6), (5, 7))]


def test_a_variant_registered_by_a_test_steps_bitwise_like_its_built_in_twin(nesterov_registered):
    built_in, variant = _weights(0), _weights(0)
    reference = shardopt.SignMuon(built_in, lr=0.01, nesterov=True)
    registered = shardopt.SignMuon([{"params": variant, "algorithm": "signmuon_nesterov"}], lr=0.01)
    for step in range(3):
        for a, b, grad in zip(built_in, variant, _weights(100 + step)):
            a.grad, b.grad = grad.detach().clone(), grad.detach().clone()
        reference.step()
        registered.step()
    assert all(torch.equal(a, b) for a, b in zip(built_in, variant))
    assert "signmuon_nesterov" in registered.describe(4)
    state = registered.state_dict()
    registered.load_state_dict(state)   # its record's state keys and shapes check the load
    with pytest.raises(ValueError, match="only 'signmuon'.* read nesterov"):
        shardopt.SignMuon([{"params": _weights(1), "algorithm": "signmuon_nesterov", "nesterov": False}], lr=0.01)


def test_register_refuses_a_shared_key_with_another_default():
    clash = dataclasses.replace(
        NESTEROV_SIGN_MUON, name="clash",
        hyperparameters={**NESTEROV_SIGN_MUON.hyperparameters,
                         "lr": dataclasses.replace(NESTEROV_SIGN_MUON.hyperparameters["lr"], default=1.0)})
    with pytest.raises(ValueError, match="default of 'lr'"):
        registry.register(clash)
    assert "clash" not in registry.ALGORITHMS


def test_an_unknown_algorithm_names_the_group_and_every_registered_one():
    with pytest.raises(ValueError, match=r"Invalid algorithm: 'nadam' \(param group 0\); allowed: 'dion', 'signmuon'"):
        shardopt.Dion([{"params": _weights(0), "algorithm": "nadam"}])
    with pytest.raises(ValueError, match="built-in"):
        registry.unregister("dion")
