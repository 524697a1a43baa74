"""Overlap on the DDP path (issue 40 item 3), checked without a GPU on real gloo ranks.

A recording stand-in for the stream API (:func:`geofp8.comm.streams.streams_for`) logs, per
rank, which stream is current when the hook reads the gradients, waits on a collective and
completes a future; every collective issued is logged with its group. The protocol: the
side stream waits for the current one before the gradients are read, the codec work, every
``work.wait()`` and every completion run under the side stream, buckets before the last are
still in flight when their hook returns (flat and hierarchical), and every rank issues the
same collectives in the same order (with ``find_unused_parameters=True``: DDP's own
collective follows the last hook).
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks

pytestmark = pytest.mark.distributed


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.append(("wait_stream", self.name, other.name))


class RecordingStreams:
    """The :class:`geofp8.comm.streams.TorchStreams` operations, logged (no device)."""

    def __init__(self, log: list) -> None:
        self.log, self.stack = log, [FakeStream("default", log)]

    def new(self, device):
        return FakeStream("side", self.log)

    def current(self, device=None):
        return self.stack[-1]

    @contextlib.contextmanager
    def use(self, stream):
        self.stack.append(stream)
        try:
            yield
        finally:
            self.stack.pop()

    def record(self, tensor, stream) -> None:
        self.log.append(("record_stream", stream.name, tensor.data_ptr()))


class LoggedWork:
    """A collective's work whose ``wait()`` is logged with the stream current then."""

    def __init__(self, work, log: list, on) -> None:
        self.work, self.log, self.on = work, log, on

    def wait(self):
        self.log.append(("wait", self.on()))
        return self.work.wait()

    def __getattr__(self, name):
        return getattr(self.work, name)


def _log_waits(group, log: list, on) -> None:
    """Every work a :class:`DeviceGroup` keeps is a :class:`LoggedWork`."""
    keep = group.DeviceGroup._keep

    def logged_keep(self, work, async_op=True):
        return keep(self, LoggedWork(work, log, on), async_op)

    group.DeviceGroup._keep = logged_keep


