"""The CUDA streams of the exchange during backward (docs/design.md §12).

The units of a round run on a side stream of their own, never on the stream a hook happens to be called
on: FSDP2 runs post-accumulate-grad hooks on its reduce-scatter stream, and work queued there would wait
behind FSDP2's later reduce-scatters (and race with step()'s commit, which runs on the default stream).
The order, per round:

1. `work()`, around every stretch of a round's work (each hook; step()'s `finish`): the side stream first
   waits for the caller's current stream (a hook's: the gradient it just made final; step()'s: anything
   queued since), then the work is queued on the side stream. A gradient read there is recorded on the
   side stream (`reads`), so its memory is not reused by the stream that made it while the side stream
   still reads it.
2. `join(tensors)`, after the round's last work and before the caller touches what it wrote (the commit's
   copies, a discard, a rerun in place): the caller's stream waits for the side stream, and the scratch
   tensors the side stream made are recorded on the caller's stream (the commit reads them there, and a
   first step's fresh state lives on there).

On the CPU there is no stream (`side` None): every method does nothing, so results are bitwise those of
the plain step. `streams_for(device)` makes the one side stream of a BackwardOverlap; the stream calls go
through `current`, `use` and `record`, so a test can follow the order with fakes (tests/test_overlap_streams.py).
"""

from __future__ import annotations

import contextlib

import torch


def _record(tensor: torch.Tensor, stream) -> None:
    tensor.record_stream(stream)


class RoundStreams:
    """side: the round's own stream, or None (CPU: nothing happens); current(): the caller's stream now;
    use(stream): a context that makes `stream` current; record(tensor, stream): Tensor.record_stream."""

    def __init__(self, side, current, use=None, record=_record):
        self.side, self.current, self.use, self.record = side, current, use, record

    @contextlib.contextmanager
    def work(self):
        """Queue the enclosed work on the side stream, after what the caller's stream has queued so far."""
        if self.side is None:
            yield
            return
        self.side.wait_stream(self.current())
        with self.use(self.side):
            yield

    def reads(self, tensors) -> None:
        """The side stream reads `tensors` (gradients another stream made): keep their memory until it is done."""
        if self.side is not None:
            for tensor in tensors:
                self.record(tensor, self.side)

    def join(self, tensors=()) -> None:
        """The caller's stream waits for the side stream and then owns `tensors` (what the side stream wrote)."""
        if self.side is None:
            return
        current = self.current()
        current.wait_stream(self.side)
        for tensor in tensors:
            self.record(tensor, current)


def streams_for(device: torch.device) -> RoundStreams:
    """The streams of the rounds of one optimizer whose tensors live on `device`: on CUDA a side stream made
    now, once; elsewhere none."""
    if device.type != "cuda":
        return RoundStreams(None, None)
    return RoundStreams(torch.cuda.Stream(device), lambda: torch.cuda.current_stream(device), torch.cuda.stream)
