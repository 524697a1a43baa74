"""The code that runs only where ``device.type == "cuda"``, exercised on the CPU.

Tensors that say they are on CUDA come from ``FakeTensorMode`` (no data, no driver), and
``torch.cuda``'s stream calls are replaced by recorders. Where each CUDA-only path is
checked without a GPU:

* which path a CUDA tensor takes (the fused kernels, batched layouts): here;
* :mod:`geofp8.comm.streams` (``TorchStreams``, ``SideStream``, ``used_here``) calling
  ``torch.cuda``: here; the side-stream protocol of the DDP hook on real gloo ranks:
  ``test_overlap.py`` (a recording stand-in for the stream API);
* :func:`geofp8.comm.collective.device_future`'s devices: here;
* a Triton failure on CUDA turning to the torch path for good: ``triton_fp4.guarded`` here,
  ``triton_fp8.attempt`` in ``test_triton_fp8.py``;
* the device branches of the codecs and stages (no lookup tables, batched calls, the
  senders' sum): the fake device of ``test_device.py``; the kernels' bits: the interpreter
  tests (``test_triton_fp8.py``, ``test_triton_fp4.py``); ``make gpu-check``'s own timers
  and verdicts: ``test_gpu_check.py``.

Not run without a GPU: the stochastic NVFP4/MX keys' pinned host buffer
(``pin_memory`` needs a CUDA driver) and the training loop's NCCL set-up; ``make gpu-check``
runs both (its stochastic rows and its 1-rank NCCL runs).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from geofp8.codecs import make_codec, triton_fp4, triton_fp8
from geofp8.comm import ShardLayout, collective, streams
from geofp8.comm.block_plan import BlockPlan
from geofp8.comm.plan import FusedPlan

CUDA = torch.device("cuda", 0)
compiled = pytest.mark.skipif(triton_fp8.triton is None or triton_fp8._INTERPRET,
                              reason="the CUDA branch: triton imports, not interpreted")


def cuda_tensor(n: int, dtype=torch.float32) -> torch.Tensor:
    """A tensor that says it is on CUDA (no data)."""
    with FakeTensorMode():
        return torch.empty(n, dtype=dtype, device=CUDA)


@compiled
def test_cuda_tensors_take_the_fused_kernels_and_the_batched_layout():
    flat, cpu = cuda_tensor(4096), torch.zeros(4096)
    assert triton_fp8.available(flat) and triton_fp4.available(flat)
    assert not triton_fp8.available(cpu) and not triton_fp8.available(flat, cpu)
    e4m3 = ShardLayout.build([(64, 64)], make_codec("e4m3"), 4)  # kernels="auto"
    assert e4m3.batched(CUDA) and not e4m3.batched(cpu.device)
    assert FusedPlan.applies(e4m3, flat, flat) and not FusedPlan.applies(e4m3, cpu)
    nvfp4 = ShardLayout.build([(64, 64)], make_codec("nvfp4"), 4)
    received = cuda_tensor(4 * nvfp4.send_bytes(0), torch.uint8)
    assert BlockPlan.applies(nvfp4, received) and not BlockPlan.applies(e4m3, flat)
    with triton_fp4.torch_only():
        assert not BlockPlan.applies(nvfp4, received)
        assert FusedPlan.applies(e4m3, flat)  # torch_only is the block kernels' switch


class Recorder:
    """``torch.cuda``'s stream calls, logged."""

    def __init__(self, log: list) -> None:
        self.log = log

    def Stream(self, device):  # noqa: N802 - torch.cuda.Stream's name
        self.log.append(("new", device))
        recorder = self

        class Side:
            def wait_stream(self, other):
                recorder.log.append(("wait_stream", other))
        return Side()

    def current_stream(self, device=None):
        return f"current {device}"

    @contextlib.contextmanager
    def stream(self, s):
        self.log.append(("enter", type(s).__name__))
        yield
        self.log.append(("exit", type(s).__name__))


def test_the_side_stream_on_cuda_calls_torch_cuda(monkeypatch):
    log: list = []
    recorder = Recorder(log)
    for name in ("Stream", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(recorder, name))
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda t, s: log.append(("record", t.device, s if isinstance(s, str)
                                                 else type(s).__name__)))
    side = streams.SideStream(CUDA)
    assert isinstance(side.api, streams.TorchStreams)
    with side.after_current():
        log.append("work")
    side.hand_over(cuda_tensor(3))
    with side.use():
        log.append("more")
    streams.used_here(cuda_tensor(2), torch.zeros(2))  # the host tensor: nothing to record
    assert log == [("new", CUDA), ("wait_stream", f"current {CUDA}"), ("enter", "Side"), "work",
                   ("exit", "Side"), ("record", CUDA, "Side"), ("enter", "Side"), "more",
                   ("exit", "Side"), ("record", CUDA, f"current {CUDA}")]
    assert streams.SideStream(torch.device("cpu")).api is None


def test_a_cuda_future_names_its_device(monkeypatch):
    made = []
    monkeypatch.setattr(torch.futures, "Future", lambda **kwargs: made.append(kwargs))
    collective.device_future(CUDA)
    collective.device_future(torch.device("cpu"))
    assert made == [{"devices": [CUDA]}, {"devices": None}]


@compiled
def test_a_block_kernel_failure_on_cuda_turns_to_the_torch_path_for_good(monkeypatch):
    monkeypatch.setattr(triton_fp4, "_STATE", {"off": 0, "broken": False})
    flat = cuda_tensor(8)
    assert triton_fp4.guarded(lambda: 5) == 5 and triton_fp4.available(flat)
    with pytest.warns(RuntimeWarning, match="the torch path runs from now on"):
        assert triton_fp4.guarded(lambda: 1 / 0) is None
    assert not triton_fp4.available(flat)
    assert triton_fp8.available(flat)  # the FP8 kernels keep their own record
