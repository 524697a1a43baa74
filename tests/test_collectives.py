"""The exact FP8 all-reduce on real gloo processes, against its single-process model."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import run_ranks
from geofp8.codecs import FP8Codec
from geofp8.comm import (
    ShardLayout,
    all_finite,
    decode,
    decode_gathered,
    encode,
    encode_reduced,
    encode_with_error,
    exact_allreduce,
    fp32_allreduce_wire_bytes,
    rounding_error,
    simulate_exact_allreduce,
)

SHAPES = [(5, 7), (3,), (64,), (10, 10)]
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)


def _inputs(world_size):
    return [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) * (i + 1)
            for i in range(world_size)]


def _exact_worker(rank, world_size, codec):
    layout = ShardLayout.build(SHAPES, codec, world_size)
    return exact_allreduce(_inputs(world_size)[rank].clone(), layout)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_exact_allreduce_matches_model_on_every_rank(world_size, scaling):
    codec = FP8Codec("e5m2", scaling, 16)
    outs = run_ranks(_exact_worker, world_size, (codec,))
    expected = simulate_exact_allreduce(_inputs(world_size), ShardLayout.build(SHAPES, codec,
                                                                               world_size))
    for out in outs:
        assert torch.equal(out, expected)  # bit-identical on all ranks, and equal to the model
    ref = torch.stack(_inputs(world_size)).sum(0)
    assert (expected - ref).norm() / ref.norm() < 2 * 2**-3


def _into_worker(rank, world_size):
    from geofp8.comm import Communicator
    from geofp8.comm.group import DeviceGroup

    layout = ShardLayout.build(SHAPES, FP8Codec(), world_size)
    x = _inputs(world_size)[rank]
    out = {}
    for collective in ("exact", "allgather"):
        group = DeviceGroup(None, torch.device("cpu"))
        fresh = Communicator(collective, group).launch(encode(x, layout, sender=rank), layout)
        buf = torch.full((NUMEL,), 7.0)
        into = Communicator(collective, group).launch(encode(x, layout, sender=rank), layout,
                                                      out=buf)
        out[collective] = (fresh.wait(), into.wait() is buf, buf)
    return out


@pytest.mark.distributed
def test_both_collectives_decode_the_sum_into_the_vector_given():
    """``launch(out=bucket)``, as the DDP hook calls it: the future's value is that vector,
    holding the sum a new one would, for both collectives."""
    for ranks in run_ranks(_into_worker, 2):
        for collective, (fresh, is_buf, buf) in ranks.items():
            assert is_buf, collective
            assert torch.equal(buf, fresh), collective


def _release_worker(rank, world_size):
    from geofp8.comm import Communicator
    from geofp8.comm.group import DeviceGroup

    class Recording(DeviceGroup):
        """Remembers every buffer handed to (or made by) the two collectives."""

        buffers: list = []

        def all_to_all(self, out, inp, *args):
            self.buffers += [out, inp]
            return super().all_to_all(out, inp, *args)

        def all_gather(self, t, *args, **kwargs):
            gathered, work = super().all_gather(t, *args, **kwargs)
            self.buffers += [t, gathered]
            return gathered, work

    layout = ShardLayout.build(SHAPES, FP8Codec(), world_size)
    inputs = [x * (k + 1) for k, x in enumerate(_inputs(world_size))]
    results = {}
    for collective, lag in (("exact", 1), ("allgather", 1), ("exact", 2)):
        group = Recording(None, torch.device("cpu"))
        group.buffers = []
        communicator = Communicator(collective, group, lag=lag)
        # launch i's all-gather is issued by launch i + lag, the rest by the last one
        futures = [communicator.launch(encode(k * inputs[rank], layout, sender=rank), layout,
                                       last=k == LAUNCHES) for k in range(1, LAUNCHES + 1)]
        results[collective, lag] = ([f.wait() for f in futures],
                                    [b.untyped_storage().nbytes() for b in group.buffers])
    return results


LAUNCHES = 4


@pytest.mark.distributed
def test_the_collective_frees_its_buffers_once_read():
    """Every encoded buffer (sent, received, gathered) is freed once its collective is done
    and it is read, though the group keeps the collectives' Works alive; the sums are
    unchanged (they match the single-process model)."""
    world_size = 2
    layout = ShardLayout.build(SHAPES, FP8Codec(), world_size)
    inputs = [x * (k + 1) for k, x in enumerate(_inputs(world_size))]
    expected = [simulate_exact_allreduce([k * x for x in inputs], layout)
                for k in range(1, LAUNCHES + 1)]
    for ranks in run_ranks(_release_worker, world_size):
        for (collective, lag), (sums, sizes) in ranks.items():
            assert len(sizes) >= 4 and sizes == [0] * len(sizes), (collective, sizes)
            if collective == "exact":  # the same sums whatever the lag
                assert len(sums) == LAUNCHES
                assert all(torch.equal(s, e) for s, e in zip(sums, expected)), lag


def test_a_lag_below_one_is_refused():
    from types import SimpleNamespace

    from geofp8.comm import Communicator

    with pytest.raises(ValueError, match="lag"):
        Communicator("exact", SimpleNamespace(rank=0), lag=0)


def test_wire_bytes_close_to_a_quarter_of_fp32():
    layout = ShardLayout.build([(1024, 1024)], FP8Codec("e4m3", "tensor"), 4)
    ratio = layout.wire_bytes(0) / fp32_allreduce_wire_bytes(layout.numel, 4)
    assert 0.25 <= ratio < 0.2501


# -- single-process tests of the layout and the model -------------------------------------

U_ROUND = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}  # unit round-off of the two formats


def _cuts(lengths, start=0):
    """Cumulative end positions of consecutive runs of the given lengths."""
    out, pos = [], start
    for n in lengths:
        pos += n
        out.append(pos)
    return out


def _check_layout(shapes, codec, world_size):
    layout = ShardLayout.build(shapes, codec, world_size)
    numel = sum(torch.Size(s).numel() for s in shapes)
    assert layout.numel == numel
    assert len(layout.segments) == len(layout.groups) == world_size
    # every tensor is cut into N chunks of at most ceil(numel/N); shard j holds chunk j of each
    covered, offset = [], 0
    for shape in shapes:
        m = torch.Size(shape).numel()
        chunk = -(-m // world_size) if m else 0
        for j in range(world_size):
            lo, hi = offset + min(j * chunk, m), offset + min((j + 1) * chunk, m)
            assert ((lo, hi) in layout.segments[j]) == (hi > lo)
        offset += m
    for j in range(world_size):
        # one tuple of scale groups per segment, each exactly filling its segment
        assert [sum(g) for g in layout.groups[j]] == [hi - lo for lo, hi in layout.segments[j]]
        groups = [n for seg in layout.groups[j] for n in seg]
        assert all(n >= 1 for n in groups)
        assert (layout.shard_numel(j) == 0) == (groups == [])  # empty shard: no scales
        assert layout.shard_bytes(j) == layout.shard_numel(j) + 4 * len(groups)
        covered += layout.segments[j]
    assert sorted(covered) == sorted(set(covered))
    assert sum(hi - lo for lo, hi in covered) == numel  # shards tile the vector exactly
    # group boundaries are exactly the codec's boundaries plus the chunk boundaries
    codec_cuts = set(_cuts([n for s in shapes for n in codec.groups(tuple(s))]))
    chunk_cuts = {hi for seg in layout.segments for _lo, hi in seg}
    got = sorted(b for j in range(world_size) for _a, b in layout.group_spans(j))
    assert got == sorted(codec_cuts | chunk_cuts)
    return layout


@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_layout_cuts_groups_at_shard_boundaries(scaling):
    codec = FP8Codec("e4m3", scaling, 16)
    layout = _check_layout(SHAPES, codec, 4)
    # tensors of 35 | 3 | 64 | 100 elements, in chunks of 9 | 1 | 16 | 25
    assert layout.segments[0] == ((0, 9), (35, 36), (38, 54), (102, 127))
    assert layout.segments[3] == ((27, 35), (86, 102), (177, 202))  # the 3-vector ran out
    if scaling == "tensor":
        assert layout.groups[0] == ((9,), (1,), (16,), (25,))
    if scaling == "row":
        # rows of 7 (×5) | 3 | 64 | 10 (×10): chunk cuts at 9 and 25 split rows
        assert layout.groups[0] == ((7, 2), (1,), (16,), (10, 10, 5))
    _check_layout(SHAPES, codec, 1)
    _check_layout(SHAPES, codec, 7)


def test_layout_with_fewer_elements_than_ranks():
    codec = FP8Codec("e5m2", "row")
    layout = _check_layout([(2,), (1, 1)], codec, 5)
    assert layout.segments == (((0, 1), (2, 3)), ((1, 2),), (), (), ())
    assert layout.groups == (((1,), (1,)), ((1,),), (), (), ())
    assert layout.shard_bytes(3) == 0 and layout.max_shard_bytes == 10
    empty = _check_layout([(0, 4), (3, 0)], codec, 3)
    assert empty.numel == 0 and all(g == () for g in empty.groups)
    out = simulate_exact_allreduce([torch.zeros(0)] * 3, empty)
    assert out.shape == (0,)
    x = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 0.25, -1.0]),
         torch.tensor([0.0, 1.0, 2.0]), torch.zeros(3), torch.tensor([1.0, 1.0, 1.0])]
    assert torch.equal(simulate_exact_allreduce(x, layout), torch.stack(x).sum(0))  # exact here


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_one_rank_is_two_round_trips(fmt, scaling):
    codec = FP8Codec(fmt, scaling, 8)
    layout = ShardLayout.build(SHAPES, codec, 1)
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3,
                                                                                        NUMEL)
    lengths = [n for seg in layout.groups[0] for n in seg]
    expected = codec.round_trip(codec.round_trip(x, lengths), lengths)
    assert torch.equal(simulate_exact_allreduce([x], layout), expected)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_on_one_rank_poisons_everything(world_size, bad):
    codec = FP8Codec("e4m3", "block", 8)
    layout = ShardLayout.build(SHAPES, codec, world_size)
    for where in (0, NUMEL // 2, NUMEL - 1):
        inputs = _inputs(world_size)
        inputs[world_size - 1][where] = bad
        out = simulate_exact_allreduce(inputs, layout)
        assert torch.isnan(out).all()


@pytest.mark.parametrize("fmt", ["e4m3", "nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("kernels", ["batched", "chunked"])
def test_a_non_finite_value_poisons_the_sum_in_every_codec(fmt, kernels):
    """Stage 5 all NaN when one rank's shard holds a non-finite value, and no NaN otherwise:
    segmentwise layouts (even segments) fold the poison into the codec's scales, the others
    poison the decoded values."""
    from geofp8.codecs import make_codec

    for shapes in ([(64, 16), (32, 8)], [(37, 11), (3,), (64, 16)]):
        layout = ShardLayout.build(shapes, make_codec(fmt), 3, kernels=kernels)
        inputs = [torch.randn(layout.numel, generator=torch.Generator().manual_seed(r))
                  for r in range(3)]
        assert not simulate_exact_allreduce(inputs, layout).isnan().any()
        inputs[2][layout.numel - 1] = float("inf")
        assert simulate_exact_allreduce(inputs, layout).isnan().all(), shapes


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_zero_inputs_give_zeros(world_size):
    codec = FP8Codec("e5m2", "row")
    layout = ShardLayout.build(SHAPES, codec, world_size)
    out = simulate_exact_allreduce([torch.zeros(NUMEL)] * world_size, layout)
    assert torch.equal(out, torch.zeros(NUMEL))
    # zeros on some ranks only: the sum is the other ranks' FP8 sum, never NaN
    inputs = [torch.zeros(NUMEL)] * (world_size - 1) + [torch.ones(NUMEL)]
    assert torch.equal(simulate_exact_allreduce(inputs, layout), torch.ones(NUMEL))


def test_simulate_checks_the_number_of_inputs():
    layout = ShardLayout.build(SHAPES, FP8Codec(), 3)
    with pytest.raises(ValueError):
        simulate_exact_allreduce(_inputs(2), layout)


@st.composite
def _allreduce_case(draw):
    n_shapes = draw(st.integers(1, 4))
    shapes = []
    for _ in range(n_shapes):
        ndim = draw(st.integers(1, 3))
        shapes.append(tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim))))
    codec = FP8Codec(draw(st.sampled_from(["e4m3", "e5m2"])),
                  draw(st.sampled_from(["tensor", "row", "block"])), draw(st.integers(1, 16)))
    world_size = draw(st.integers(1, 6))
    numel = sum(torch.Size(s).numel() for s in shapes)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    inputs = []
    for _ in range(world_size):
        lo = draw(st.floats(-30, 30))
        hi = draw(st.floats(lo, min(lo + 12, 30)))
        exps = lo + (hi - lo) * torch.rand(numel, generator=gen, dtype=torch.float64)
        x = torch.randn(numel, generator=gen, dtype=torch.float64).sign() * 10**exps
        if draw(st.booleans()):
            x[: draw(st.integers(0, numel))] = 0.0
        inputs.append(x.float())
    return shapes, codec, world_size, inputs


@settings(max_examples=150, deadline=None)
@given(case=_allreduce_case())
def test_fuzz_simulated_allreduce_error_bound(case):
    """Per scale group g of the layout, with A_g = Σ_r max_g |x_r| and M_g = max_g |Σ_r x_r|:

    * stage 1 (each rank's own FP8 rounding): |x̂_r − x_r| ≤ u·max_g|x_r| element-wise (half
      an ulp of the top binade is at most u·fmax in scaled units), so Σ_r adds ≤ u·A_g;
    * the FP32 sum of N terms adds ≤ N·2⁻²⁴·Σ_r|x̂_r| ≤ N·2⁻²⁴·(1+u)·A_g;
    * stage 2 re-rounds the reduced shard with its own scale: ≤ u·max_g|Ŝ|
      ≤ u·(M_g + u·A_g + N·2⁻²⁴·(1+u)·A_g).

    Hence max_g |out − Σ_r x_r| ≤ u·M_g + (u(1+u) + N·2⁻²³)·A_g: at most ≈ 2u·A_g, and
    ≈ u·M_g when the ranks agree in sign."""
    shapes, codec, world_size, inputs = case
    layout = _check_layout(shapes, codec, world_size)
    out = simulate_exact_allreduce(inputs, layout).double()
    X = torch.stack([x.double() for x in inputs])
    exact = X.sum(0)
    assert torch.isfinite(out).all()
    u = U_ROUND[codec.format]
    for j in range(world_size):
        for a, b in layout.group_spans(j):
            A_g = float(X[:, a:b].abs().amax(dim=1).sum())
            M_g = float(exact[a:b].abs().max())
            err = float((out[a:b] - exact[a:b]).abs().max())
            bound = u * M_g + (u * (1 + u) + world_size * 2.0**-23) * A_g
            assert err <= bound + 1e-44, (err, bound, A_g, M_g)
    # the model is deterministic
    assert torch.equal(simulate_exact_allreduce(inputs, layout).double(), out)


BATCHED_CODECS = [("e4m3", "tensor", "nearest"), ("e4m3", "row", "nearest"),
                  ("e5m2", "block", "nearest"), ("nvfp4", None, "nearest"),
                  ("nvfp4", None, "stochastic"), ("mxfp4", None, "stochastic"),
                  ("mxfp8", None, "nearest")]


@pytest.mark.parametrize(("fmt", "scaling", "rounding"), BATCHED_CODECS)
@pytest.mark.parametrize("shapes", [[(37, 11), (3,), (64, 16)], [(32, 32)] * 3])
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_encode_shards_is_encode_into_shard_by_shard(fmt, scaling, rounding, shapes,
                                                     world_size):
    """The batched codec path (all shards in one call: what the stages use) writes every
    shard's payload byte for byte as the per-shard one, and decodes it to the same values
    (odd shards, unequal and equal groups, a NaN and an Inf in some shards)."""
    from geofp8.codecs import make_codec
    from geofp8.comm.stages import _shard_seed

    codec = make_codec(fmt, scaling, 8, rounding)
    layout = ShardLayout.build(shapes, codec, world_size)
    gen = torch.Generator().manual_seed(world_size)
    flat = torch.randn(layout.numel, generator=gen) * torch.logspace(-30, 10, layout.numel)
    flat[3], flat[-2] = float("nan"), float("inf")
    shards = [layout.gather(flat, j) for j in range(world_size)]
    seeds = [_shard_seed(5, 1, j) for j in range(world_size)]
    parts = codec.encode_shards(torch.cat(shards), layout.groups, seeds)
    k = len(parts) // world_size
    values = torch.empty(layout.numel)
    finite = codec.decode_shards(values, parts, layout.groups)
    expect_finite, pos = True, 0
    for j in range(world_size):
        payload = torch.empty(layout.shard_bytes(j), dtype=torch.uint8)
        codec.encode_into(payload, shards[j], layout.groups[j], seed=seeds[j])
        assert torch.equal(torch.cat(parts[j * k : (j + 1) * k]), payload), j
        expect = torch.empty(layout.shard_numel(j))
        expect_finite &= bool(codec.decode_into(expect, payload, layout.groups[j]))
        got = values[pos : pos + expect.numel()]
        pos += expect.numel()
        # bitwise where a number (a NaN's payload bits may come from either operand)
        assert torch.equal(got.isnan(), expect.isnan()), j
        assert torch.equal(got.nan_to_num().view(torch.int32),
                           expect.nan_to_num().view(torch.int32)), j
    assert not expect_finite  # the NaN and the Inf
    assert bool(finite) == expect_finite


@pytest.mark.parametrize(("fmt", "scaling", "rounding"), [*BATCHED_CODECS, ("mixed", None, None)])
def test_chunked_and_batched_kernels_are_bit_identical(fmt, scaling, rounding):
    """A layout's two ways of running the codecs (``kernels``): every stage's bytes, the
    all-reduced values, the sender's decoded view and its rounding error (EF) agree bit for
    bit, at N = 3 with odd shards and with one codec per tensor (``"mixed"``: the budget's
    nvfp4 / e4m3 layouts)."""
    from geofp8.codecs import make_codec

    shapes = [(37, 11), (3,), (64, 16), (40, 8)]
    if fmt == "mixed":
        codecs = [make_codec("nvfp4", rounding="stochastic"), make_codec("e4m3"),
                  make_codec("nvfp4", rounding="stochastic"), make_codec("e4m3")]
        codec = codecs[0]
    else:
        codec, codecs = make_codec(fmt, scaling, 8, rounding), None
    out = {}
    for kernels in ("batched", "chunked"):
        layout = ShardLayout.build(shapes, codec, 3, codecs=codecs, kernels=kernels)
        inputs = [torch.randn(layout.numel, generator=torch.Generator().manual_seed(r))
                  * torch.logspace(-20, 5, layout.numel) for r in range(3)]
        sent = encode(inputs[0], layout, seed=7, sender=1)
        out[kernels] = (sent, simulate_exact_allreduce(inputs, layout, seed=7),
                        decode(sent, layout), rounding_error(sent, inputs[0], layout))
        assert torch.equal(out[kernels][3], inputs[0] - out[kernels][2])
    assert torch.equal(out["batched"][0], out["chunked"][0])
    for a, b in zip(out["batched"][1:], out["chunked"][1:]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("kernels", ["batched", "chunked"])
@pytest.mark.parametrize("shapes", [[(37, 11), (3,), (64, 16)], [(64, 16)]])
def test_the_sum_is_decoded_into_the_vector_given(kernels, shapes):
    """Stage 5 into a given vector (a DDP bucket): the same bits as into a new one, whether
    the shards lie in flat order (one tensor) or not, and poisoned all NaN the same way."""
    layout = ShardLayout.build(shapes, FP8Codec(), 3, kernels=kernels)
    assert layout.shard_major_is_flat == (len(shapes) == 1)
    inputs = [torch.randn(layout.numel, generator=torch.Generator().manual_seed(r))
              for r in range(3)]
    for poisoned in (False, True):
        if poisoned:
            inputs[1][5] = float("inf")
        expect = simulate_exact_allreduce(inputs, layout)
        out = torch.full((layout.numel,), 7.0)
        assert simulate_exact_allreduce(inputs, layout, out=out) is out
        assert torch.equal(out.view(torch.int32), expect.view(torch.int32))
        assert bool(out.isnan().all()) == poisoned


@pytest.mark.parametrize("kernels", ["batched", "chunked"])
def test_the_senders_copies_are_decoded_into_the_scratch_given(kernels):
    """Stage 3 with a scratch vector (the bucket the sum goes to later): the same sum bit for
    bit; the N decoded copies are in the scratch when it holds them, and a scratch one
    element too small is left untouched."""
    from geofp8.comm.stages import decode_sum

    n = 3
    layout = ShardLayout.build([(37, 11), (3,), (64, 16)], FP8Codec(), n, kernels=kernels)
    inputs = [torch.randn(layout.numel, generator=torch.Generator().manual_seed(r))
              for r in range(n)]
    records = [encode(x, layout, sender=r).split([layout.send_bytes(j) for j in range(n)])
               for r, x in enumerate(inputs)]
    for j in range(n):
        received = torch.cat([records[r][j] for r in range(n)])
        expect = decode_sum(received, layout, j)
        size = n * layout.shard_numel(j)
        scratch = torch.full((size + 5,), 7.0)
        got = decode_sum(received, layout, j, scratch=scratch)
        assert torch.equal(got.view(torch.int32), expect.view(torch.int32))
        assert torch.equal(scratch[:size].view(n, -1).sum(0).view(torch.int32),
                           expect.view(torch.int32))
        assert bool((scratch[size:] == 7).all())
        small = torch.full((size - 1,), 7.0)
        decode_sum(received, layout, j, scratch=small)
        assert bool((small == 7).all())


def test_auto_kernels_are_chunked_on_a_cpu_and_batched_elsewhere():
    layout = ShardLayout.build([(8, 8)], FP8Codec(), 2)
    assert layout.kernels == "auto"
    assert not layout.batched(torch.device("cpu"))
    assert layout.batched(torch.device("meta"))
    assert ShardLayout.build([(8, 8)], FP8Codec(), 2, kernels="batched").batched(
        torch.device("cpu"))
    with pytest.raises(ValueError, match="kernels"):
        ShardLayout.build([(8, 8)], FP8Codec(), 2, kernels="fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_all_finite_agrees_with_isfinite(dtype):
    """The engine's finite flag: huge finite values (whose sum or difference overflows) are
    finite; any ±inf or NaN, anywhere, is not; an empty vector is."""
    big, inf, nan = torch.finfo(dtype).max, float("inf"), float("nan")
    cases = [[-big, big, 0.0, -0.0], [big, big], torch.randn(1000).tolist(), [],
             [1.0, inf], [-inf, 2.0], [nan] + [1.0] * 7, [1.0] * 7 + [nan], [inf, -inf]]
    for values in cases:
        x = torch.tensor(values, dtype=dtype)
        flag = all_finite(x)
        assert flag.dtype == torch.bool and flag.dim() == 0
        assert bool(flag) == bool(torch.isfinite(x).all()), x


class _Cats(TorchDispatchMode):
    """Counts the concatenations of at least ``numel`` values of ``dtype`` (FP32 by default:
    how a bucket is reordered, not a stack of a few scales; ``None``: any)."""

    def __init__(self, numel: int = 0, dtype: torch.dtype | None = torch.float32) -> None:
        super().__init__()
        self.count, self.numel, self.dtype = 0, numel, dtype

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += func in (torch.ops.aten.cat.default, torch.ops.aten.cat.out) and (
            self.dtype in (None, out.dtype) and out.numel() >= self.numel)
        return out


ODD = [(37, 11), (3,), (64, 16)]  # at N = 3, segments of odd lengths
EVEN = [(36, 12), (6,), (64, 16)]


@pytest.mark.parametrize(("fmt", "scaling", "rounding", "shapes", "segmentwise"),
                         [("e4m3", "tensor", "nearest", ODD, True),
                          ("e5m2", "block", "nearest", ODD, True),
                          ("mxfp8", None, "nearest", ODD, True),
                          ("mxfp8", None, "stochastic", ODD, False),
                          ("nvfp4", None, "nearest", ODD, False),
                          ("nvfp4", None, "nearest", EVEN, True),
                          ("nvfp4", None, "stochastic", EVEN, False),
                          ("mxfp4", None, "nearest", ODD, False),
                          ("mxfp4", None, "nearest", EVEN, True)])
def test_a_segmentwise_codec_is_run_in_flat_order(fmt, scaling, rounding, shapes, segmentwise):
    """FP8, MXFP8 and (segments of even lengths: whole bytes of nibbles) NVFP4 / MXFP4 payloads
    with nearest rounding are per-segment concatenations: the stages, batched or chunked,
    encode and decode the bucket in its flat order and reorder bytes, never FP32 values (the
    others reorder the bucket into shard-major order or gather shard by shard), with the bytes
    and values of the codec run shard by shard."""
    from geofp8.codecs import make_codec
    from geofp8.codecs.base import mix_seed

    n = 3
    codec = make_codec(fmt, scaling, 8, rounding)
    layouts = {k: ShardLayout.build(shapes, codec, n, kernels=k) for k in ("batched", "chunked")}
    layout = layouts["chunked"]
    assert layout.segmentwise == segmentwise and not layout.shard_major_is_flat
    flat = torch.randn(layout.numel, generator=torch.Generator().manual_seed(3))
    gathered = torch.stack([encode_reduced(flat[: layout.shard_numel(j)], layout, j)
                            for j in range(n)])
    # the reference: shard by shard, each shard's values gathered and decoded into place
    records = [torch.empty(layout.shard_bytes(j), dtype=torch.uint8) for j in range(n)]
    residual, total = torch.empty_like(flat), torch.empty_like(flat)
    for j, record in enumerate(records):
        layout.encode_gathered(record, flat, j, mix_seed(9, 0, j))
        layout.decode_scattered(residual, record, j, minus=flat)
        layout.decode_scattered(total, gathered[j], j)
    expect = (torch.cat(records), residual, total)
    for kernels, layout in layouts.items():
        with _Cats(min(layout.shard_numel(j) for j in range(n))) as cats:
            sent = encode(flat, layout, seed=9)
            got = (sent, rounding_error(sent, flat, layout),
                   decode_gathered(gathered, layout, out=torch.empty_like(flat)))
            with _Cats(dtype=None) as joins:  # the error in flat order, from the codec's call
                again, error = encode_with_error(flat, layout, seed=9)
            assert torch.equal(again, sent)
        # segmentwise: one concatenation, the payloads into the wire buffer (the batched
        # error is decoded from views of the codec's parts, codecs.base.joined)
        assert joins.count == 1 or not segmentwise, (kernels, joins.count)
        assert layout.encodes_error == segmentwise
        if not layout.encodes_error:
            with pytest.raises(ValueError, match="encodes_error"):
                layout.encode_pieces(flat, [None] * n, with_error=True)
        assert (cats.count == 0) == segmentwise, (kernels, cats.count)
        for a, b in zip((*got, error), (*expect, residual)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), kernels


class _FP32Vectors(TorchDispatchMode):
    """Counts the new FP32 tensors of ``numel`` elements made inside the block."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func._schema.name.startswith("aten::empty") and out.dtype == torch.float32
                and out.numel() == self.numel):
            self.count += 1
        return out


