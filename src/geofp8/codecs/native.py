"""The CPU's E4M3 kernels in C (``e4m3.c``), compiled at first use, bit for bit torch's.

torch's eager ops on a CPU take several passes over a bucket for what one loop does: an
FP32 quotient, then c10's scalar conversion to E4M3 (encode); an int32 index, a gather, then
a product (decode). :func:`kernels` compiles ``e4m3.c`` once per machine with the C compiler
found (``$CC``, else ``cc``) into ``$XDG_CACHE_HOME/geofp8`` (``~/.cache/geofp8``) and loads
it with :mod:`ctypes`; every rank of a job shares the file (written under a temporary name,
then renamed). Where no compiler is, or ``GEOFP8_NATIVE=0``, or the build fails (a warning
says why), :func:`kernels` is ``None`` and the codecs run torch's ops: the same bits.

The kernels take contiguous CPU tensors: FP32 values, uint8 codes, a group's FP32 scale and
its int64 length (see ``e4m3.c``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

__all__ = ["decode", "encode", "kernels"]

SOURCE = Path(__file__).with_name("e4m3.c")
# ISO C: no fused multiply-add contraction (the products stay IEEE products). Tuned for the
# CPU at hand first (AVX2 doubles the division's throughput), else for the architecture.
FLAGS = ("-O3", "-std=c11", "-ffp-contract=off", "-fPIC", "-shared")
TUNED = ("-march=native",)


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "geofp8"


def _cpu() -> str:
    """What a build tuned for this CPU depends on: its model and feature flags (a cache
    shared by different machines keeps one file per kind of CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keep = ("model name", "flags", "Features", "CPU part")
    return platform.machine() + "".join(sorted({ln for ln in lines if ln.startswith(keep)}))


def _build(compiler: str, tuning: tuple[str, ...]) -> Path:
    flags = (*FLAGS, *tuning)
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *flags, _cpu())).encode())
    target = _cache_dir() / f"e4m3-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)  # atomic: a rank never loads a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(compiler: str) -> ctypes.CDLL:
    """The library built tuned for this CPU, else (a compiler without ``-march=native``)
    for its architecture."""
    try:
        return ctypes.CDLL(str(_build(compiler, TUNED)))
    except (OSError, subprocess.SubprocessError):
        return ctypes.CDLL(str(_build(compiler, ())))


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """The loaded kernels, or ``None`` (torch's ops are used): ``GEOFP8_NATIVE=0``, no C
    compiler, or a failed build (warned once)."""
    if os.environ.get("GEOFP8_NATIVE", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    try:
        lib = _load(compiler)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        warnings.warn(f"GeoFP8: the CPU's E4M3 kernels did not build ({detail}); "
                      "torch's ops are used instead (the same results, slower)", stacklevel=2)
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.geofp8_e4m3_encode.argtypes = [p, p, p, p, i64]
    lib.geofp8_e4m3_decode.argtypes = [p, p, p, p, i64, p]
    lib.geofp8_e4m3_encode.restype = lib.geofp8_e4m3_decode.restype = None
    return lib


@functools.lru_cache(maxsize=1024)
def _lengths(lengths: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """The groups' lengths as an int64 tensor (once per distinct tuple) and their sum."""
    return torch.tensor(lengths, dtype=torch.int64), sum(lengths)


def _checked(lengths: tuple[int, ...], scales: torch.Tensor, *tensors: torch.Tensor
             ) -> torch.Tensor:
    """The int64 lengths, once the kernels' bounds are known to hold (they trust them)."""
    lengths_t, total = _lengths(tuple(lengths))
    if scales.dtype != torch.float32 or scales.numel() != len(lengths):
        raise ValueError("the native kernels take one FP32 scale per group")
    for t in (scales, *tensors):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("the native kernels take contiguous CPU tensors")
    for t in tensors:
        if t.numel() != total:
            raise ValueError(f"the groups hold {total} elements, a tensor {t.numel()}")
    return lengths_t


def encode(codes: torch.Tensor, x: torch.Tensor, scales: torch.Tensor,
           lengths: tuple[int, ...]) -> None:
    """``codes[i] = e4m3(x[i] / scales[g])`` for the FP32 ``x`` cut into groups of
    ``lengths`` (``codes``: one byte per element, uint8 or ``float8_e4m3fn``)."""
    if x.dtype != torch.float32 or codes.element_size() != 1:
        raise ValueError("the native encode takes FP32 values and one-byte codes")
    n = _checked(lengths, scales, codes, x)
    kernels().geofp8_e4m3_encode(x.data_ptr(), codes.data_ptr(), n.data_ptr(),
                                 scales.data_ptr(), n.numel())


def decode(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
           lengths: tuple[int, ...], minus: torch.Tensor | None = None) -> None:
    """``out[i] = value(codes[i]) · scales[g]`` (or ``minus[i] −`` that) for the groups of
    ``lengths``, ``value``: torch's FP32 value of the E4M3 byte."""
    extra = () if minus is None else (minus,)
    if any(t.dtype != torch.float32 for t in (out, *extra)) or codes.element_size() != 1:
        raise ValueError("the native decode takes FP32 values and one-byte codes")
    n = _checked(lengths, scales, out, codes, *extra)
    kernels().geofp8_e4m3_decode(codes.data_ptr(), out.data_ptr(), n.data_ptr(),
                                 scales.data_ptr(), n.numel(),
                                 None if minus is None else minus.data_ptr())
