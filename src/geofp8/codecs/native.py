"""The CPU's codec kernels in C (``native.c``), compiled at first use, bit for bit torch's.

torch's eager ops on a CPU take several passes over a bucket for what one loop does: an
FP32 quotient, then c10's scalar conversion to E4M3 (encode); an int32 index, a gather, then
a product (decode); for NVFP4's E2M1 elements a division, a rounding key, a lookup and the
nibble packing. :func:`kernels` compiles ``native.c`` once per machine with the C compiler
found (``$CC``, else ``cc``) into ``$XDG_CACHE_HOME/geofp8`` (``~/.cache/geofp8``) and loads
it with :mod:`ctypes`; every rank of a job shares the file (written under a temporary name,
then renamed). Where no compiler is, or ``GEOFP8_NATIVE=0``, or the build fails (a warning
says why), :func:`kernels` is ``None`` and the codecs run torch's ops: the same bits.

The kernels take contiguous CPU tensors: FP32 values, uint8 codes, FP32 scales (or
divisors) per group, the groups' int64 lengths or runs (see ``native.c``), and trust the
bounds that the wrappers below check.
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

__all__ = ["e2m1_decode", "e2m1_encode", "e4m3_decode", "e4m3_encode", "kernels",
           "pack_nibbles", "runs_amax", "usable"]

SOURCE = Path(__file__).with_name("native.c")
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
    target = _cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"
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
        warnings.warn(f"GeoFP8: the CPU's codec kernels did not build ({detail}); "
                      "torch's ops are used instead (the same results, slower)", stacklevel=2)
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.geofp8_e4m3_encode.argtypes = [p, p, p, p, i64]
    lib.geofp8_e4m3_decode.argtypes = [p, p, p, p, i64]
    lib.geofp8_e2m1_encode.argtypes = lib.geofp8_e2m1_decode.argtypes = [p, p, p, p, i64]
    lib.geofp8_pack_nibbles.argtypes = [p, p, i64]
    lib.geofp8_runs_amax.argtypes = [p, p, p, i64]
    for f in (lib.geofp8_e4m3_encode, lib.geofp8_e4m3_decode, lib.geofp8_e2m1_encode,
              lib.geofp8_e2m1_decode, lib.geofp8_pack_nibbles, lib.geofp8_runs_amax):
        f.restype = None
    return lib


def _on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _require_cpu(*tensors: torch.Tensor) -> None:
    if not _on_cpu(*tensors):
        raise ValueError("the native kernels take contiguous CPU tensors")


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels are built and take these tensors (contiguous, on the CPU)."""
    return _on_cpu(*tensors) and kernels() is not None


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
    _require_cpu(scales, *tensors)
    for t in tensors:
        if t.numel() != total:
            raise ValueError(f"the groups hold {total} elements, a tensor {t.numel()}")
    return lengths_t


def e4m3_encode(codes: torch.Tensor, x: torch.Tensor, scales: torch.Tensor,
                lengths: tuple[int, ...]) -> None:
    """``codes[i] = e4m3(x[i] / scales[g])`` for the FP32 ``x`` cut into groups of
    ``lengths`` (``codes``: one byte per element, uint8 or ``float8_e4m3fn``)."""
    if x.dtype != torch.float32 or codes.element_size() != 1:
        raise ValueError("the native encode takes FP32 values and one-byte codes")
    n = _checked(lengths, scales, codes, x)
    kernels().geofp8_e4m3_encode(x.data_ptr(), codes.data_ptr(), n.data_ptr(),
                                 scales.data_ptr(), n.numel())


def e4m3_decode(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                lengths: tuple[int, ...]) -> None:
    """``out[i] = value(codes[i]) · scales[g]`` for the groups of ``lengths``, ``value``:
    torch's FP32 value of the E4M3 byte."""
    if out.dtype != torch.float32 or codes.element_size() != 1:
        raise ValueError("the native decode takes FP32 values and one-byte codes")
    n = _checked(lengths, scales, out, codes)
    kernels().geofp8_e4m3_decode(codes.data_ptr(), out.data_ptr(), n.data_ptr(),
                                 scales.data_ptr(), n.numel())


