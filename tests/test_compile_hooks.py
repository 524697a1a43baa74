"""GeoFP8's forward hooks under ``torch.compile`` inside DDP: no recompiles after the first
steps and results equal to eager. Compiled with ``backend="eager"`` (dynamo's tracing, graph
breaks, guards and recompiles are the point; CPU inductor builds take minutes): the
parameters are then bitwise equal to an eager run's."""

import logging

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook
from toymodels import loss_fn, make_model

pytestmark = pytest.mark.distributed

STEPS = 5


class _Recompiles(logging.Handler):
    """Collects dynamo's recompile messages (and its recompile-limit warning)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def _run(rank, source, compiled):
    import torch._dynamo

    torch._dynamo.reset()
    model = make_model()
    ddp = DDP(model)
    state = GeoFP8State(model, GeoFP8Config(layers="all", factor_source=source,
                                            refresh_every=2, k=4))
    ddp.register_comm_hook(state, geofp8_hook)
    net = torch.compile(ddp, backend="eager") if compiled else ddp
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handler = _Recompiles()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._logging").addHandler(handler)
    logger.addHandler(handler)
    late = []
    for step in range(STEPS):
        before = len(handler.records)
        opt.zero_grad()
        loss_fn(net, step, rank).backward()
        opt.step()
        late += [r for r in handler.records[before:]
                 if step >= 2 or "recompile_limit" in r]
    logger.removeHandler(handler)
    torch._logging.set_logs()
    return [p.detach().clone() for p in model.parameters()], late


def _worker(rank, world_size, source):
    eager, _ = _run(rank, source, False)
    compiled, late = _run(rank, source, True)
    return eager, compiled, late


@pytest.mark.parametrize("source", ["refresh", "fresh"])
def test_compiled_ddp_with_geofp8_does_not_recompile_and_equals_eager(source):
    for eager, compiled, late in run_ranks(_worker, 2, (source,), timeout=240):
        assert not late, late  # no recompile after step 2, never dynamo's recompile limit
        for a, b in zip(eager, compiled):
            assert torch.equal(a, b)
