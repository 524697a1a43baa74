"""The sync engine's step, through the public API on real gloo ranks: one lifecycle for DDP,
FSDP and HSDP, and the holes that two copies of it had opened, each with its test."""

import io

import pytest
import torch
from torch import nn

from distributed import run_ranks
from geofp8 import GeoFP8Config
from geofp8.engine import STATE_VERSION

EUCLID = dict(transform="euclidean", layers="none")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _sharded(mesh=None):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Tiny()
    kw = {"mesh": mesh} if mesh is not None else {}
    for module in (net.a, net.b, net):
        fully_shard(module, **kw)
    return net


def _x(step, rank):
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + rank))


def _backward(net, step, rank):
    net(_x(step, rank)).pow(2).sum().backward()


# -- FSDP ranks that disagree fail at the first step, on every rank, naming the field -------

def _mismatch_worker(rank, world, field, values):
    from geofp8 import fsdp

    net = _sharded()
    fsdp.enable(net, GeoFP8Config(**{field: values[rank]}))
    try:
        _backward(net, 0, rank)
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("field,values", [("damping", (0.1, 10.0)),
                                          ("format", ("e4m3", "e5m2"))])
def test_fsdp_ranks_that_disagree_fail_at_the_first_step(field, values):
    for message in run_ranks(_mismatch_worker, 2, args=(field, values)):
        assert message is not None and "ranks disagree" in message and field in message


# -- a sum that overflows on one rank only: every rank skips the step -----------------------

def _overflow_worker(rank, world):
    from torch.distributed.fsdp import fully_shard

    from geofp8 import fsdp

    torch.manual_seed(0)
    net = nn.Linear(4, 8, bias=False)
    fully_shard(net)
    state = fsdp.enable(net, GeoFP8Config(**EUCLID), sender_feedback=True)
    # dL/dW row i = scale_i: rows 0-3 (rank 0's shard) are 2e38 on each rank, finite, and
    # sum to 4e38 = inf on rank 0; rows 4-7 (rank 1's) sum to 2
    scale = torch.tensor([2e38] * 4 + [1.0] * 4)
    (net(torch.ones(1, 4)) * scale).sum().backward()
    finite = bool(torch.isfinite(net.weight.grad.to_local()).all())
    return state.stats(), finite, state.state_dict()["feedback"]["sender"]["residuals"]


def test_fsdp_overflow_on_one_rank_is_skipped_on_every_rank():
    results = run_ranks(_overflow_worker, 2)
    # rank 0's shard overflowed; rank 1's is finite but the unit's verdict is shared: the
    # optimizer on every rank sees a non-finite gradient and skips (GradScaler does)
    assert [finite for _, finite, _ in results] == [False, False]
    for stats, _, residuals in results:
        assert (stats["step"], stats["skipped_steps"]) == (0, 1)
        # the skipped step's residuals are reset to zero (saved so)
        assert list(residuals) == ["weight"] and not residuals["weight"].any()


# -- one lifecycle: FSDP settles at the end of backward, reading changes nothing ------------

