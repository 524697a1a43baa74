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
divisors) per group, the groups as runs of equal lengths (:func:`~.base.group_runs`), and
trust the bounds that the wrappers below check. Like torch's own CPU ops, a call of at least
:data:`PARALLEL_MIN` elements per thread is split across ``torch.get_num_threads()`` threads
(``ctypes`` releases the GIL): one thread in a ``torchrun`` rank, where ``OMP_NUM_THREADS=1``.
In one process running torch on several threads, torch's OpenMP workers spin for a while
after each parallel op and take cores from that split: on 2 cores NVFP4's encode of 64 MB
took 21–26 ms, 12–15 ms with ``OMP_WAIT_POLICY=PASSIVE`` (E4M3's, with fewer torch ops
between its kernels, 8–10 ms either way).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .base import group_runs

__all__ = ["PARALLEL_MIN", "e2m1_decode", "e2m1_encode", "e4m3_decode", "e4m3_encode",
           "hash_uniforms",
           "kernels", "length_runs", "nvfp4_scales", "runs_amax", "usable"]

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
    for f in (lib.geofp8_e4m3_encode, lib.geofp8_e2m1_encode):
        f.argtypes, f.restype = [p, p, p, p, p, i64, i64, i64], None
    for f in (lib.geofp8_e4m3_decode, lib.geofp8_e2m1_decode):
        f.argtypes, f.restype = [p, p, p, p, i64, i64, i64], None
    lib.geofp8_runs_amax.argtypes = [p, p, p, i64, i64, i64, i64]
    lib.geofp8_nvfp4_scales.argtypes = [p, p, p, p, p, i64, i64, i64]
    lib.geofp8_runs_amax.restype = lib.geofp8_nvfp4_scales.restype = None
    lib.geofp8_hash_uniforms.argtypes, lib.geofp8_hash_uniforms.restype = [p, i64, i64, i64,
                                                                            i64], None
    return lib


def _on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _require_cpu(*tensors: torch.Tensor) -> None:
    if not _on_cpu(*tensors):
        raise ValueError("the native kernels take contiguous CPU tensors")


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels are built and take these tensors (contiguous, on the CPU)."""
    return _on_cpu(*tensors) and kernels() is not None


# -- threads ---------------------------------------------------------------------------------

Runs = list[tuple[int, int, int, int]]  # (first element, first group, groups, group length)

PARALLEL_MIN = 1 << 18  # elements a thread takes at least (1 MB of FP32): smaller calls run alone
ALIGN = 64  # elements: a cut between threads splits neither a byte of nibbles nor a cache line


@functools.cache
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    """Worker threads of this process (``pid``: a forked child makes its own)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="geofp8-native")


