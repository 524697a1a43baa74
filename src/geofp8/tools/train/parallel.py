"""How ``geofp8 train`` wraps the model: ``--parallel ddp`` (DDP and the method's comm
hook), ``fsdp`` (``fully_shard`` on every decoder layer and the root; GeoFP8's FP8
reduce-scatter) or ``hsdp`` (a ``(replicate, shard)`` mesh: shard inside a group of
``--shard-size`` ranks, GeoFP8's FP8 reduce-scatter and FP8 replica all-reduce).

The ``fp32`` method on fsdp/hsdp is FSDP's own default (native HSDP on the 2-D mesh).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ...comm import fp32_allreduce_wire_bytes
from ..shadow import ShadowState, shadow_hook
from ..wire import ByteCounter
from .config import METHODS, TrainConfig, make_comm_hook

__all__ = ["PARALLEL", "Wrapped", "wrap"]

PARALLEL = ("ddp", "fsdp", "hsdp")


@dataclass
class Wrapped:
    """The module to call, the method's state (``stats()``), the fixed width of an
    uncounted all-reduce, the byte counter of a Python hook, the DDP shadow state."""

    module: torch.nn.Module
    state: object
    width: int | None
    counter: ByteCounter | None
    shadow: ShadowState | None


def wrap(model: torch.nn.Module, cfg: TrainConfig, rank: int, world: int,
         device: torch.device) -> Wrapped:
    if cfg.parallel == "ddp":
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  bucket_cap_mb=1024 if METHODS[cfg.method].one_bucket else None)
        state, hook, width = make_comm_hook(cfg.method, model, cfg)
        counter = ByteCounter(rank, world) if width is None and not hasattr(state, "stats") \
            else None
        shadow = ShadowState(state, hook)
        ddp.register_comm_hook(shadow, shadow_hook)
        return Wrapped(ddp, state, width, counter, shadow)
    return _sharded(model, cfg, world, device)


def _sharded(model, cfg: TrainConfig, world: int, device: torch.device) -> Wrapped:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ... import fsdp as geofp8_fsdp

    method = METHODS[cfg.method]
    if method.kind not in ("allreduce", "geofp8"):
        raise ValueError(f"--parallel {cfg.parallel} runs the fp32 and GeoFP8 methods, not "
                         f"{cfg.method!r} (a DDP comm hook)")
    hsdp = cfg.parallel == "hsdp"
    shard = cfg.shard_size or (world // 2 if hsdp else world)
    if world % shard or (hsdp and world // shard < 2):
        raise ValueError(f"--shard-size {shard} must divide the {world} ranks"
                         + (" into at least 2 replicas" if hsdp else ""))
    mesh = init_device_mesh(device.type, (world // shard, shard),
                            mesh_dim_names=("replicate", "shard")) if hsdp else None
    native = method.kind == "allreduce"
    shard_on = mesh if (hsdp and native) else (mesh["shard"] if hsdp else None)
    kw = {"mesh": shard_on} if shard_on is not None else {}
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("--parallel fsdp/hsdp shards a Hugging Face decoder "
                         "(model.model.layers)")
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    if native:
        return Wrapped(model, FP32Sharded(model, world, shard), None, None, None)
    config = method.config(**method.takes(format=cfg.format, k=cfg.k, budget=cfg.budget,
                                          refresh_every=cfg.refresh_every,
                                          profile_steps=cfg.profile_steps, seed=cfg.seed,
                                          kernels=cfg.kernels, residual=cfg.residual))
    state = geofp8_fsdp.enable(model, config, mesh=mesh)
    return Wrapped(model, state, None, None, None)


class FP32Sharded:
    """Byte figures of FSDP's own FP32 reduce-scatter (and native HSDP all-reduce), in the
    units of :meth:`geofp8.fsdp.GeoFP8FSDP.stats`."""

    def __init__(self, model: torch.nn.Module, world: int, shard: int) -> None:
        self.shard, self.replicas = shard, world // shard
        self.unsharded = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def stats(self) -> dict:
        per_shard = self.unsharded / self.shard
        sent = (self.shard - 1) * per_shard * 4
        if self.replicas > 1:
            sent += fp32_allreduce_wire_bytes(int(per_shard), self.replicas)
        return {"bytes_sent": int(sent), "bytes_fp32_equivalent": int(sent),
                "bytes_per_element": sent / self.unsharded, "geometry_layers": []}

    def state_dict(self) -> dict:
        """Nothing to keep in a checkpoint: FSDP's own reduction has no state."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