def _runs(runs: list[tuple[int, int, int, int]], groups: int, numel: int, scales: torch.Tensor,
          *tensors: torch.Tensor) -> torch.Tensor:
    """The runs ``(first element, first group, groups, length)`` as an int64 ``[R, 4]``
    tensor, once they are known to tile ``numel`` elements and ``groups`` groups in order."""
    lo = g = 0
    for first, g0, count, size in runs:
        if first != lo or g0 != g or count < 0 or size < 0:
            raise ValueError("the runs do not tile the elements in order")
        lo, g = lo + count * size, g + count
    if (lo, g) != (numel, groups) or scales.numel() != groups or scales.dtype != torch.float32:
        raise ValueError(f"the runs hold {lo} elements in {g} groups; {numel} elements and "
                         f"{scales.numel()} FP32 scales were given")
    _require_cpu(scales, *tensors)
    return torch.tensor(runs, dtype=torch.int64).reshape(-1, 4)


def e2m1_encode(codes: torch.Tensor, x: torch.Tensor, divisor: torch.Tensor,
                runs: list[tuple[int, int, int, int]]) -> None:
    """``codes[i] = e2m1(x[i] / divisor[g])`` (uint8, one code per element) over the groups
    of ``runs`` (:func:`geofp8.codecs.fp4.block_runs`)."""
    if x.dtype != torch.float32 or codes.dtype != torch.uint8 or codes.numel() != x.numel():
        raise ValueError("the native E2M1 encode takes FP32 values and a uint8 code each")
    r = _runs(runs, divisor.numel(), x.numel(), divisor, codes, x)
    kernels().geofp8_e2m1_encode(x.data_ptr(), codes.data_ptr(), divisor.data_ptr(),
                                 r.data_ptr(), r.shape[0])


def pack_nibbles(codes: torch.Tensor, out: torch.Tensor) -> None:
    """Two 4-bit ``codes`` per byte of ``out`` (``⌈n/2⌉`` bytes), element ``2i`` low."""
    if codes.dtype != torch.uint8 or out.dtype != torch.uint8 or \
            out.numel() != (codes.numel() + 1) // 2:
        raise ValueError("pack_nibbles takes n uint8 codes and ⌈n/2⌉ bytes")
    _require_cpu(codes, out)
    kernels().geofp8_pack_nibbles(codes.data_ptr(), out.data_ptr(), codes.numel())


def e2m1_decode(out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                runs: list[tuple[int, int, int, int]]) -> None:
    """``out[i] = value(nibble i of packed) · scales[g]`` over the groups of ``runs``."""
    if out.dtype != torch.float32 or packed.dtype != torch.uint8 or \
            packed.numel() < (out.numel() + 1) // 2:
        raise ValueError("the native E2M1 decode takes FP32 values and ⌈n/2⌉ packed bytes")
    r = _runs(runs, scales.numel(), out.numel(), scales, out, packed)
    kernels().geofp8_e2m1_decode(packed.data_ptr(), out.data_ptr(), scales.data_ptr(),
                                 r.data_ptr(), r.shape[0])


def runs_amax(x: torch.Tensor, runs: list[tuple[int, int, int, int]],
              groups: int) -> torch.Tensor:
    """Max ``|x|`` of each of the ``groups`` groups of ``runs`` (a new FP32 tensor); NaN for
    a group holding a NaN (its payload unspecified)."""
    amax = torch.empty(groups, dtype=torch.float32)
    if x.dtype != torch.float32:
        raise ValueError("the native amax takes FP32 values")
    r = _runs(runs, groups, x.numel(), amax, x)
    kernels().geofp8_runs_amax(x.data_ptr(), amax.data_ptr(), r.data_ptr(), r.shape[0])
    return amax
