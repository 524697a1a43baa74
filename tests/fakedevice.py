"""A stand-in accelerator for CPU-only tests: what would break on a GPU breaks here.

Inside ``with FakeDevice() as dev:`` a tensor on :data:`DEVICE` (``meta``) is a wrapper that
holds CPU data; every op runs on that data and its results come back on :data:`DEVICE`
(factories asked for it too). The mode keeps CUDA's rules where they differ from the CPU's:

* a host tensor meeting a device tensor raises :class:`DeviceMix` (CUDA: "Expected all
  tensors to be on the same device"), except a 0-dim one in a point-wise op (a scalar) and
  host indices of ``t[index]`` (CUDA copies them over: counted as ``h2d``);
* a division by a host scalar is ``x · fl(1/b)``, as CUDA's ``div_true_kernel_cuda`` computes
  it (one ulp off the CPU's quotient for most ``x`` when ``1/b`` is inexact);
* host syncs are counted in ``dev.syncs``: ``item`` (``_local_scalar_dense``: ``.item()``,
  ``bool(t)``, ``float(t)``), ``d2h`` and ``h2d`` copies (from pageable memory CUDA waits
  for the stream). ``dev.strict()`` turns any of them into an error.

The fake device has no generator: ``torch.Generator(device=DEVICE)`` gives a CPU one (CUDA
draws other numbers anyway, so stochastic results are compared on the fake device only).
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from geofp8.codecs import base, fp4, fp8, mx

DEVICE = torch.device("meta")
aten = torch.ops.aten
_DIVS = {aten.div.Tensor, aten.div_.Tensor, aten.div.out}
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default}


class DeviceMix(RuntimeError):
    """A host tensor met a device tensor in an op that CUDA would reject."""


class HostSync(RuntimeError):
    """A host sync where none is allowed."""


class Fake(torch.Tensor):
    """CPU data (``elem``) that says it lives on :data:`DEVICE`."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, device=DEVICE, requires_grad=False)
        r.elem = elem
        return r

    def __repr__(self) -> str:
        return f"Fake({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {}, None)  # outside a mode: no checks


def to_device(t: torch.Tensor) -> Fake:
    """A CPU tensor's copy on the fake device (not counted)."""
    return Fake(t.detach().clone())


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A fake tensor's data (not counted)."""
    return t.elem.clone() if isinstance(t, Fake) else t


def _is_device(d) -> bool:
    return d is not None and torch.device(d) == DEVICE


def _host_tensors(flat) -> list[torch.Tensor]:
    return [a for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, Fake)]


def _cuda_div(func, args, kwargs, unwrap):
    """``a / b`` for a host scalar ``b`` as CUDA computes it: ``a · fl(1/b)`` in opmath."""
    a, b = args[0], args[1]
    opmath = torch.float64 if a.dtype == torch.float64 else torch.float32
    inv = torch.ones((), dtype=opmath) / torch.tensor(float(b), dtype=opmath)
    value = (unwrap(a).to(opmath) * inv).to(a.dtype)
    target = a if func is aten.div_.Tensor else kwargs.get("out")
    if target is None:
        return Fake(value)
    target.elem.copy_(value)
    return target


def _run(func, args, kwargs, mode: FakeDevice | None):
    flat = pytree.arg_tree_leaves(*args, **kwargs)
    if any(isinstance(a, torch.Tensor) and not isinstance(a, Fake) and a.is_meta for a in flat):
        raise RuntimeError(f"{func}: a real {DEVICE} tensor (no data), made outside the mode "
                           "(torch.tensor(data, device=...)): build on the host, then .to()")
    on_device = any(isinstance(a, Fake) for a in flat) or _is_device(kwargs.get("device"))
    if not on_device:
        return func(*args, **kwargs)
    if mode is not None:
        mode.ops[str(func)] += 1
    host = _host_tensors(flat)
    sync = None
    if func is aten._to_copy.default and not isinstance(args[0], Fake):
        sync = "h2d"
    elif func is aten._to_copy.default and not _is_device(kwargs.get("device", DEVICE)):
        sync = "d2h"
    elif func is aten.copy_.default and host:
        sync = "h2d" if isinstance(args[0], Fake) else "d2h"
    elif func is aten._local_scalar_dense.default:
        sync = "item"
    elif func in _INDEXING and host:
        sync = "h2d"  # CUDA copies host indices over
    elif host and not (torch.Tag.pointwise in func.tags and all(t.dim() == 0 for t in host)):
        raise DeviceMix(f"{func}: host tensor(s) of shape "
                        f"{[tuple(t.shape) for t in host]} meet {DEVICE} data")
    if (func in _DIVS and isinstance(args[0], Fake) and args[0].is_floating_point()
            and (isinstance(args[1], (int, float)) or (
                isinstance(args[1], torch.Tensor) and not isinstance(args[1], Fake)))):
        return _cuda_div(func, args, kwargs, lambda t: t.elem)
    if sync is not None and mode is not None:
        mode.sync(sync, func)
    if sync == "d2h" and func is aten._to_copy.default:
        return func(args[0].elem, **kwargs)

    wrappers = {id(t): t for t in host}  # a host result stays on the host (d2h copies)

    def unwrap(a):
        if isinstance(a, Fake):
            wrappers[id(a.elem)] = a
            return a.elem
        if (isinstance(a, torch.device) and a == DEVICE) or (isinstance(a, str) and a == "meta"):
            return torch.device("cpu")
        return a

    args, kwargs = pytree.tree_map(unwrap, (args, kwargs))
    out = func(*args, **kwargs)

    def wrap(t):
        if not isinstance(t, torch.Tensor):
            return t
        known = wrappers.get(id(t))
        return Fake(t) if known is None else known

    return pytree.tree_map(wrap, out)


_GENERATOR = torch.Generator


class _Generator(_GENERATOR):
    """``torch.Generator`` that takes :data:`DEVICE` for the CPU."""

    def __new__(cls, device="cpu"):
        return _GENERATOR.__new__(cls, "cpu" if _is_device(device) else device)

    def __init__(self, device="cpu") -> None:
        pass


def _forget_device_constants() -> None:
    """The codecs' constants made once per device: the stand-in's device is ``meta``, so a
    real meta one of another test must not reach the mode, nor a fake one leave it."""
    for cached in (base.device_scalar, fp8.e4m3_table, fp4._encode_table, fp4._pair_table,
                   mx._scale_tables, mx._e8m0_table):
        cached.cache_clear()


class FakeDevice(TorchDispatchMode):
    """The mode (module notes). ``syncs``: host syncs by kind; ``ops``: device ops by name."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: collections.Counter = collections.Counter()
        self.ops: collections.Counter = collections.Counter()
        self._strict = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {}, self)

    def sync(self, kind: str, func) -> None:
        if self._strict:
            raise HostSync(f"{func}: a host sync ({kind}) where none is allowed")
        self.syncs[kind] += 1

    @contextlib.contextmanager
    def strict(self):
        """Any host sync inside raises :class:`HostSync`."""
        before, self._strict = self._strict, True
        try:
            yield self
        finally:
            self._strict = before

    def __enter__(self):
        torch.Generator = _Generator
        _forget_device_constants()
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Generator = _GENERATOR
        _forget_device_constants()
        return super().__exit__(*exc)
