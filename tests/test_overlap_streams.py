"""The stream order of the exchange during backward (shardopt/overlap/streams.py), followed with fake streams on
the CPU: the units run on a side stream that first waits for the hook's stream; step() waits for the side stream
before the commit, and the scratch is recorded on the caller's stream. Only a GPU runs real streams
(tests/test_cuda.py); here the order is what is pinned, and the CPU path (no stream) stays the plain step's."""

import contextlib

import torch

import shardopt
from shardopt.overlap.streams import RoundStreams, streams_for


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))


def _fakes(log, current_name=lambda: "hook"):
    side = FakeStream("side", log)

    @contextlib.contextmanager
    def use(stream):
        log.append(("enter", stream.name))
        yield
        log.append(("exit", stream.name))

    return RoundStreams(side, lambda: FakeStream(current_name(), log), use,
                        lambda tensor, stream: log.append(("record", id(tensor), stream.name)))


def test_work_waits_for_the_callers_stream_then_runs_on_the_side_stream():
    log = []
    streams = _fakes(log)
    with streams.work():
        log.append("work")
    streams.reads([torch.zeros(1)])
    tensor = torch.zeros(1)
    streams.join([tensor])
    assert log[:4] == [("wait", "side", "hook"), ("enter", "side"), "work", ("exit", "side")]
    assert log[4][0::2] == ("record", "side")
    assert log[5:] == [("wait", "hook", "side"), ("record", id(tensor), "hook")]


def test_cpu_has_no_stream_and_does_nothing():
    streams = streams_for(torch.device("cpu"))
    assert streams.side is None
    with streams.work():
        pass
    streams.reads([torch.zeros(1)])
    streams.join([torch.zeros(1)])


def _model_and_optimizer(overlap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    groups = shardopt.param_groups(model, "signmuon", "lion", nonmatrix_options={"lr": 1e-2})
    return model, shardopt.SignMuon(groups, lr=1e-2, overlap_backward=overlap)


def test_a_round_runs_on_the_side_stream_and_the_commit_waits_for_it():
    log, where = [], {"now": "hook"}
    model, opt = _model_and_optimizer(True)
    opt.backward_overlap.streams = _fakes(log, lambda: where["now"])
    reference, plain = _model_and_optimizer(False)
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for m in (model, reference):
            m(x).square().mean().backward()
        where["now"] = "default"
        opt.step()
        plain.step()
        where["now"] = "hook"
        opt.zero_grad()
        plain.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    waits = [entry for entry in log if entry[0] == "wait"]
    assert waits[0] == ("wait", "side", "hook")                       # the first unit waits for the hook's stream
    join = log.index(("wait", "default", "side"))                     # step(): the caller waits for the side stream
    assert ("wait", "side", "default") in log[:join]                  # after finish ran on the side stream
    assert not any(entry[0] == "enter" for entry in log[join:log.index(("wait", "side", "hook"), join)])
    recorded = [entry for entry in log[join:] if entry[0] == "record" and entry[2] == "default"]
    assert recorded                                                   # the scratch is owned by the caller's stream
    assert any(entry[0] == "record" and entry[2] == "side" for entry in log[:join])   # gradients read on the side
