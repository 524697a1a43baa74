"""A byte budget: a format and route per communicated tensor (GeoFP8Config(budget=B)),
measured at the first low-precision step and every refresh, decided at the next step from
all-reduced errors, identical on every rank, within the budget (the factor traffic repaid),
with the residuals re-based on a change and a bitwise resume; with owner_feedback, the owner's
residuals of the second rounding handed over on a change of route; and the layouts that carry a
codec per tensor (a one-codec layout is unchanged)."""

import copy
import io

import pytest
import torch
from torch import nn

from distributed import run_ranks
from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook
from geofp8.codecs import make_codec
from geofp8.comm.layout import ShardLayout, tensor_wire_bytes
from geofp8.comm.stages import decode, encode, simulate_exact_allreduce
from geofp8.geometry.transforms import IDENTITY
from geofp8.selection import BudgetSelection
from toymodels import loss_fn, make_model

NVFP4, E4M3 = make_codec("nvfp4"), make_codec("e4m3", "tensor")
SHAPES = [(40, 24), (7,), (33, 16), (5, 9)]


def test_a_layout_of_mixed_codecs_encodes_each_tensor_with_its_own():
    torch.manual_seed(0)
    codecs = [NVFP4, E4M3, E4M3, NVFP4]
    mixed = ShardLayout.build(SHAPES, NVFP4, 3, codecs=codecs)
    xs = [torch.randn(s) for s in SHAPES]
    flat = torch.cat([x.reshape(-1) for x in xs])
    got = decode(encode(flat, mixed), mixed)
    pos = 0
    for x, codec in zip(xs, codecs):  # each tensor alone in a layout of its codec
        alone = ShardLayout.build([tuple(x.shape)], codec, 3)
        want = decode(encode(x.reshape(-1), alone), alone)
        assert torch.equal(got[pos : pos + x.numel()], want)
        pos += x.numel()
    for j in range(3):  # a shard's bytes: its runs' payloads, nothing else
        runs = mixed.runs[j]
        assert mixed.shard_bytes(j) == sum(c.payload_bytes(s) for c, *_, s in runs)
        assert [r[0] for r in runs] == [NVFP4, E4M3, NVFP4]
    inputs = [torch.randn(mixed.numel) for _ in range(3)]
    total = simulate_exact_allreduce(inputs, mixed)
    assert (total - sum(inputs)).norm() < 0.2 * sum(inputs).norm()
    inputs[1][3] = float("inf")  # a non-finite value in any run poisons everything
    assert torch.isnan(simulate_exact_allreduce(inputs, mixed)).all()


def test_a_one_codec_layout_is_unchanged():
    plain = ShardLayout.build(SHAPES, NVFP4, 4)
    assert ShardLayout.build(SHAPES, E4M3, 4, codecs=[NVFP4] * len(SHAPES)) == plain
    assert plain.codecs == ()
    flat = torch.randn(plain.numel, generator=torch.Generator().manual_seed(1))
    sent, pos = encode(flat, plain), 0
    for j in range(4):
        assert plain.shard_bytes(j) == NVFP4.payload_bytes(plain.groups[j])
        want = torch.empty(plain.shard_bytes(j), dtype=torch.uint8)
        NVFP4.encode_into(want, plain.gather(flat, j), plain.groups[j])
        assert torch.equal(sent[pos : pos + want.numel()], want)
        pos += plain.send_bytes(j)


CANDIDATES = ["a.weight", "b.weight", "c.weight"]


def _selection(budget, every=2, first=0):
    shapes = {"a.weight": (64, 32), "b.weight": (32, 64), "c.weight": (64, 64),
              "a.bias": (64,)}
    return BudgetSelection(CANDIDATES, NVFP4, shapes, 4, budget, every, first), shapes


def _errors(per_tensor):
    """Reduced measurements: per tensor, e_p per path, then ‖G‖² = 1."""
    return torch.tensor([[*e, 1.0] for e in per_tensor], dtype=torch.float64)


# nvfp4, nvfp4-geo, e4m3 per tensor (a, b, c, then the bias a.bias): b gains most from 8
# bits per byte, a prefers its factor; the bias's "geometry" error is the least of all, but
# it has no factor
MEASURED = [(4.0, 1.0, 0.1), (9.0, 8.0, 0.1), (5.0, 6.0, 0.1), (30.0, 0.0, 0.1)]


