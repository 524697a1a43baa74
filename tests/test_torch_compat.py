"""Older torch (the GPU image's 2.11) where it differs from ours: the collectives' pre-2.12
names and FSDP's single parameter group per state, taken where the newer ones are absent
(docs/performance.md, "Will it run on torch 2.11")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from geofp8 import fsdp
from geofp8.comm.group import collective
from geofp8.tools.wire import ByteCounter


def test_a_collective_missing_from_this_torch_is_taken_under_its_older_name(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda *a, **k: calls.append("old"),
                        raising=False)
    monkeypatch.setattr(dist, "all_gather_single", lambda *a, **k: calls.append("new"),
                        raising=False)
    collective("all_gather_single")(None, None)
    monkeypatch.delattr(dist, "all_gather_single")  # torch < 2.12
    collective("all_gather_single")(None, None)
    assert calls == ["new", "old"]
    monkeypatch.delattr(dist, "all_gather_into_tensor")
    with pytest.raises(AttributeError):
        collective("all_gather_single")


def test_the_byte_counter_charges_the_older_name_and_skips_the_missing_one(monkeypatch):
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, t, **k: None)
    counter = ByteCounter(rank=0, world_size=4)
    with counter.counting():
        dist.all_gather_into_tensor(torch.empty(40), torch.empty(10))
    assert counter.bytes == 3 * 10 * 4
    assert not hasattr(dist, "all_gather_single")  # nothing left behind


def _module(**state):
    return SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(**state))


def test_fsdp_reads_one_parameter_group_per_state_on_older_torch():
    assert fsdp._unit("a", _module(_fsdp_param_group=None), {}, None) is None
    assert fsdp._unit("a", _module(_fsdp_param_groups=[]), {}, None) is None
    two_d = SimpleNamespace(mesh_info=SimpleNamespace(mesh=SimpleNamespace(ndim=2)))
    for state in ({"_fsdp_param_group": two_d}, {"_fsdp_param_groups": [two_d]}):
        with pytest.raises(ValueError, match="shard the model on mesh"):  # the group was read
            fsdp._unit("a", _module(**state), {}, {"shard": None})
    with pytest.raises(RuntimeError, match="FSDP internals changed"):
        fsdp._unit("a", _module(), {}, None)
