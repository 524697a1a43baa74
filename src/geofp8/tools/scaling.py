"""Alpha-beta model of data-parallel gradient communication and of the step time it costs.

A collective over ``N`` ranks on a ring moves data in ``N − 1`` steps; each step costs
a latency ``α`` plus its bytes over the per-rank link bandwidth ``β⁻¹``:

* all-gather / reduce-scatter / all-to-all of ``B`` bytes per rank:
  ``(N−1)·α + (N−1)/N · B / bw``
* all-reduce (reduce-scatter + all-gather): ``2(N−1)·α + 2(N−1)/N · B / bw``

With ``g`` GPUs per node the all-reduce is hierarchical: a reduce-scatter and an
all-gather inside the node (NVLink-class bandwidth) around an inter-node all-reduce of
``B/g`` bytes per GPU on ``g`` parallel rails. GeoFP8's exact all-reduce is an all-to-all
of FP8 shards plus an all-gather of the re-quantized reduced shard: the same bytes as a
ring all-reduce of FP8 (``1 + 4/block`` bytes per element).

The step model (per optimizer step, per GPU)::

    step = compute + (1 − hidden) · comm + codec + geometry

``compute = 6 · P · tokens / (peak · mfu)``; ``hidden`` is the fraction of the
communication overlapped with the backward pass; ``codec`` and ``geometry`` are the
sender/receiver work, modelled as memory-bound passes at the device's HBM bandwidth
(the benchmark measures them as ratios to a plain copy, which is what transfers
between machines). Everything is a pure function of dataclass presets.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "DEVICES",
    "FABRICS",
    "MODELS",
    "Device",
    "Fabric",
    "ModelSpec",
    "Overheads",
    "Workload",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "calibrate_hidden",
    "gradient_bytes",
    "step_time",
    "step_change",
]

BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0}


@dataclass(frozen=True)
class Fabric:
    """Per-GPU network: latency per ring step (s), bandwidth per direction (bytes/s)."""

    name: str
    alpha: float
    inter_bw: float  # inter-node, per GPU (one rail per GPU)
    gpus_per_node: int = 1
    intra_bw: float = 450e9  # NVLink-class, per GPU per direction
    intra_alpha: float = 2e-6


FABRICS: dict[str, Fabric] = {
    "ib200": Fabric("200 Gb/s per GPU, 1 GPU/node", alpha=5e-6, inter_bw=25e9),
    "ib400": Fabric("400 Gb/s per GPU, 1 GPU/node", alpha=5e-6, inter_bw=50e9),
    "ib400x8": Fabric("400 Gb/s per GPU, 8 GPUs/node on NVLink", alpha=5e-6, inter_bw=50e9,
                      gpus_per_node=8),
    "nvlink": Fabric("NVLink-class domain (all GPUs in one NVLink domain)", alpha=2e-6,
                     inter_bw=450e9),
}


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense BF16 tensor FLOP/s
    hbm_bw: float  # bytes/s


DEVICES: dict[str, Device] = {
    "gh200": Device("GH200 (H100-class)", peak_flops=989e12, hbm_bw=4.0e12),
    "h100": Device("H100 SXM", peak_flops=989e12, hbm_bw=3.35e12),
}


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder: hidden ``d``, MLP width ``f``, ``layers``, vocabulary ``v``."""

    name: str
    d: int
    f: int
    layers: int
    vocab: int = 32000

    @property
    def params(self) -> float:
        return self.layers * (4 * self.d * self.d + 3 * self.d * self.f) + 2 * self.vocab * self.d

    @property
    def down_params(self) -> float:
        """Parameters of one MLP down projection (the paper's geometry targets)."""
        return self.d * self.f


MODELS: dict[str, ModelSpec] = {
    "0.1B": ModelSpec("0.1B", 768, 2048, 12),
    "0.6B": ModelSpec("0.6B", 1536, 4096, 18),
    "1B": ModelSpec("1B", 2048, 5632, 22),
    "7B": ModelSpec("7B", 4096, 11008, 32),
    "13B": ModelSpec("13B", 5120, 13824, 40),
    "70B": ModelSpec("70B", 8192, 28672, 80),
}


@dataclass(frozen=True)
class Workload:
    """One training configuration: model, tokens per GPU per step, device, efficiency."""

    model: ModelSpec
    tokens_per_gpu: int
    device: Device
    mfu: float = 0.4
    hidden: float = 0.0  # fraction of communication hidden behind compute
    block: int = 0  # FP8 scale block (0: per tensor, scales negligible)


@dataclass(frozen=True)
class Overheads:
    """Sender + receiver work per step, as measured ratios (from the benchmark).

    ``codec_vs_memcpy``: round-trip (quantize + dequantize) throughput over a plain copy of
    the same fp32 tensor. ``geo_vs_memcpy``: low-rank forward + inverse transform time over
    a copy of the same gradient. ``geo_fraction``: share of parameters on the geometry
    branch. ``refresh_flops_per_token``: factor sketch cost (FLOP per token per step, all
    selected layers) plus the amortised eigendecomposition, ``refresh_s_per_step``.
    """

    codec_vs_memcpy: float = 0.5
    geo_vs_memcpy: float = 2.0
    geo_fraction: float = 0.0
    refresh_flops_per_token: float = 0.0
    refresh_s_per_step: float = 0.0
    ef_vs_memcpy: float = 0.0  # fused EF + quantize path (0: same as codec_vs_memcpy)
    codec_round_trips: float = 2.0  # exact all-reduce: encode+decode at sender and shard owner


