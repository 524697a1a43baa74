"""The training driver's optimizers: Muon on the hidden 2-D weights + AdamW on the rest.

``torch.optim.Muon`` (torch 2.9–2.13) always runs its Newton–Schulz orthogonalization in
bfloat16. A CPU without native BF16 arithmetic (no AVX512-BF16/AMX-BF16; e.g. AVX2-only
x86) emulates every BF16 matmul, about 10–25× slower than FP32 (measured on 128×352
matrices), and the optimizer then costs several times the forward and backward. :class:`Muon` is
``torch.optim.Muon`` with the iteration's dtype as an argument; :func:`orthogonalization_dtype`
chooses BF16 where the device computes it natively (CUDA with BF16, x86 with AVX512-BF16 or
AMX-BF16, Arm with BF16) and FP32 elsewhere. ``GEOFP8_MUON_NS_DTYPE=bfloat16|float32``
overrides the choice; :func:`build_optimizers` makes every rank use the same one.
"""

from __future__ import annotations

import os
import platform

import torch
import torch.distributed as dist
from torch.optim._muon import _adjust_lr  # torch's own lr rule, so updates match it exactly

from ..errors import UsageError

__all__ = ["Muon", "build_optimizers", "native_bf16", "optimizer_info",
           "orthogonalization_dtype", "zeropower"]

NS_DTYPE_ENV = "GEOFP8_MUON_NS_DTYPE"
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# oneDNN instruction sets (ONEDNN_MAX_CPU_ISA) below the first one with BF16 dot products
_ONEDNN_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                        "AVX512_CORE_VNNI"}


def zeropower(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
              eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Quintic Newton–Schulz orthogonalization ``X ← aX + (bXXᵀ + c(XXᵀ)²)X`` of
    ``X₀ = G/‖G‖_F`` in ``dtype``, ``steps`` times: ≈ ``UVᵀ`` of ``G = USVᵀ`` (singular
    values pushed into about [0.7, 1.2]). The same arithmetic as torch's
    ``_zeropower_via_newtonschulz``, which is this function at ``dtype=torch.bfloat16``."""
    a, b, c = coefficients
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` (same arguments, state and updates) whose Newton–Schulz
    iteration runs in ``ns_dtype`` instead of always in bfloat16."""

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        self.ns_reason = "chosen by the caller"  # recorded in run.json

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            lr, momentum = group["lr"], group["momentum"]
            for p, g, buf in zip(params, grads, buffers):
                buf.lerp_(g, 1 - momentum)
                update = g.lerp(buf, momentum) if group["nesterov"] else buf
                update = zeropower(update, group["ns_coefficients"], group["ns_steps"],
                                   group["eps"], self.ns_dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """``(True, why)`` when ``device`` multiplies BF16 matrices in hardware, else
    ``(False, why)``. CPUs: oneDNN's BF16 path must be available (it honours
    ``ONEDNN_MAX_CPU_ISA``) and, on x86, the CPU must have AVX512-BF16 or AMX-BF16."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported(including_emulation=False)
        return ok, f"CUDA {'with' if ok else 'without'} native BF16"
    if device.type != "cpu":
        return False, f"{device.type}: not known to have native BF16"
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if isa in _ONEDNN_WITHOUT_BF16:
        return False, f"ONEDNN_MAX_CPU_ISA={isa} excludes BF16 instructions"
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        onednn = False
    if not onednn:
        return False, "no oneDNN BF16 path on this CPU"
    if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86"):
        found = sorted(_cpu_flags() & {"avx512_bf16", "amx_bf16"})
        if not found:
            return False, "x86 CPU without avx512_bf16 or amx_bf16"
        return True, f"x86 CPU with {', '.join(found)}"
    return True, f"{platform.machine()} CPU with oneDNN BF16"


def orthogonalization_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """Muon's Newton–Schulz dtype on ``device`` and why: ``$GEOFP8_MUON_NS_DTYPE`` when set
    (``bfloat16``, ``float32`` or ``auto``), else bfloat16 where it is native, float32
    elsewhere."""
    choice = os.environ.get(NS_DTYPE_ENV, "auto").strip().lower() or "auto"
    if choice in _DTYPES:
        return _DTYPES[choice], f"{NS_DTYPE_ENV}={choice}"
    if choice != "auto":
        raise UsageError(f"{NS_DTYPE_ENV} must be auto, bfloat16 or float32, not {choice!r}")
    native, why = native_bf16(device)
    return (torch.bfloat16 if native else torch.float32), why


def _agreed_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """BF16 only if every rank of the default group chose it: one dtype for all ranks, so
    replicas stay identical."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dtype
    bf16 = torch.tensor([int(dtype == torch.bfloat16)], device=device)
    dist.all_reduce(bf16, op=dist.ReduceOp.MIN)
    return torch.bfloat16 if int(bf16) else torch.float32


def build_optimizers(model: torch.nn.Module, cfg,
                     ns_dtype: torch.dtype | None = None) -> list[torch.optim.Optimizer]:
    """Muon on the hidden 2-D weights + AdamW on the rest (``cfg.optimizer == "muon"``, the
    paper), or AdamW throughout. Weight decay on matrices (embeddings and head included),
    none on norms and biases. Muon's Newton–Schulz dtype: ``ns_dtype``, or by default
    :func:`orthogonalization_dtype` of the model's device, the same on every rank
    (``optimizers[0].ns_dtype``, ``.ns_reason``)."""
    embeddings = {id(m.weight) for m in (model.get_input_embeddings(),
                                         model.get_output_embeddings()) if m is not None}
    hidden, matrices, vectors = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 2 and id(p) not in embeddings:
            hidden.append(p)
        elif p.ndim >= 2:
            matrices.append(p)
        else:
            vectors.append(p)
    adamw = dict(lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW([{"params": hidden + matrices,
                                    "weight_decay": cfg.weight_decay},
                                   {"params": vectors, "weight_decay": 0.0}], **adamw)]
    device = next(model.parameters()).device
    if ns_dtype is None:
        dtype, why = orthogonalization_dtype(device)
        agreed = _agreed_dtype(dtype, device)
    else:
        dtype, why, agreed = ns_dtype, "chosen by the caller", ns_dtype
    muon = Muon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay,
                adjust_lr_fn="match_rms_adamw", ns_dtype=agreed)
    muon.ns_reason = why if agreed == dtype else "another rank has no native BF16"
    rest = torch.optim.AdamW([{"params": matrices, "weight_decay": cfg.weight_decay},
                              {"params": vectors, "weight_decay": 0.0}], **adamw)
    return [muon, rest]


def optimizer_info(optimizers: list[torch.optim.Optimizer]) -> dict:
    """What ``run.json`` records about the optimizers: their classes and Muon's
    Newton–Schulz dtype and the reason for it."""
    info: dict = {"optimizers": [type(o).__name__ for o in optimizers]}
    for o in optimizers:
        if isinstance(o, Muon):
            info["muon_ns_dtype"] = str(o.ns_dtype).removeprefix("torch.")
            info["muon_ns_reason"] = o.ns_reason
    return info