def test_the_budget_buys_the_most_error_per_byte_and_fits():
    sel, shapes = _selection(0.7)
    ring = 2 * 3 / 4
    elements = sum(torch.Size(s).numel() for s in shapes.values())
    sel._decide(_errors(MEASURED), reserve=0.0)
    chosen = sel.assignment()
    assert set(chosen) == set(shapes)  # every communicated tensor has a path
    assert chosen["b.weight"] == "e4m3" and chosen["a.weight"] == "nvfp4-geo"
    assert chosen["a.bias"] == "e4m3"  # not a candidate, but the most error per byte
    assert chosen["c.weight"] == "nvfp4"  # c (twice b's bytes) does not fit any more
    assert sel.selected == {"a.weight"}
    assert set(sel.last_measurement["a.bias"]) == {"nvfp4", "e4m3"}  # no geometry path
    spent = sum(tensor_wire_bytes(shapes[n], E4M3 if p == "e4m3" else NVFP4, 4)
                for n, p in chosen.items())
    assert sel.planned == pytest.approx(spent / (elements * ring))
    assert sel.planned <= 0.7
    assert sel.codec_of("a.bias") == E4M3 and sel.codec_of("c.weight") == NVFP4
    roomy, _ = _selection(1.2)
    roomy._decide(_errors(MEASURED), reserve=0.0)
    assert set(roomy.assignment().values()) == {"e4m3"}


def test_a_tensor_stays_at_the_floor_when_e4m3_would_not_cut_its_error():
    sel, _ = _selection(1.2)  # room for every upgrade
    sel._decide(_errors([*MEASURED[:3], (1.0, 0.0, 1.5)]), reserve=0.0)  # one scale: worse
    assert sel.assignment()["a.bias"] == "nvfp4"
    assert sel.assignment()["b.weight"] == "e4m3"


def test_a_budget_below_the_floor_raises_and_factor_traffic_falls_back_to_it():
    with pytest.raises(ValueError, match="cheapest assignment"):
        _selection(0.5)
    sel, _ = _selection(0.8)
    with pytest.warns(UserWarning, match="stays at the floor"):
        sel._decide(_errors([(4.0, 1.0, 0.1)] * 4), reserve=1e6)
    # the floor's least-error path: the factor for candidates, plain nvfp4 for the bias
    assert sel.assignment() == {**{n: "nvfp4-geo" for n in CANDIDATES}, "a.bias": "nvfp4"}
    with pytest.raises(ValueError, match="budget needs format='nvfp4'"):
        GeoFP8Config(budget=0.8)
    with pytest.raises(ValueError, match="budget must be > 0"):
        GeoFP8Config(format="nvfp4", budget=0)


class _OneRank:
    """A group of one rank: the all-reduce returns its input."""

    size = 1

    def all_reduce(self, t, kind):
        return t, None


def test_measured_at_the_first_low_precision_step_and_the_factor_traffic_is_repaid():
    sel, shapes = _selection(0.8, every=4, first=2)
    assert [s for s in range(13) if sel.wants(s)] == [2, 4, 8, 12]
    starts, due = [], 0  # the steps whose start is made: each measuring one and the next
    for step in range(13):
        if step >= due:
            starts.append(step)
            due = sel.next_start(step)
    assert starts == [0, 2, 3, 4, 5, 8, 9, 12]
    ring = 2 * 3 / 4
    elements_ring = sum(torch.Size(s).numel() for s in shapes.values()) * ring
    per_step = 0.05 * elements_ring  # factor bytes per step, in every period alike
    sel.measured, sel.factor_window = _errors(MEASURED), [0.0, 1]  # the first measurement
    sel.start_step(3, _OneRank())
    assert sel.reserve == 0.0  # no refresh seen yet: nothing reserved
    first = sel.planned
    assert 0.75 < first <= 0.8
    sel.measured, sel.factor_window = _errors(MEASURED), [per_step * 2, 2]  # steps 3..4
    sel.start_step(5, _OneRank())
    # this period's mean, and the last period's 2 steps beyond its reserve over 4 steps
    assert sel.reserve == pytest.approx(per_step * (1 + 2 / 4))
    assert sel.planned <= 0.8 and sel.planned < first
    sel.measured, sel.factor_window = _errors(MEASURED), [per_step * 4, 4]  # steps 5..8
    sel.start_step(9, _OneRank())
    assert sel.reserve == pytest.approx(per_step)  # planned with more than it took: no debt


BUDGET = dict(format="nvfp4", budget=0.85, layers="auto", refresh_every=2, k=4, oversample=4,
              statistics="sketch", hierarchy="flat",
              residual="fp32")  # exact residuals: the bookkeeping below checks them to 1e-5
