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
from ..errors import UsageError
from ..shadow import ShadowState, shadow_hook
from ..wire import ByteCounter
from .config import METHODS, TrainConfig, make_comm_hook

__all__ = ["PARALLEL", "Wrapped", "shard_size", "wrap"]

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

    method = METHODS[cfg.method]  # a DDP-only method is refused by TrainConfig
    hsdp = cfg.parallel == "hsdp"
    shard = shard_size(cfg, world)
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
    settings = {k: v for k, v in cfg.method_settings().items()
                if k not in ("hierarchy", "node_size")}  # DDP's node layout
    config = method.config(**method.takes(**settings))
    state = geofp8_fsdp.enable(model, config, mesh=mesh)
    return Wrapped(model, state, None, None, None)


def shard_size(cfg: TrainConfig, world: int) -> int:
    """Ranks per shard group of ``--parallel fsdp|hsdp`` on ``world`` ranks; a
    ``--shard-size`` that does not split them is refused (by the launcher before any rank
    starts, by each rank of a launch by hand)."""
    hsdp = cfg.parallel == "hsdp"
    shard = cfg.shard_size or (world // 2 if hsdp else world)
    if shard < 1 or world % shard or (hsdp and world // shard < 2):
        raise UsageError(f"--shard-size {shard} must divide the {world} ranks"
                         + (" into at least 2 replicas" if hsdp else ""))
    return shard


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