def _lifecycle_worker(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from geofp8 import GeoFP8State, fsdp, geofp8_hook

    net = _sharded()
    state = fsdp.enable(net, GeoFP8Config(**EUCLID))
    _backward(net, 0, rank)
    out = {"phase": state.engine.ledger.phase.value, "stats": [state.stats(), state.stats()]}
    saved = state.state_dict()
    out["fsdp_state"] = (saved["version"], saved["kind"], state.stats()["step"])
    torch.manual_seed(0)
    model = Tiny()
    ddp_state = GeoFP8State(model, GeoFP8Config(**EUCLID))
    ddp = DDP(model)
    ddp.register_comm_hook(ddp_state, geofp8_hook)
    _backward(ddp, 0, rank)
    out["ddp_state"] = (ddp_state.state_dict()["version"], ddp_state.state_dict()["kind"])
    try:
        ddp_state.load_state_dict(saved)
    except ValueError as exc:
        out["cross_load"] = str(exc)
    return out


def test_fsdp_settles_at_the_end_of_backward_and_stats_only_read():
    for r in run_ranks(_lifecycle_worker, 2):
        assert r["phase"] == "idle"  # settled before backward() returned
        first, second = r["stats"]
        assert first == second and first["step"] == 1 and first["bytes_sent"] > 0
        assert r["fsdp_state"] == (STATE_VERSION, "fsdp", 1)
        assert r["ddp_state"] == (STATE_VERSION, "ddp")
        assert "'fsdp' state" in r["cross_load"]


# -- an exception inside the DDP hook rolls the step back -----------------------------------

def _ddp(model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from geofp8 import geofp8_hook

    ddp = DDP(model)
    ddp.register_comm_hook(model.geofp8, geofp8_hook)
    return ddp


def _trained(rank, fail_at=None, where="encode"):
    """Four SGD steps; with ``fail_at``, that step's hook raises (``where="encode"``), or its
    collective's last hop, run once the hook has launched it (``"decode"``), and the run
    resumes from a checkpoint taken before it, with a new DDP wrapper around the same model
    and state. Also returns the steps the engine was rolled back at by the failure."""
    import gc

    from geofp8 import GeoFP8State
    from geofp8.comm import collective

    torch.manual_seed(0)
    model = Tiny()
    model.geofp8 = GeoFP8State(model, GeoFP8Config(**EUCLID))
    ddp, opt = _ddp(model), torch.optim.SGD(model.parameters(), lr=0.1)
    failed, step, rollbacks, rolled_back = False, 0, [], []
    engine, rollback = model.geofp8.engine, model.geofp8.engine.rollback
    engine.rollback = lambda: (rollbacks.append(engine.step), rollback())[1]
    decode = collective.decode_gathered_flagged
    while step < 4:
        if step == fail_at and not failed:
            buf = io.BytesIO()
            torch.save({"params": [p.detach().clone() for p in model.parameters()],
                        "geofp8": model.geofp8.state_dict()}, buf)

            def broken(*args, **kwargs):
                raise RuntimeError("injected failure")
            if where == "encode":
                model.geofp8.pipeline.encode = broken
            else:
                collective.decode_gathered_flagged = broken
            try:
                _backward(ddp, step, rank)
            except RuntimeError as exc:
                failed = "injected failure" in str(exc)
            rolled_back = list(rollbacks)  # (loading a checkpoint rolls back too)
            if where == "encode":
                del model.geofp8.pipeline.encode
            collective.decode_gathered_flagged = decode
            saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
            with torch.no_grad():
                for p, t in zip(model.parameters(), saved["params"]):
                    p.copy_(t)
            model.geofp8.load_state_dict(saved["geofp8"])
            del ddp
            gc.collect()
            ddp = _ddp(model)
            continue
        opt.zero_grad(set_to_none=True)
        _backward(ddp, step, rank)
        opt.step()
        step += 1
    return (failed, [p.detach().clone() for p in model.parameters()], model.geofp8.stats(),
            rolled_back)


def _rollback_worker(rank, world, where):
    return _trained(rank), _trained(rank, fail_at=2, where=where)


@pytest.mark.parametrize("where", ["encode", "decode"])
def test_ddp_hook_exception_rolls_back_and_resume_is_bitwise(where):
    """A failure in the hook, or in its collective after the hook launched it (the
    communicator's exception path: no callback per bucket), rolls the step back once."""
    for clean_run, failed_run in run_ranks(_rollback_worker, 2, (where,)):
        (clean_failed, clean, clean_stats, clean_rollbacks) = clean_run
        (failed, resumed, stats, rollbacks) = failed_run
        assert failed and not clean_failed
        assert clean_rollbacks == [] and rollbacks == [2]
        assert stats["step"] == clean_stats["step"] == 4
        assert all(torch.equal(a, b) for a, b in zip(clean, resumed))


# -- HSDP honours set_requires_all_reduce(False) ----------------------------------------------

def _accumulation_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from geofp8 import fsdp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    grads, sent = {}, {}
    for mode in ("geofp8", "native"):
        net = _sharded(mesh=mesh["shard"] if mode == "geofp8" else mesh)
        state = fsdp.enable(net, GeoFP8Config(error_feedback=False, **EUCLID), mesh=mesh) \
            if mode == "geofp8" else None
        net.set_requires_all_reduce(False)
        _backward(net, 0, rank)
        first = state.stats()["payload_bytes_sent"] if state else 0
        net.set_requires_all_reduce(True)
        _backward(net, 1, rank)
        second = state.stats()["payload_bytes_sent"] if state else 0
        grads[mode] = {n: p.grad.to_local().clone() for n, p in net.named_parameters()}
        sent[mode] = (first, second)
    return grads, sent["geofp8"]


def test_hsdp_accumulation_all_reduces_once():
    results = run_ranks(_accumulation_worker, 4, timeout=180)
    for grads, (first, second) in results:
        assert 0 < first < second  # the first micro-batch sent no replica all-reduce
        for name, ref in grads["native"].items():
            err = (grads["geofp8"][name] - ref).abs().max()
            assert err <= 4 * 2.0**-4 * ref.abs().max(), name  # as test_fsdp's HSDP bound
    for r in (0, 1):  # replicas (r, r + 2) hold the same shard: bit-identical
        for name, g in results[r][0]["geofp8"].items():
            assert torch.equal(g, results[r + 2][0]["geofp8"][name]), name


def test_the_ledgers_step_figures_are_summed_when_read_bytes_and_links_included():
    """A settled step's figures (adds from any unit, the groups' bytes by kind, a link's
    bytes) come out exact at the read after settling, and the next step's adds do not
    reach them; a rolled-back step's adds are dropped."""
    from geofp8.ledger import StepLedger

    ledger, finite = StepLedger(), torch.tensor(True)
    ledger.add("codec_s", 0.25)
    ledger.add_each(("elements", "bytes_fp32_equivalent"), (10, 1e16 + 2))
    ledger.add_each(("elements", "bytes_fp32_equivalent"), iter((5, 2.0)))
    flat = {"payload": 100.0, "factor": 7.0, "fp32_equivalent": 0.0, "flag": 3.0}
    node = {"payload": 40.0, "flag": 1.0}  # a kind not charged is not in the dict
    ledger.settle(finite, None, [None, "inter_node"], [flat, node])
    ledger.add("codec_s", 9.0)  # the next step's
    last = ledger.last
    assert last["elements"] == 15 and last["bytes_fp32_equivalent"] == 1e16 + 4
    assert last["codec_s"] == 0.25 and last["bytes_sent"] == 144.0
    assert last["factor_bytes_sent"] == 7.0 and last["bytes_inter_node"] == 41.0
    assert last["bytes_intra_node"] == 0.0 and ledger.step == 1
    assert ledger.skipped_steps == 0 and ledger.last == last  # reading changes nothing
    ledger.reset_phase()  # the step in flight is forgotten
    ledger.settle(~finite, None, [], [])
    assert ledger.last["codec_s"] == 0.0 and ledger.skipped_steps == 1


def _lock_held(serial: bool) -> tuple[list[bool], int]:
    """Whether an engine's lock was held while a unit's start counted it and while its
    finish settled the step (one unit, the step's last), and the step after."""
    from geofp8.comm.group import DeviceGroup
    from geofp8.engine import SyncEngine

    engine = SyncEngine(nn.Linear(4, 4), GeoFP8Config(), DeviceGroup(None, "cpu"), "ddp",
                        serial=serial)
    begin, settle, seen = engine.ledger.begin_unit, engine._settle, []

    def counted(last):
        seen.append(engine._lock._is_owned())
        return begin(last)

    def settled():
        seen.append(engine._lock._is_owned())
        settle()
    engine.ledger.begin_unit, engine._settle = counted, settled
    engine.start_unit(last=True)
    engine.finish_unit(torch.ones(3))
    return seen, engine.ledger.step


def _lock_worker(rank, world):
    return {serial: _lock_held(serial) for serial in (True, False)}


def test_a_serial_engine_takes_no_lock_and_the_others_hold_it_per_unit():
    """DDP's engine (``serial``: its hook's calls are serialised by DDP's reducer, and
    complete their units on the hook's thread) starts and finishes units without the lock;
    an engine whose units may finish on other threads (FSDP's) holds it across each."""
    held = run_ranks(_lock_worker, 1)[0]
    assert held[True] == ([False, False], 1)
    assert held[False] == ([True, True], 1)
