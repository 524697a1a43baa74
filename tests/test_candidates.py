"""Which layers may take geometry: Linear layers held directly in a ModuleList are candidates,
``layers`` naming a non-candidate raises, and a model with no candidate runs Euclidean and
says so once (it used to crash at the first refresh)."""

import warnings

import pytest
import torch
from torch import nn

from distributed import run_ranks
from geofp8 import GeoFP8Config
from geofp8.candidates import find_candidates
from geofp8.codecs import make_codec
from geofp8.selection import make_selection


class Stack(nn.Module):
    """Linear layers held directly in a ModuleList, and a head outside it."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.head = nn.Linear(32, 32)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


class SmallCNN(nn.Module):
    """A vision model whose only Linear layer is a 10-class head (narrower than min_dim)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.features(x))


def _candidates(model, scope="blocks"):
    names = {id(p): n for n, p in model.named_parameters()}
    return find_candidates(model, names, scope, min_dim=16)


def test_linear_layers_held_directly_in_a_module_list_are_candidates():
    assert list(_candidates(Stack())) == [f"layers.{i}.weight" for i in range(3)]
    assert "head.weight" in _candidates(Stack(), "linear")


def test_layers_naming_a_non_candidate_raises():
    candidates = list(_candidates(Stack()))
    config = GeoFP8Config(layers=["head"])
    with pytest.raises(ValueError, match=r"names \['head'\], which are not candidates"):
        make_selection(config, make_codec(), candidates, "refresh")
    chosen = make_selection(GeoFP8Config(layers=["layers.1"]), make_codec(), candidates,
                            "refresh")
    assert chosen.selected == {"layers.1.weight"}


def _train_worker(rank, world, model_name, fields):
    torch.manual_seed(0)
    model = {"cnn": SmallCNN, "stack": Stack}[model_name]()
    shape = (4, 1, 8, 8) if model_name == "cnn" else (4, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from geofp8.ddp import GeoFP8State, geofp8_hook

        state = GeoFP8State(model, GeoFP8Config(**fields))
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(state, geofp8_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(5):  # refreshes at steps 2 and 4
            g = torch.Generator().manual_seed(100 * step + rank)
            ddp(torch.randn(*shape, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    said = [str(w.message) for w in caught if "no candidate layer" in str(w.message)]
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return said, params, sorted(state.pipeline.transforms())


def test_a_model_without_candidates_runs_euclidean_and_says_so_once():
    results = run_ranks(_train_worker, 2, args=("cnn", dict(refresh_every=2, layers="auto")))
    for said, params, _ in results:
        assert len(said) == 1 and "plain e4m3 (Euclidean)" in said[0]
        assert torch.isfinite(params).all()
    assert torch.equal(results[0][1], results[1][1])


def test_module_list_layers_take_geometry_through_refreshes():
    results = run_ranks(_train_worker, 2, args=("stack", dict(refresh_every=2, layers="all",
                                                                k=4)))
    for said, params, mapped in results:
        assert said == [] and torch.isfinite(params).all()
        assert mapped == [f"layers.{i}.weight" for i in range(3)]
    assert torch.equal(results[0][1], results[1][1])