STEPS = 10
RESUME_AT = 7  # after the measurement of step 6, before its decision
FROM = 1  # the first decision: after the measurement of step 0


def _setup(**extra):
    model = make_model(0)
    state = GeoFP8State(model, GeoFP8Config(**BUDGET, **extra))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)
    ddp.register_comm_hook(state, geofp8_hook)
    return model, ddp, state, torch.optim.SGD(model.parameters(), lr=0.05)


def _restored(saved, **extra):
    """A new ``_setup(**extra)`` loaded from ``saved`` = (model, optimizer, GeoFP8 state
    dicts), the GeoFP8 state through a ``weights_only`` round trip."""
    model, ddp, state, opt = _setup(**extra)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    state.load_state_dict(torch.load(_roundtrip(saved[2]), weights_only=True))
    return model, ddp, state, opt


def _record_sends(pipeline, record):
    """Wrap ``pipeline.encode``: ``record(name, G, deq(sent) T⁻¹)`` for every tensor it
    encodes (what this rank's send delivers, in Euclidean coordinates)."""
    encode = pipeline.encode

    def recording_encode(names, grads, seed=None, flat=None, kept=None):
        local = [g.detach().clone() for g in grads]  # before Ũ is written over them (DDP)
        enc = encode(names, grads, seed, flat, kept)  # (kept: the bucket's record)
        flat, pos = decode(enc.sent, enc.layout), 0
        for name, g, route in zip(names, local, enc.routes):
            record(name, g, route.inverse(flat[pos : pos + g.numel()].view(g.shape)))
            pos += g.numel()
        return enc

    pipeline.encode = recording_encode


def _budget_worker(rank, world):
    model, ddp, state, opt = _setup()
    pipeline = state.pipeline
    formats, sent, elements = [], 0.0, 0
    delivered, given = {}, {}  # per tensor: Σ_t deq(sent_t) T_t⁻¹ and Σ_t G_t

    def add(name, g, d):
        delivered[name] = delivered.get(name, 0) + d
        given[name] = given.get(name, 0) + g

    _record_sends(pipeline, add)

    def step(i):
        loss_fn(ddp, i, rank).backward()
        opt.step()
        opt.zero_grad()

    saved = None
    for i in range(STEPS):
        if i == RESUME_AT:
            saved = copy.deepcopy((model.state_dict(), opt.state_dict(), state.state_dict()))
        step(i)
        s = state.stats()
        formats.append(s["formats"])
        if i >= FROM:
            sent += s["bytes_sent"]
            elements += s["bytes_fp32_equivalent"] / 4
    # error feedback delivers every gradient but the last residual, in Euclidean terms, only
    # if a residual is re-based whenever its layer's route changes
    kept = {n: float((given[n] - delivered[n] - pipeline.feedback.residual_in(n, IDENTITY))
                     .norm() / given[n].norm()) for n in given}
    straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    model, ddp, state, opt = _restored(saved)
    for i in range(RESUME_AT, STEPS):
        step(i)
    resumed = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return formats, sent, elements, kept, torch.equal(straight, resumed), state.stats()


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_budget_in_ddp_is_identical_on_every_rank_fits_and_resumes_bitwise():
    results = run_ranks(_budget_worker, 2, timeout=240)
    formats = [r[0] for r in results]
    assert formats[0] == formats[1]  # the same choice on every rank, at every step
    changes = [i for i in range(1, STEPS) if formats[0][i] != formats[0][i - 1]]
    assert changes[0] == FROM and all(i % 2 == 1 for i in changes)  # after a measurement
    assert set(formats[0][0].values()) == {"nvfp4"}  # the floor until the first decision
    assert "e4m3" in formats[0][FROM].values()  # the first decision spends the budget ...
    assert "nvfp4-geo" not in formats[0][FROM].values()  # ... with no factor yet
    routes = [{n for n, p in f.items() if p.endswith("-geo")} for f in formats[0]]
    assert any(a != b for a, b in zip(routes, routes[1:]))  # some route did change
    chosen = set(formats[0][-1].values())
    assert "e4m3" in chosen and chosen & {"nvfp4", "nvfp4-geo"}  # the budget mixes formats
    others = {n for n in formats[0][-1] if not n.endswith(".weight") or "embed" in n
              or "head" in n or "norm" in n}
    assert others and all(formats[0][-1][n] != "nvfp4-geo" for n in others)
    assert any(f[n] == "e4m3" for f in formats[0] for n in others)  # non-candidates choose
    ring = 2 * (2 - 1) / 2
    per_element = sum(r[1] for r in results) / sum(r[2] for r in results) / ring
    assert per_element <= BUDGET["budget"], per_element
    assert per_element > 0.7  # the budget was spent, not left at the floor
    for _, _, _, kept, same, stats in results:
        assert max(kept.values()) < 1e-5, kept  # residuals re-based on every change
        assert same  # resume bitwise (from a checkpoint holding a pending measurement)
        assert stats["budget_planned"] <= BUDGET["budget"]
        assert set(stats["formats"]) == set(stats["budget_errors"])