@pytest.mark.parametrize(("fmt", "shapes"), [("e4m3", ODD), ("nvfp4", EVEN)])
def test_the_chunked_encode_writes_the_error_over_the_bucket(fmt, shapes):
    """``error_out=flat`` on a CPU (the native kernels' fused error): the error is written
    over the bucket in the encoding pass, the bits of a new vector's, and no bucket-sized
    FP32 vector is made (the sender's peak memory, issue 43)."""
    from geofp8.codecs import make_codec

    layout = ShardLayout.build(shapes, make_codec(fmt, "block", 8), 3, kernels="chunked")
    flat = torch.randn(layout.numel, generator=torch.Generator().manual_seed(5))
    sent, error = encode_with_error(flat, layout, seed=9)
    bucket = flat.clone()
    with _FP32Vectors(layout.numel) as made:
        again, written = encode_with_error(bucket, layout, seed=9, error_out=bucket)
    assert written.data_ptr() == bucket.data_ptr() and made.count == 0
    assert torch.equal(again, sent) and torch.equal(bucket.view(torch.int32),
                                                    error.view(torch.int32))


def test_joined_is_a_view_only_of_parts_that_lie_back_to_back():
    from geofp8.codecs.base import joined

    base = torch.arange(12, dtype=torch.uint8)
    a, b, c = base.split(4)
    view = joined([a, b])
    assert view.data_ptr() == base.data_ptr() and torch.equal(view, base[:8])
    for parts, options in (([a, c], {}), ([b, a], {}), ([a, b], {"fresh": True}),
                           ([base[1:5], base[5:9]], {"align": 4}), ([a.clone(), b], {})):
        out = joined(parts, **options)
        assert torch.equal(out, torch.cat(parts)), options
        assert out.untyped_storage().data_ptr() != base.untyped_storage().data_ptr(), options


def test_finite_flag_is_false_for_any_nan_or_inf():
    from geofp8.codecs.base import finite_flag

    assert bool(finite_flag(torch.tensor([])))
    assert bool(finite_flag(torch.tensor([-0.0, 3e38, -3e38, 1e-45])))
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert not bool(finite_flag(torch.tensor([1.0, bad, 2.0])))