def _ring(n: int, nbytes: float, alpha: float, bw: float, factor: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return factor * (n - 1) * alpha + factor * (n - 1) / n * nbytes / bw


def all_gather_time(nbytes: float, n: int, fabric: Fabric) -> float:
    """Ring all-gather (or reduce-scatter) of ``nbytes`` per rank (the full vector)."""
    g = min(fabric.gpus_per_node, n)
    nodes = max(n // g, 1)
    return (_ring(g, nbytes, fabric.intra_alpha, fabric.intra_bw, 1)
            + _ring(nodes, nbytes / g, fabric.alpha, fabric.inter_bw, 1))


all_to_all_time = all_gather_time  # the same bytes per rank in N − 1 exchanges


def all_reduce_time(nbytes: float, n: int, fabric: Fabric,
                    intra_nbytes: float | None = None) -> float:
    """Hierarchical ring all-reduce of ``nbytes`` per rank: reduce-scatter and all-gather
    inside a node, the node's ``1/g`` share between nodes. ``intra_nbytes``: the vector's
    size inside the node when that hop sends another format (GeoFP8's hierarchical
    collective: FP32 inside, the codec's bytes between nodes)."""
    g = min(fabric.gpus_per_node, n)
    nodes = max(n // g, 1)
    inside = nbytes if intra_nbytes is None else intra_nbytes
    return (_ring(g, inside, fabric.intra_alpha, fabric.intra_bw, 2)
            + _ring(nodes, nbytes / g, fabric.alpha, fabric.inter_bw, 2))


def gradient_bytes(params: float, fmt: str, block: int = 0) -> float:
    """Wire bytes of one gradient: ``params × bytes`` (+4 per scale block for FP8)."""
    per = BYTES[fmt] + (4.0 / block if fmt == "fp8" and block else 0.0)
    return params * per


def compute_time(w: Workload) -> float:
    return 6.0 * w.model.params * w.tokens_per_gpu / (w.device.peak_flops * w.mfu)


def comm_time(w: Workload, n: int, fabric: Fabric, fmt: str, node: bool = False) -> float:
    """All-reduce time of the gradient in ``fmt``; ``node``: FP32 inside the node."""
    inside = gradient_bytes(w.model.params, "fp32") if node else None
    return all_reduce_time(gradient_bytes(w.model.params, fmt, w.block), n, fabric, inside)


def step_time(w: Workload, n: int, fabric: Fabric, method: str,
              ovh: Overheads | None = None) -> dict[str, float]:
    """Modelled step time and its parts for ``method`` in {fp32, bf16, fp8, geofp8, fp8-node}
    (``fp8-node``: FP8 between nodes only, FP32 inside them — :mod:`geofp8.hierarchy`)."""
    ovh = ovh or Overheads()
    fmt = "fp8" if method in ("fp8", "geofp8", "fp8-node") else method
    compute = compute_time(w)
    comm = comm_time(w, n, fabric, fmt, node=method == "fp8-node")
    memcpy = 2 * 4 * w.model.params / w.device.hbm_bw  # read + write fp32 gradient
    codec = ovh.codec_round_trips * memcpy / ovh.codec_vs_memcpy if fmt == "fp8" else 0.0
    geo = 0.0
    if method == "geofp8":
        if ovh.ef_vs_memcpy > 0:  # the sender's round trip becomes the fused EF path
            codec += memcpy / ovh.ef_vs_memcpy - memcpy / ovh.codec_vs_memcpy
        geo = (ovh.geo_fraction * memcpy * ovh.geo_vs_memcpy
               + ovh.refresh_flops_per_token * w.tokens_per_gpu / (w.device.peak_flops * w.mfu)
               + ovh.refresh_s_per_step)
    total = compute + (1 - w.hidden) * comm + codec + geo
    return {"compute": compute, "comm": comm, "exposed_comm": (1 - w.hidden) * comm,
            "codec": codec, "geometry": geo, "total": total}


def step_change(w: Workload, n: int, fabric: Fabric, method: str, baseline: str = "fp32",
                ovh: Overheads | None = None) -> float:
    """Relative step-time change of ``method`` vs ``baseline`` (−0.1079 = 10.79 % faster)."""
    t = step_time(w, n, fabric, method, ovh)["total"]
    b = step_time(w, n, fabric, baseline, ovh)["total"]
    return t / b - 1.0


def calibrate_hidden(w: Workload, n: int, fabric: Fabric, target: float,
                     ovh: Overheads | None = None) -> float:
    """The hidden fraction in [0, 1] that makes plain FP8's change vs FP32 equal ``target``
    (bisection; clamps when the target is out of reach)."""
    lo, hi = 0.0, 1.0
    f = lambda h: step_change(replace(w, hidden=h), n, fabric, "fp8", "fp32", ovh)  # noqa: E731
    if f(lo) > target:  # even fully exposed comm saves less than the target
        return lo
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if f(mid) < target:  # still saving more than reported: hide more
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