class Uneven(nn.Module):
    """Several buckets; ``spare`` is used on odd steps only (``find_unused_parameters``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)])
        self.spare = nn.Linear(16, 16)

    def forward(self, x, step):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.spare(x) if step % 2 else x


def _protocol_worker(rank, world, fields):
    from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook
    from geofp8.comm import collective, group, lagged, streams

    log: list = []
    api = RecordingStreams(log)
    streams.streams_for = lambda device: api
    on = lambda: api.current().name  # noqa: E731

    _log_waits(group, log, on)
    def logged_issue(op, original):
        def issue(self, *args, **kw):
            kind = kw.get("kind", next((a for a in args if isinstance(a, str)), None))
            log.append(("issue", op, self.link, kind))
            return original(self, *args, **kw)
        return issue

    for op in ("all_reduce", "all_gather", "all_to_all", "reduce_scatter", "broadcast"):
        setattr(group.DeviceGroup, op, logged_issue(op, getattr(group.DeviceGroup, op)))

    class LoggedFuture(torch.futures.Future):
        def set_result(self, value):
            log.append(("set_result", on()))
            super().set_result(value)

    collective.device_future = lagged.device_future = lambda device: LoggedFuture()

    torch.manual_seed(0)
    model = Uneven()
    state = GeoFP8State(model, GeoFP8Config(candidates="linear", layers="all", **fields))
    encode = state.pipeline.encode

    def logged_encode(*args, **kw):
        log.append(("encode", on()))
        return encode(*args, **kw)

    state.pipeline.encode = logged_encode
    prepare = state.pipeline.prepare_into  # the hierarchical path routes node sums

    def logged_prepare(*args, **kw):
        log.append(("encode", on()))
        return prepare(*args, **kw)

    state.pipeline.prepare_into = logged_prepare

    def hook(s, bucket):
        log.append(("hook", bucket.index(), bucket.is_last()))
        fut = geofp8_hook(s, bucket)
        log.append(("returned", bucket.is_last(), fut.done()))
        return fut

    dist._DEFAULT_FIRST_BUCKET_BYTES = 4000  # rebuilt buckets: several, the first too
    ddp = DDP(model, bucket_cap_mb=0.001, find_unused_parameters=True)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = []
    for step in range(4):
        del log[:]
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x, step).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        steps.append(list(log))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return steps, params, state.stats()["skipped_steps"]


@pytest.mark.parametrize("world,fields", [
    (2, dict(hierarchy="flat")),
    (2, dict(hierarchy="flat", owner_feedback=True, transform="euclidean")),
    (4, dict(node_size=2)),  # two nodes of two: the hierarchical path
    (2, dict(hierarchy="flat", factor_source="fresh")),  # this step's maps, built in the hook
])
def test_bucket_work_runs_on_the_side_stream_in_the_same_order_on_every_rank(world, fields):
    results = run_ranks(_protocol_worker, world, args=(fields,), timeout=180)
    for steps, params, skipped in results:
        assert torch.equal(params, results[0][1]) and skipped == 0
        for log in steps[1:]:  # the first step also runs the consistency check
            hooks = [i for i, e in enumerate(log) if e[0] == "hook"]
            assert len(hooks) >= 4, "several buckets"
            returned = [e for e in log if e[0] == "returned"]
            assert returned[-1] == ("returned", True, True)  # the last bucket drains all
            # buckets before the last are still in flight when their hook returns
            assert [done for _, last, done in returned[:-1]] == [False] * (len(returned) - 1)
            # bucket 0's later hops are issued in later hooks (the lag), none in its own
            first, second, third = (log[a:b] for a, b in zip(hooks[:3], hooks[1:4]))
            if "node_size" in fields:
                assert ("issue", "reduce_scatter", "intra_node", "payload") in first
                assert ("issue", "all_to_all", "inter_node", "payload") in second
                assert ("issue", "all_gather", "inter_node", "payload") in third
                assert ("issue", "all_gather", "intra_node", "payload") not in first + second
            else:  # the flat collective's all-gather of bucket 0 two hooks later
                assert ("issue", "all_to_all", None, "payload") in first
                assert ("issue", "all_gather", None, "payload") not in first + second
                assert ("issue", "all_gather", None, "payload") in third
            for begin, end in zip(hooks, [*hooks[1:], len(log)]):
                bucket = log[begin:end]
                ordered = bucket.index(("wait_stream", "side", "default"))
                reads = [i for i, e in enumerate(bucket) if e[0] == "encode"]
                assert all(i > ordered for i in reads)  # after wait_stream, never before
                assert any(e[0] == "record_stream" for e in bucket)  # DDP's bucket
            events = {e[0] for e in log}
            assert {"encode", "wait", "set_result"} <= events
            if fields.get("factor_source") == "fresh":  # the forward's reduced sketches
                sketches = [e for e in log[:hooks[0]] if e[0] == "issue" and e[3] == "factor"]
                marked = [e for e in log[hooks[0]:] if e[:2] == ("record_stream", "side")]
                assert sketches and len(marked) > len(hooks)  # DDP's buckets and the sketches
            for e in log:
                if e[0] in ("encode", "wait", "set_result"):
                    assert e[1] == "side", e  # never on the autograd thread's stream
    # the same collectives, on the same groups, in the same order on every rank
    issued = [[[e for e in log if e[0] == "issue"] for log in steps] for steps, _, _ in results]
    assert all(order == issued[0] for order in issued)


def test_hierarchy_runs_are_one_stage_per_hook():
    """Lagged's order does not depend on completion: run i's stage s at start i + s."""
    from geofp8.comm.lagged import Lagged

    order = []

    def run(i, stages):
        for s in range(stages):
            order.append((i, s))
            yield
        return torch.tensor(float(i))

    lagged = Lagged()
    futures = [lagged.start(run(i, 3), torch.device("cpu"), i == 3, lambda v: v * 10)
               for i in range(4)]
    assert order == [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0), (1, 2), (2, 1), (3, 0),
                     (2, 2), (3, 1), (3, 2)]
    assert [float(f.value()) for f in futures] == [0.0, 10.0, 20.0, 30.0]


def _fsdp_worker(rank, world, source):
    """FSDP2 with GeoFP8's reduce-scatter, FSDP's reduce-scatter stream stood in by
    ``"fsdp"`` (FSDP2 calls the custom reduce-scatter under its own stream, after waiting
    for the current one: on the CPU it has none, so the call is wrapped here as FSDP2 does
    it on CUDA). Per step: the log of stream events, reduce-scatters and the settling."""
    from torch.distributed.fsdp import fully_shard

    import geofp8.fsdp
    from geofp8 import GeoFP8Config
    from geofp8.comm import group, streams

    log: list = []
    api = RecordingStreams(log)
    streams.streams_for = lambda device: api
    on = lambda: api.current().name  # noqa: E731
    fsdp_stream = FakeStream("fsdp", log)
    call = geofp8.fsdp.GeoFP8ReduceScatter.__call__

    def on_fsdp_stream(self, *args, **kw):
        with api.use(fsdp_stream):
            log.append(("reduce_scatter", on()))
            return call(self, *args, **kw)

    geofp8.fsdp.GeoFP8ReduceScatter.__call__ = on_fsdp_stream
    _log_waits(group, log, on)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
    fully_shard(net[0])
    fully_shard(net[2])
    fully_shard(net)
    state = geofp8.fsdp.enable(net, GeoFP8Config(candidates="linear", layers="all", k=4,
                                                 factor_source=source, refresh_every=2))
    settle = state.engine._settle

    def logged_settle():
        log.append(("settle", on()))
        settle()

    state.engine._settle = logged_settle
    steps = []
    for step in range(4):
        del log[:]
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        net(x).pow(2).mean().backward()
        steps.append(list(log))
    return steps, len(state.pipeline.geometry_layers()), state.stats()["skipped_steps"]


@pytest.mark.parametrize("source", ["refresh", "fresh"])
def test_fsdp_units_run_on_fsdps_stream_and_the_step_settles_after_them(source):
    """Each unit's codec work and collective waits run on the stream FSDP2 calls the
    reduce-scatter on; the step settles (reading the units' finite flags) on the current
    stream only after it has waited for that stream; fresh factors' reduced sketches are
    marked as used by it."""
    for steps, on_map, skipped in run_ranks(_fsdp_worker, 2, args=(source,), timeout=180):
        assert (on_map, skipped) == (2, 0)  # the layers went through their maps
        for log in steps[2:]:  # maps in use (refreshed at step 2; fresh ones every step)
            units = [i for i, e in enumerate(log) if e[0] == "reduce_scatter"]
            assert len(units) == 2 and all(log[i][1] == "fsdp" for i in units)  # 2 units
            joined = log.index(("wait_stream", "default", "fsdp"))
            settled = log.index(("settle", "default"))
            assert units[-1] < joined < settled
            waits = [e[1] for e in log[:joined] if e[0] == "wait"]
            assert waits and set(waits) == {"fsdp"}, log  # the all-to-alls' waits
            if source == "fresh":  # the reduced sketches, read on FSDP's stream
                assert ("record_stream", "fsdp") in [e[:2] for e in log[:joined]], log