def _cuts(numel: int, runs: Runs | None = None) -> list[int]:
    """``[0, …, numel]``: a range per thread, cut at multiples of :data:`ALIGN` elements, or
    (``runs`` given) at the start of the group holding the cut."""
    parts = min(torch.get_num_threads(), numel // PARALLEL_MIN)
    cuts = [numel * t // parts for t in range(1, parts)]
    if runs is None:
        cuts = [c - c % ALIGN for c in cuts]
    else:
        firsts = [run[0] for run in runs]
        cuts = [_group_start(runs[bisect.bisect_right(firsts, c) - 1], c) for c in cuts]
    return sorted({0, *cuts, numel})


def _group_start(run: tuple[int, int, int, int], element: int) -> int:
    first, _, _, size = run
    return first + (element - first) // size * size if size else first


def _parallel(job, cuts: list[int]) -> None:
    """``job(i, lo, hi)`` for every range ``i`` of ``cuts``, the first on this thread."""
    ranges = list(zip(cuts, cuts[1:]))
    if len(ranges) > 1:
        pool = _pool(len(ranges) - 1, os.getpid())
        jobs = [pool.submit(job, i, lo, hi) for i, (lo, hi) in enumerate(ranges) if i]
        job(0, *ranges[0])
        for done in jobs:
            done.result()
    elif ranges:
        job(0, *ranges[0])


def _call(kernel, cuts: list[int], *args) -> None:
    """``kernel(*args, lo, hi)`` for every range of ``cuts``."""
    _parallel(lambda _, lo, hi: kernel(*args, lo, hi), cuts)


# -- the kernels -----------------------------------------------------------------------------


def _runs(runs: Runs, groups: int, numel: int, scales: torch.Tensor,
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


@functools.lru_cache(maxsize=1024)
def length_runs(lengths: tuple[int, ...]) -> Runs:
    """Groups of ``lengths`` (once per distinct tuple) as runs."""
    return group_runs([lengths])


def _e4m3_runs(fp32: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
               lengths: tuple[int, ...]) -> torch.Tensor:
    if fp32.dtype != torch.float32 or codes.element_size() != 1:
        raise ValueError("the native E4M3 kernels take FP32 values and one-byte codes")
    if codes.numel() != fp32.numel():
        raise ValueError(f"{fp32.numel()} values and {codes.numel()} codes were given")
    return _runs(length_runs(tuple(lengths)), len(lengths), fp32.numel(), scales, codes, fp32)


def _error_ptr(error: torch.Tensor | None, x: torch.Tensor) -> int | None:
    """``error``'s address (``None``: NULL) once it is an FP32 vector of ``x``'s size."""
    if error is None:
        return None
    if error.dtype != torch.float32 or error.numel() != x.numel():
        raise ValueError(f"the rounding error takes {x.numel()} FP32 values, got "
                         f"{error.numel()} of {error.dtype}")
    _require_cpu(error)
    return error.data_ptr()


def e4m3_encode(codes: torch.Tensor, x: torch.Tensor, scales: torch.Tensor,
                lengths: tuple[int, ...], error: torch.Tensor | None = None) -> None:
    """``codes[i] = e4m3(x[i] / scales[g])`` for the FP32 ``x`` cut into groups of
    ``lengths`` (``codes``: one byte per element, uint8 or ``float8_e4m3fn``); with
    ``error``, also ``error[i] = x[i] − value(codes[i]) · scales[g]`` in the same pass (what
    :func:`e4m3_decode` and a subtraction give; ``error`` may be ``x`` itself)."""
    r = _e4m3_runs(x, codes, scales, lengths)
    _call(kernels().geofp8_e4m3_encode, _cuts(x.numel()), x.data_ptr(), codes.data_ptr(),
          _error_ptr(error, x), scales.data_ptr(), r.data_ptr(), r.shape[0])


def e4m3_decode(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                lengths: tuple[int, ...]) -> None:
    """``out[i] = value(codes[i]) · scales[g]`` for the groups of ``lengths``, ``value``:
    torch's FP32 value of the E4M3 byte."""
    r = _e4m3_runs(out, codes, scales, lengths)
    _call(kernels().geofp8_e4m3_decode, _cuts(out.numel()), codes.data_ptr(), out.data_ptr(),
          scales.data_ptr(), r.data_ptr(), r.shape[0])


def e2m1_encode(packed: torch.Tensor, x: torch.Tensor, scale: torch.Tensor,
                runs: Runs, error: torch.Tensor | None = None) -> None:
    """Nibble ``i`` of ``packed`` (``⌈n/2⌉`` bytes, element ``2i`` low) ``= e2m1(x[i] /
    d_g)`` over the groups of ``runs`` (:func:`~.base.group_runs`), ``d_g = scale[g]`` or 1
    where that is not positive (0 or NaN); with ``error``, also ``error[i] = x[i] −
    value(nibble i) · scale[g]`` in the same pass (what :func:`e2m1_decode` and a
    subtraction give)."""
    if x.dtype != torch.float32 or packed.dtype != torch.uint8 or \
            packed.numel() != (x.numel() + 1) // 2:
        raise ValueError("the native E2M1 encode takes n FP32 values and ⌈n/2⌉ packed bytes")
    r = _runs(runs, scale.numel(), x.numel(), scale, packed, x)
    _call(kernels().geofp8_e2m1_encode, _cuts(x.numel()), x.data_ptr(), packed.data_ptr(),
          _error_ptr(error, x), scale.data_ptr(), r.data_ptr(), r.shape[0])


def e2m1_decode(out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                runs: Runs) -> None:
    """``out[i] = value(nibble i of packed) · scales[g]`` over the groups of ``runs``."""
    if out.dtype != torch.float32 or packed.dtype != torch.uint8 or \
            packed.numel() < (out.numel() + 1) // 2:
        raise ValueError("the native E2M1 decode takes FP32 values and ⌈n/2⌉ packed bytes")
    r = _runs(runs, scales.numel(), out.numel(), scales, out, packed)
    _call(kernels().geofp8_e2m1_decode, _cuts(out.numel()), packed.data_ptr(), out.data_ptr(),
          scales.data_ptr(), r.data_ptr(), r.shape[0])


def hash_uniforms(u: torch.Tensor, key: tuple[int, int]) -> None:
    """``u`` (a contiguous FP32 CPU vector) = a segment's uniforms under ``key``, in one pass
    (:func:`.uniforms.uniforms`' formula, the same bits)."""
    if u.dtype != torch.float32:
        raise ValueError("the native uniforms are FP32")
    _require_cpu(u)
    _call(kernels().geofp8_hash_uniforms, _cuts(u.numel()), u.data_ptr(), *key)


def runs_amax(x: torch.Tensor, runs: Runs, groups: int, finite_only: bool = False
              ) -> torch.Tensor:
    """Max ``|x|`` of each of the ``groups`` groups of ``runs`` (a new FP32 tensor); ``+Inf``
    for a group holding NaN or ±Inf, or (``finite_only``) non-finite values counted as 0.

    Threads take whole groups; where there are fewer groups than threads (one per tensor),
    each takes a range of elements and its own maxima, then the maximum of those is taken."""
    if x.dtype != torch.float32:
        raise ValueError("the native amax takes FP32 values")
    whole = groups >= torch.get_num_threads()
    cuts = _cuts(x.numel(), runs if whole else None)
    maxima = torch.zeros(1 if whole else max(1, len(cuts) - 1), groups)  # 0: an empty group
    r = _runs(runs, groups, x.numel(), maxima[0], x)
    kernel, args = kernels().geofp8_runs_amax, (r.data_ptr(), r.shape[0], int(finite_only))
    _parallel(lambda i, lo, hi: kernel(x.data_ptr(), maxima[i % len(maxima)].data_ptr(),
                                       *args, lo, hi), cuts)
    return maxima[0] if len(maxima) == 1 else maxima.amax(0)


def nvfp4_scales(amax: torch.Tensor, s: torch.Tensor, counts: tuple[int, ...]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's block scale codes (uint8) and values (FP32) from every block's ``amax``
    (``+Inf``: non-finite) and its segment's scale ``s`` (``counts``: blocks per segment),
    as :class:`geofp8.codecs.fp4.NVFP4Codec` computes them with torch's ops."""
    if amax.dtype != torch.float32:
        raise ValueError("the native NVFP4 scales take FP32 block amaxes")
    runs = length_runs(tuple(counts))
    r = _runs(runs, len(counts), amax.numel(), s, amax)
    code = torch.empty(amax.numel(), dtype=torch.uint8)
    scale = torch.empty(amax.numel(), dtype=torch.float32)
    _call(kernels().geofp8_nvfp4_scales, _cuts(amax.numel()), amax.data_ptr(), code.data_ptr(),
          scale.data_ptr(), s.data_ptr(), r.data_ptr(), r.shape[0])
    return code, scale