BAD = 3  # the step of the first geometry routes (factor refreshed at 2, measured, decided)


def _whole(state, name, shape, world):
    """This rank's owner residual of ``name`` as a whole tensor (zero outside its piece)."""
    whole = torch.zeros(shape).reshape(-1)
    owner = state.engine.feedbacks["owner"]
    if name in owner.residuals:
        piece = owner.residual_in(name, IDENTITY).reshape(-1)
        lo = state.rank * -(-whole.numel() // world)
        whole[lo : lo + piece.numel()] = piece
    return whole.view(shape)


def _budget_owner_worker(rank, world):
    import torch.distributed as dist

    model, ddp, state, opt = _setup(owner_feedback=True)
    pipeline, shapes = state.pipeline, {n: p.shape for n, p in model.named_parameters()}
    owner = state.engine.feedbacks["owner"]
    # per tensor, over the finite steps: Σ G, Σ ĝ (the mean received), this rank's decoded
    # sends Σ deq(sent) T⁻¹ and the owner residuals it handed over
    given, received, sent, handed, this_step = {}, {}, {}, {}, {}
    start_owner = {}  # the owner residuals the sums start from (after a skipped step)
    _record_sends(pipeline, lambda name, g, d: this_step.__setitem__(name, (g, d)))

    def step(i, bad=False):
        owned = {n: _whole(state, n, shapes[n], world) for n in owner.residuals}
        loss = loss_fn(ddp, i, rank)
        (loss * float("inf") if bad else loss).backward()
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        if finite:
            for n, p in model.named_parameters():
                g, d = this_step[n]
                given[n] = given.get(n, 0) + g
                sent[n] = sent.get(n, 0) + d
                received[n] = received.get(n, 0) + p.grad.clone()
                if n in owned and n not in owner.residuals:
                    handed[n] = handed.get(n, 0) + owned[n]
            opt.step()
        else:  # a skipped step zeroes the residuals it wrote: the sums start again from what
            for acc in (given, received, sent, handed):  # is left
                acc.clear()
            for n, shape in shapes.items():
                left = pipeline.feedback.residual_in(n, IDENTITY)
                given[n] = left.clone() if left is not None else torch.zeros(shape)
                start_owner[n] = _whole(state, n, shape, world)
        opt.zero_grad()
        return finite

    def residuals():
        feedback = state.state_dict()["feedback"]
        return {k: {n: r.clone() for n, r in feedback[k]["residuals"].items()}
                for k in ("sender", "owner")}

    saved, record, routed = None, {"recoded": []}, set()
    last = state.stats()["formats"]
    for i in range(STEPS):
        if i == RESUME_AT:
            saved = copy.deepcopy((model.state_dict(), opt.state_dict(), state.state_dict()))
        if i == BAD:
            before = residuals()
        finite = step(i, bad=i == BAD and rank == 1)
        formats = state.stats()["formats"]
        routed |= {n for n, p in formats.items() if p == "nvfp4-geo"}
        record["recoded"] += [n for n in owner.residuals
                              if {formats[n], last[n]} == {"nvfp4", "e4m3"}]
        if i == BAD:  # the decision took geometry routes, whose hand-over the skip undid
            record["finite"] = finite
            record["due"] = sorted(n for n in before["owner"] if formats[n] == "nvfp4-geo")
            after = residuals()
            record["gone"] = sorted(set(before["owner"]) - set(after["owner"]))
            record["kept"] = all(  # each residual as it was, or zeroed by the skip
                set(after[k]) <= set(before[k])
                and all(torch.equal(before[k][n], after[k][n]) or not after[k][n].any()
                        for n in after[k])
                for k in before)
        if i == BAD + 1:
            record["geo_owned"] = sorted(n for n in owner.residuals
                                         if formats[n] == "nvfp4-geo")
        last = formats
    record["handed"] = sorted(handed)
    sender = {n: pipeline.feedback.residual_in(n, IDENTITY) for n in given}
    # per rank, in Euclidean terms: Σ G + the owner residuals handed over = what it sent
    # + its sender residual (the hand-over re-expressed, not reset, on a route change)
    delivered = {n: float((given[n] + handed.get(n, 0) - sent[n] - sender[n]).norm()
                          / given[n].norm()) for n in given}
    # over the ranks, for the tensors never routed through a map (owner feedback on both
    # roundings, formats changing): Σ_r Σ_t G = N Σ_t ĝ + Σ_r R_r + Σ_r O_r
    kept = {}
    for n in sorted(set(given) - routed):
        total = given[n] + start_owner.get(n, 0)
        pending = sender[n] + _whole(state, n, shapes[n], world)
        for t in (total, pending):
            dist.all_reduce(t)
        kept[n] = float((total - world * received[n] - pending).norm() / total.norm())
    straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    final = residuals()
    model, ddp, state, opt = _restored(saved, owner_feedback=True)
    for i in range(RESUME_AT, STEPS):
        step(i)
    resumed = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    again = residuals()
    same_state = all(final[k].keys() == again[k].keys() and all(
        torch.equal(final[k][n], again[k][n]) for n in final[k]) for k in final)
    return record, delivered, kept, straight, torch.equal(straight, resumed) and same_state


def test_budget_with_owner_feedback_hands_the_owner_residual_over_on_a_route_change():
    results = run_ranks(_budget_owner_worker, 2, timeout=240)
    assert torch.equal(results[0][3], results[1][3])  # bit-identical on every rank
    for record, delivered, kept, _, same in results:
        assert record["finite"] is False  # step BAD was skipped on every rank ...
        assert record["due"] and record["kept"]  # ... with a hand-over due: it happened, and
        assert record["gone"] == record["due"]  # the skip zeroed what it handed over
        assert record["geo_owned"] == []  # no owner residual of a routed tensor after it
        assert max(delivered.values()) < 1e-5, delivered  # handed over whole
        assert record["recoded"]  # a change of format keeps the owner's residual ...
        assert len(kept) > 5 and max(kept.values()) < 1e-5, kept  # ... and loses nothing
        assert same  # resume bitwise, residuals of both roundings included


def _refusal_worker(rank, world):
    from geofp8.fsdp import GeoFP8FSDP

    model = make_model(0)
    refused = []
    for make in (lambda: GeoFP8FSDP(model, GeoFP8Config(**BUDGET)),
                 lambda: GeoFP8State(model, GeoFP8Config(**{**BUDGET, "hierarchy": "auto",
                                                            "node_size": 2}))):
        try:
            make()
        except ValueError as exc:
            refused.append(str(exc))
    return refused


def test_fsdp_and_the_node_hierarchy_refuse_a_budget():
    fsdp, hierarchy = run_ranks(_refusal_worker, 4)[0]  # two nodes of two ranks
    assert "DDP-only" in fsdp
    assert "needs the flat collective" in hierarchy
    with pytest.raises(ValueError, match="budget needs hierarchy"):
        GeoFP8Config(**{**BUDGET, "hierarchy": "node"})


def test_the_budget_method_needs_its_budget():
    from geofp8.methods import METHODS
    from geofp8.tools.errors import UsageError
    from geofp8.tools.train.config import TrainConfig

    with pytest.raises(ValueError, match=r"needs \['budget'\]"):
        METHODS["budget"].config()
    assert METHODS["budget"].config(budget=0.7, k=8).budget == 0.7
    assert METHODS["nvfp4-ef"].takes(budget=0.7) == {}
    with pytest.raises(UsageError, match="--method budget needs --budget"):
        TrainConfig(method="budget")
    ef2 = METHODS["budget-ef2"].config(budget=0.67)
    assert ef2.budget == 0.67 and ef2.owner_feedback and ef2.error_feedback
    with pytest.raises(UsageError, match="--method budget-ef2 needs --budget"):
        TrainConfig(method="budget-ef2")


def test_compare_refuses_a_budget_method_without_its_budget_before_any_run(tmp_path):
    from geofp8.tools.errors import UsageError
    from geofp8.tools.train.compare import compare
    from geofp8.tools.train.config import TrainConfig

    with pytest.raises(UsageError, match="--method budget-ef2 needs --budget"):
        compare(TrainConfig(), ["fp32", "budget-ef2"], [0], nproc=2, out=tmp_path,
                echo=lambda *a: None)
    assert not (tmp_path / "runs").exists()  # fp32 did not run first
