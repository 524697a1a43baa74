"""GeoFP8's state in a ``torch.distributed.checkpoint`` (DCP) checkpoint, sharded per rank.

Each rank writes and reads only its own state (its error-feedback residuals differ from the
other ranks'). Two properties of DCP shape the layout:

* a plain (non-DTensor) tensor counts as replicated: ranks that save the same key write it
  once (the planner's deduplication). Every entry is therefore keyed by its rank,
  ``<key>.rank<r>/part<i>/<name>``: unique, written and read by rank ``r`` only;
* a value that is not a tensor is stored with ``torch.save`` and read back with
  ``torch.load(weights_only=False)`` (the default planner, torchtitan's). The state is
  therefore encoded as tensors only (:func:`encode`: its tensors, and its plain structure as
  JSON text in a uint8 tensor), so nothing GeoFP8 loads from a checkpoint can run code.

DCP loads into tensors of the saved shapes, which a fresh state does not have yet (residuals
appear with the first step): :meth:`DCPState.expect` reads the checkpoint's metadata and
allocates this rank's entries before ``dcp.load``. A checkpoint without GeoFP8 entries resumes
with a :class:`UserWarning`; one written on another number of ranks is refused with a
``ValueError`` naming both.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from .checkpoint import _device, _to, other_world, warn_missing

__all__ = ["KEY", "DCPState", "SafeLoadPlanner", "decode", "encode", "load"]

KEY = "geofp8"  # the state's key in a DCP checkpoint
STRUCTURE = "structure"  # the entry holding the JSON structure


def encode(state: dict) -> dict[str, torch.Tensor]:
    """``state`` (tensors in plain containers) as tensors only: ``"0"``, ``"1"``, … its tensors
    in traversal order, :data:`STRUCTURE` the rest as JSON text (uint8), with tensors replaced
    by their index and container types (dict keys, tuples) kept. :func:`decode` inverts it."""
    tensors: list[torch.Tensor] = []

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            tensors.append(obj.detach())
            return {"T": len(tensors) - 1}
        if isinstance(obj, dict):
            return {"d": [[k, walk(v)] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            return {"t" if isinstance(obj, tuple) else "l": [walk(v) for v in obj]}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return {"v": obj}
        raise TypeError(f"GeoFP8 state holds a {type(obj).__name__}: only tensors and plain "
                        "containers can be checkpointed")

    text = json.dumps(walk(state)).encode()
    return {STRUCTURE: torch.frombuffer(bytearray(text), dtype=torch.uint8),
            **{str(i): t for i, t in enumerate(tensors)}}


def decode(entries: dict[str, torch.Tensor]) -> dict:
    """The state :func:`encode` encoded as ``entries``."""

    def build(node):
        (tag, value), = node.items()
        if tag == "T":
            return entries[str(value)]
        if tag == "d":
            return {k: build(v) for k, v in value}
        if tag in ("l", "t"):
            items = [build(v) for v in value]
            return tuple(items) if tag == "t" else items
        return value

    return build(json.loads(bytes(entries[STRUCTURE].cpu().numpy()).decode()))


class DCPState(Stateful):
    """A ``Stateful`` for ``dcp.save`` / ``dcp.load`` holding this rank's GeoFP8 states
    (one per model part: :class:`~geofp8.fsdp.GeoFP8FSDP` or :class:`~geofp8.GeoFP8State`),
    under ``key`` in the checkpoint (module notes). Before ``dcp.load``, call :meth:`expect`."""

    def __init__(self, states: list, key: str = KEY) -> None:
        self.states, self.key = list(states), key
        self._expected: dict[str, torch.Tensor] | None = None  # set by expect()
        self._where = ""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """For a save: this rank's states, encoded. Once after :meth:`expect` (``dcp.load``
        asks once): the empty entries that ``dcp.load`` fills."""
        if self._expected is not None:
            expected, self._expected = self._expected, None
            return expected
        return {f"{_prefix()}part{i}/{name}": t for i, state in enumerate(self.states)
                for name, t in encode(state.state_dict()).items()}

    def expect(self, checkpoint: str | os.PathLike | Metadata, where: str = "") -> None:
        """Allocate the entries of this rank that ``checkpoint`` (a DCP directory, or its
        metadata; ``where``: its name for messages) holds, for the next ``dcp.load``.

        Raises:
            ValueError: the checkpoint was written on another number of ranks.
        """
        metadata = (checkpoint if isinstance(checkpoint, Metadata)
                    else FileSystemReader(checkpoint).read_metadata())
        self._where = where or ("" if isinstance(checkpoint, Metadata) else str(checkpoint))
        ours = {k.removeprefix(f"{self.key}."): md
                for k, md in metadata.state_dict_metadata.items()
                if k.startswith(f"{self.key}.rank") and isinstance(md, TensorStorageMetadata)}
        written = {k.split("/", 1)[0] for k in ours}
        if written and len(written) != dist.get_world_size():
            raise ValueError(other_world(len(written)))
        self._expected = {k: torch.empty(md.size, dtype=md.properties.dtype)
                          for k, md in ours.items() if k.startswith(_prefix())}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Restore every part's state (a warning when the checkpoint holds none)."""
        if not state_dict:
            warn_missing(self._where or "loaded with torch.distributed.checkpoint")
            return
        parts = {k.split("/")[1] for k in state_dict}
        if len(parts) != len(self.states):
            raise ValueError(f"GeoFP8 checkpoint holds the state of {len(parts)} model parts, "
                             f"this run has {len(self.states)}")
        for i, state in enumerate(self.states):
            part = f"{_prefix()}part{i}/"
            entries = {k.removeprefix(part): t for k, t in state_dict.items()
                       if k.startswith(part)}
            state.load_state_dict(_to(decode(entries), _device(state)))


def _prefix() -> str:
    """This rank's entries start with it."""
    return f"rank{dist.get_rank()}/"


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading values that are not tensors (an optimizer's
    ``param_groups``, a scheduler's state) with ``torch.load(weights_only=True)``: a
    checkpoint's pickles cannot run code."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                        loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load(state_dict: dict, checkpoint: str | os.PathLike) -> None:
    """``dcp.load(state_dict)`` from the directory ``checkpoint`` with :class:`SafeLoadPlanner`,
    after :meth:`DCPState.expect` for every :class:`DCPState` value of ``state_dict``."""
    metadata = FileSystemReader(checkpoint).read_metadata()
    for value in state_dict.values():
        if isinstance(value, DCPState):
            value.expect(metadata, where=str(checkpoint))
    dcp.load(state_dict, checkpoint_id=checkpoint, planner=SafeLoadPlanner())
