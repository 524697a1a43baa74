"""A GeoFP8 checkpoint is checked before anything changes, then loaded whole or not at all.

Refused, each with one ``ValueError`` naming the field, and the state exactly as before the
call: another rank's state, a file with bytes flipped inside a tensor record, NaN residuals,
a model of another width, an older format, a state that does not fit although it passes the
checks; through the engine, the per-rank files (Accelerate, the Trainer), the gathered form
(Lightning) and DCP's encoding (torchtitan, ``geofp8 train`` on FSDP).
"""

import copy
import os
import zipfile

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks, scratch_dir
from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook
from geofp8.integrations import checkpoint
from geofp8.integrations.dcp import decode, encode
from geofp8.verification import checksum
from toymodels import loss_fn, make_model

pytestmark = pytest.mark.distributed

CONFIG = dict(layers="all", candidates="linear", refresh_every=2, k=4, oversample=4)


def _equal(a, b) -> bool:
    """Deep equality of two states (tensors bitwise)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _trained_state(rank: int, steps: int = 3, **model_kw) -> GeoFP8State:
    """A state with residuals, refreshed factors and windows (a refresh at step 2)."""
    model = make_model(**model_kw)
    ddp = DDP(model)
    state = GeoFP8State(model, GeoFP8Config(**CONFIG))
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        loss_fn(ddp, step, rank).backward()
        opt.step()
    return state


def _refused(state: GeoFP8State, load) -> str:
    """Run ``load``; it must raise a ValueError and leave ``state`` exactly as it was."""
    before = state.state_dict()
    with pytest.raises(ValueError) as error:
        load()
    assert _equal(state.state_dict(), before), "a refused load changed the state"
    return str(error.value)


def _flip_tensor_bytes(path: str, count: int = 64) -> None:
    """Flip ``count`` bytes in the middle of the largest tensor record of a ``torch.save``
    file (its zip entry ``…/data/<n>``, stored uncompressed)."""
    with zipfile.ZipFile(path) as z:
        record = max((i for i in z.infolist() if "/data/" in i.filename),
                     key=lambda i: i.file_size)
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    # the record's data follows its 30-byte local header, name and extra field
    name_len = int.from_bytes(raw[record.header_offset + 26 : record.header_offset + 28],
                              "little")
    extra_len = int.from_bytes(raw[record.header_offset + 28 : record.header_offset + 30],
                               "little")
    start = record.header_offset + 30 + name_len + extra_len + record.file_size // 2 - count // 2
    for i in range(start, start + count):
        raw[i] ^= 0xFF
    with open(path, "wb") as f:
        f.write(raw)


def _worker(rank, world_size, directory):
    state = _trained_state(rank)
    mine = state.state_dict()
    assert mine["rank"] == rank and mine["checksum"] == checksum(mine)
    assert state.pipeline.transforms() and mine["feedback"]["sender"]["residuals"]
    messages = {}

    # this rank's own state loads, and loads whole
    state.load_state_dict(copy.deepcopy(mine))
    assert _equal(state.state_dict(), mine)

    # another rank's file, through the per-rank files of Accelerate and the Trainer
    files = os.path.join(directory, "files")
    checkpoint.save_files(state, files)
    dist.barrier()
    swapped = os.path.join(directory, f"swapped{rank}")
    os.makedirs(swapped, exist_ok=True)
    other = torch.load(os.path.join(files, checkpoint.FILE.format(rank=1 - rank)),
                       weights_only=True)
    torch.save(other, os.path.join(swapped, checkpoint.FILE.format(rank=rank)))
    messages["another_rank"] = _refused(state, lambda: checkpoint.load_files(state, swapped))

    # 64 bytes flipped inside a tensor record of this rank's own file
    damaged = os.path.join(directory, f"damaged{rank}")
    path = checkpoint.save_files(state, damaged)
    _flip_tensor_bytes(str(path))
    messages["flipped_bytes"] = _refused(state, lambda: checkpoint.load_files(state, damaged))

    # NaN residuals, written by a state that had them
    residuals = state.pipeline.feedback.residuals
    name = next(iter(residuals))
    kept = residuals[name].clone()
    residuals[name].fill_(float("nan"))
    nan_state = state.state_dict()
    residuals[name].copy_(kept)
    messages["nan_residuals"] = _refused(state, lambda: state.load_state_dict(nan_state))

    # a model of another width (its own fresh state, refused and untouched)
    wider = GeoFP8State(make_model(d=64), GeoFP8Config(**CONFIG))
    messages["another_width"] = _refused(wider, lambda: wider.load_state_dict(mine))

    # an older format
    old = {**mine, "version": 3}
    messages["old_version"] = _refused(state, lambda: state.load_state_dict(old))

    # passes every check but does not fit (a window of another shape, checksum recomputed):
    # the partial load is undone
    crafted = copy.deepcopy(mine)
    key = next(iter(crafted["source"]["windows"]))
    crafted["source"]["windows"][key][0] = torch.zeros(3, 3)
    crafted["checksum"] = checksum(crafted)
    messages["does_not_fit"] = _refused(state, lambda: state.load_state_dict(crafted))

    # the ranks' states swapped in Lightning's gathered form
    gathered = [checkpoint.gather(state)]
    dist.broadcast_object_list(gathered, src=0)
    swapped_ranks = {**gathered[0], "ranks": gathered[0]["ranks"][::-1]}
    messages["gathered_swapped"] = _refused(
        state, lambda: checkpoint.restore(state, swapped_ranks, "test"))
    assert checkpoint.restore(state, gathered[0], "test")  # the right one loads

    # DCP's tensors-only encoding keeps what is verified: a flipped tensor is seen
    entries = encode(mine)
    assert _equal(decode(entries), mine)
    biggest = max((k for k in entries if k != "structure"), key=lambda k: entries[k].numel())
    entries[biggest] = entries[biggest].clone().view(-1).neg_().view_as(entries[biggest])
    messages["dcp_flipped"] = _refused(state, lambda: state.load_state_dict(decode(entries)))
    return messages


EXPECTED = {"another_rank": "rank: it was written by rank", "flipped_bytes": "checksum",
            "nan_residuals": "finite: the sender residual of", "another_width": "parameters",
            "old_version": "version: it is version 3", "does_not_fit": "does not fit",
            "gathered_swapped": "rank: it was written by rank", "dcp_flipped": "checksum"}


def test_damaged_or_foreign_checkpoints_are_refused_with_the_state_unchanged():
    for messages in run_ranks(_worker, 2, (scratch_dir(),), timeout=120):
        for case, expected in EXPECTED.items():
            assert expected in messages[case], (case, messages[case])
            assert "GeoFP8 checkpoint refused" in messages[case], case
