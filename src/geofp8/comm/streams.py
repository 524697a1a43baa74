"""The side stream a DDP bucket's codec work and collectives run on (CUDA), or nothing.

On CUDA, backward's kernels run on the autograd thread's *current* stream. A bucket's work
— encode, the waits on its collectives, decode-and-sum, re-encode, decode, the finite flag —
runs on one side stream instead, so the current stream never waits on a collective before
DDP reads the results:

* :meth:`SideStream.after_current` first makes the side stream wait for the current one
  (``side.wait_stream(current)``: the bucket's gradients are written), then makes it current;
* on NCCL, ``work.wait()`` makes the *current* stream wait for the collective: called under
  the side stream, only the side stream waits;
* a tensor that the side stream uses but another stream allocated (DDP's bucket) is marked
  with ``record_stream`` (:meth:`SideStream.hand_over`), so its memory is not reused before
  the side stream is done with it;
* a ``torch.futures.Future(devices=[dev])`` records the current stream when its result is
  set: set under the side stream, whoever waits on the future (DDP at the end of backward)
  is ordered after every write the side stream made.

On a CPU (and the meta device) there are no streams: every method is a no-op, and gloo's
``work.wait()`` blocks the host as before. :func:`streams_for` picks the API; tests replace
it with a recording stand-in to check the protocol without a GPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["SideStream", "StreamsUsed", "TorchStreams", "streams_for", "used_here"]


class TorchStreams:
    """The four stream operations :class:`SideStream` needs, on ``torch.cuda``."""

    def new(self, device: torch.device):
        return torch.cuda.Stream(device)

    def current(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def use(self, stream):
        return torch.cuda.stream(stream)

    def record(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)


def streams_for(device: torch.device):
    """The stream API of ``device``'s type, or ``None`` where there are no streams."""
    return TorchStreams() if device.type == "cuda" else None


def used_here(*tensors: torch.Tensor) -> None:
    """Mark tensors that another stream allocated (e.g. the forward's reduced sketches) as
    used by the current stream too, so their memory is not handed to that stream's later
    kernels while the current one's queued work still reads them (a no-op off CUDA)."""
    for t in tensors:
        api = streams_for(t.device)
        if api is not None:
            api.record(t, api.current(t.device))


class StreamsUsed:
    """The streams that some of a step's work ran on (FSDP2 runs a unit's reduce-scatter on
    its own stream, HSDP's all-reduce hook on another): :meth:`note` the current one from
    inside the work; :meth:`join` makes the current stream wait for every stream noted (on
    the device: no host wait), so what it queues next (the step's settling, which reads the
    units' finite flags) is ordered after all of their work. A no-op without streams."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.api = streams_for(self.device)
        self.used: list = []

    def note(self) -> None:
        if self.api is not None:
            stream = self.api.current(self.device)
            if all(stream is not s for s in self.used):
                self.used.append(stream)

    def join(self) -> None:
        if self.api is not None:
            current = self.api.current(self.device)
            for stream in self.used:
                if stream is not current:
                    current.wait_stream(stream)
        self.used = []


class SideStream:
    """One side stream on ``device`` (module notes); a no-op where there are no streams.
    ``use()``: a context manager running the block on the side stream (no new ordering)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.api = streams_for(self.device)
        self.stream = self.api.new(self.device) if self.api is not None else None
        # bound once: no Python of ours between a caller and the context manager it enters
        if self.api is None:  # nothing to order, mark nor enter
            self.use = self.after_current = contextlib.nullcontext
        else:
            self.use = functools.partial(self.api.use, self.stream)

    @contextlib.contextmanager
    def after_current(self, tensor: torch.Tensor | None = None):
        """Order the side stream after the current one (the gradients are ready), mark
        ``tensor`` (e.g. DDP's bucket) as used by it (:meth:`hand_over`), then run the block
        on it."""
        self.stream.wait_stream(self.api.current(self.device))
        if tensor is not None:
            self.hand_over(tensor)
        with self.api.use(self.stream):
            yield

    def hand_over(self, *tensors: torch.Tensor) -> None:
        """Mark tensors allocated on another stream as used by the side stream too."""
        if self.api is not None:
            for t in tensors:
                self.api.record(t, self.stream)
