"""Verification of a saved GeoFP8 state, before anything is loaded from it.

A state (:meth:`geofp8.engine.SyncEngine.state_dict`) records what it belongs to: the format
version, the adapter, the config, the world size, the rank that wrote it and the model's
parameters (name, shape, dtype, trainable), and a CRC-32 :func:`checksum` of everything it
holds (tensors by their dtype, shape and bytes; plain values by their text). :func:`refusal`
checks each of these against the state that would load it, then that every residual, factor
and statistic is finite (not the selection's measurements: a budget marks a path a tensor
cannot take with NaN), and names the first that fails with what to do. The engine loads
nothing from a refused state.
"""

from __future__ import annotations

import zlib

import torch

from .feedback import unpack

__all__ = ["checksum", "differences", "refusal"]


def checksum(state: dict) -> int:
    """CRC-32 of every entry of ``state`` but ``"checksum"``, in sorted key order."""
    crc = 0

    def walk(path: str, obj) -> None:
        nonlocal crc
        if isinstance(obj, torch.Tensor):
            flat = obj.detach().contiguous().reshape(-1)
            crc = zlib.crc32(f"{path}:{flat.dtype}:{list(obj.shape)}".encode(), crc)
            crc = zlib.crc32(flat.view(torch.uint8).cpu().numpy().tobytes(), crc)
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                walk(f"{path}/{key}", obj[key])
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                walk(f"{path}/{i}", value)
        else:
            crc = zlib.crc32(f"{path}={obj!r}".encode(), crc)

    for key in sorted(state, key=str):
        if key != "checksum":
            walk(str(key), state[key])
    return crc


def refusal(state, mine: dict) -> str | None:
    """Why ``state`` cannot be loaded into the state described by ``mine`` (its ``version``,
    ``kind``, ``config``, ``world_size``, ``rank`` and ``parameters``), or ``None``."""
    if not isinstance(state, dict):
        return f"it is a {type(state).__name__}, not a GeoFP8 state dict"
    if state.get("version") != mine["version"]:
        return (f"version: it is version {state.get('version')!r}, this GeoFP8 reads "
                f"{mine['version']} (older states carry no rank, parameter fingerprint or "
                "checksum and cannot be verified); resume it with the GeoFP8 release that "
                "wrote it, or do not load it (residuals restart at zero)")
    if state.get("kind") != mine["kind"]:
        return (f"kind: it was written by a {state.get('kind')!r} state, this is a "
                f"{mine['kind']!r} one; load it into the adapter that wrote it")
    if state.get("config") != mine["config"]:
        theirs = state.get("config") or {}
        diff = {k: (theirs.get(k), v) for k, v in mine["config"].items() if theirs.get(k) != v}
        return (f"config: it was written with another config, (checkpoint, current) = {diff}; "
                "resume with the config the run was started with")
    if state.get("world_size") != mine["world_size"]:
        return (f"world_size: it was written on {state.get('world_size')} ranks, this run has "
                f"{mine['world_size']}; the error-feedback residuals are per rank and cannot "
                f"be resharded: resume on {state.get('world_size')} ranks")
    if state.get("rank") != mine["rank"]:
        return (f"rank: it was written by rank {state.get('rank')}, this is rank "
                f"{mine['rank']}; every rank loads the state it wrote itself (its residuals "
                "are its own): give each rank its own file")
    if state.get("parameters") != mine["parameters"]:
        return ("parameters: it was written for another model ("
                + differences("parameters", state.get("parameters") or [],
                              mine["parameters"]) + "); load it into the model that wrote it")
    if state.get("checksum") != checksum(state):
        return ("checksum: its contents do not match the checksum written with them (the "
                "file was damaged or altered after it was written); use another checkpoint")
    bad = _not_finite(state)
    if bad:
        return (f"finite: {bad} holds NaN or infinite values (the run that wrote it had "
                "diverged, or the file was written damaged); resume from an earlier checkpoint")
    return None


def differences(what: str, a: list, b: list) -> str:
    """The first differences of two lists of ``[name, shape, dtype, trainable]``."""
    diff = [(x, y) for x, y in zip(a, b) if x != y][:3]
    return f"{len(a)} vs {len(b)} {what}; first differences {diff}"


def _not_finite(state: dict) -> str | None:
    """The first residual, factor or statistic of ``state`` that is not finite (one host
    read for all of them)."""
    named: list[tuple[str, torch.Tensor]] = []
    for name, feedback in state.get("feedback", {}).items():
        named += [(f"the {name} residual of {p}", unpack(r))
                  for p, r in feedback.get("residuals", {}).items()]
        named += _floats(f"the {name} residuals' coordinates", feedback.get("basis"))
    named += _floats("the factors and statistics", state.get("source"))
    if not named:
        return None
    flags = torch.stack([torch.isfinite(t).all().cpu() for _, t in named]).tolist()
    return next((name for (name, _), ok in zip(named, flags) if not ok), None)


def _floats(where: str, obj, path: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        if not obj.is_floating_point():
            return []
        return [(f"{where} ({path.lstrip('/')})", obj if obj.element_size() > 1 else obj.float())]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _floats(where, v, f"{path}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _floats(where, v, f"{path}/{i}")]
    return []
