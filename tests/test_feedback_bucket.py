"""A bucket's residuals read and written as one flat vector (ErrorFeedback.bucket_in /
stage_bucket): each residual a view of it, the same keys, values and state as tensor by
tensor, a skipped step's residuals read as zero."""

import torch

from geofp8.feedback import ErrorFeedback
from geofp8.geometry.transforms import IDENTITY

SHAPES = [(3, 4), (5,), (2, 2, 2)]
NAMES = ["a.weight", "b.bias", "c.weight"]


def _staged(storage="bf16"):
    fb = ErrorFeedback(storage)
    g = torch.Generator().manual_seed(0)
    for name, shape in zip(NAMES, SHAPES):
        fb.stage(name, torch.randn(shape, generator=g), IDENTITY)
    fb.commit(torch.tensor(True))
    return fb


def test_a_bucket_reads_its_residuals_as_one_vector_of_views_with_the_same_state():
    for storage in ("fp32", "bf16"):
        fb = _staged(storage)
        before = fb.state_dict()
        singles = torch.cat([fb.residual_in(n, IDENTITY).reshape(-1) for n in NAMES])
        block, flag = fb.bucket_in(NAMES, SHAPES)
        assert bool(flag) and block.dtype == fb.residuals[NAMES[0]].dtype
        assert torch.equal(block.float(), singles)
        pos = 0
        for name, shape in zip(NAMES, SHAPES):
            r = fb.residuals[name]
            assert tuple(r.shape) == shape
            assert r.data_ptr() == block.data_ptr() + pos * block.element_size()
            pos += r.numel()
        after = fb.state_dict()
        assert after["residuals"].keys() == before["residuals"].keys()
        assert all(torch.equal(after["residuals"][n], before["residuals"][n]) for n in NAMES)
        assert fb.bucket_in(NAMES, SHAPES)[0] is block  # made once


def test_a_bucket_write_and_a_skipped_step_zero_it_on_the_device():
    fb = _staged()
    block, _ = fb.bucket_in(NAMES, SHAPES)
    error = torch.arange(block.numel(), dtype=torch.float32)
    fb.stage_bucket(NAMES, error)
    assert torch.equal(block.float(), error)
    assert torch.equal(fb.residuals["b.bias"].float(), error[12:17])
    fb.commit(torch.tensor(False))  # the step is skipped: its residuals read as zero
    block2, flag = fb.bucket_in(NAMES, SHAPES)
    assert block2 is block and not bool(flag)
    assert not torch.where(flag, block2, 0.0).any()
    assert not fb.residual_in("c.weight", IDENTITY).any()
    assert all(not r.any() for r in fb.state_dict()["residuals"].values())


def test_a_first_bucket_write_makes_the_vector_that_later_steps_read():
    """The bucket's first residuals are its flat vector (views of it): the next read joins
    nothing, so no second residual set is held at any step."""
    fb = ErrorFeedback("bf16")
    assert fb.first_bucket(NAMES) and not ErrorFeedback("fp8").first_bucket(NAMES)
    error = torch.randn(17 + 8, generator=torch.Generator().manual_seed(1))
    fb.stage_bucket(NAMES, error, SHAPES)
    fb.commit(torch.tensor(True))
    assert not fb.first_bucket(NAMES)
    block, flag = fb.bucket_in(NAMES, SHAPES)
    assert bool(flag) and torch.equal(block, error.bfloat16())
    assert all(fb.residuals[n].data_ptr() >= block.data_ptr() for n in NAMES)
    assert fb.residuals["c.weight"].data_ptr() == block.data_ptr() + 17 * block.element_size()
    singles = ErrorFeedback("bf16")
    pos = 0
    for name, shape in zip(NAMES, SHAPES):
        n = torch.Size(shape).numel()
        singles.stage(name, error[pos : pos + n].view(shape), IDENTITY)
        pos += n
    singles.commit(torch.tensor(True))
    assert all(torch.equal(fb.residual_in(n, IDENTITY), singles.residual_in(n, IDENTITY))
               for n in NAMES)


def test_a_bucket_is_read_tensor_by_tensor_unless_every_residual_fits():
    fb = _staged()
    assert fb.bucket_in([*NAMES, "d.weight"], [*SHAPES, (1,)]) is None  # no residual yet
    assert fb.bucket_in(NAMES, [(4, 3), *SHAPES[1:]]) is None  # another shape
    fb.stage("a.weight", torch.ones(SHAPES[0]), IDENTITY)  # written by another step
    assert fb.bucket_in(NAMES, SHAPES) is None
    fb = _staged()
    block, _ = fb.bucket_in(NAMES, SHAPES)
    fb.rescale(2.0)  # BF16: rewritten tensor by tensor, no longer the vector's views
    again, _ = fb.bucket_in(NAMES, SHAPES)
    assert again is not block and torch.equal(again.float(), 2 * block.float())
    fb.drop("b.bias")
    assert fb.bucket_in(NAMES, SHAPES) is None and not fb._blocks


def test_a_bucket_reads_residuals_in_their_routes_coordinates_only():
    """A mapped tensor's residual joins the vector when it was written in this step's route
    (the same map object); another route (a refresh) leaves the bucket tensor by tensor,
    where :meth:`residual_in` re-bases it."""
    from geofp8.geometry.transforms import DiagonalInput

    old, new = DiagonalInput(torch.eye(4), 0.1), DiagonalInput(2 * torch.eye(4), 0.1)
    fb = _staged()
    routes = [old, IDENTITY, IDENTITY]
    assert fb.bucket_in(NAMES, SHAPES, routes) is None  # written in identity coordinates
    block, _ = fb.bucket_in(NAMES, SHAPES)
    fb.stage_bucket(NAMES, block, routes=routes)  # written in the map's coordinates
    fb.commit(torch.tensor(True))
    assert fb.basis[NAMES[0]] is old and fb.basis[NAMES[1]] is IDENTITY
    assert fb.bucket_in(NAMES, SHAPES) is None  # not identity any more
    again, flag = fb.bucket_in(NAMES, SHAPES, routes)
    assert again is block and bool(flag)
    assert fb.bucket_in(NAMES, SHAPES, [new, IDENTITY, IDENTITY]) is None


def test_a_recorded_bucket_written_in_place_is_restaged_as_stage_bucket_stages_it():
    """``restage`` (a recorded bucket: the encode wrote its vector in place) leaves what
    ``stage_bucket`` of that vector leaves: its tensors written this step (flag unset until
    committed, then the step's), the same bases, version and live vector; a skipped step
    zeroes them."""
    staged, restaged = _staged("fp32"), _staged("fp32")
    for fb in (staged, restaged):
        fb.bucket_in(NAMES, SHAPES)[0].copy_(torch.arange(17.0 + 8))  # the new residual
    version, held = restaged.version, restaged.held(NAMES)
    staged.stage_bucket(NAMES, staged.bucket_in(NAMES, SHAPES)[0])
    restaged.restage(tuple(NAMES))
    assert restaged.version == version and restaged.held(NAMES) is held and held.live
    for fb in (staged, restaged):
        assert all(fb.finite[n] is None for n in NAMES) and fb._written == NAMES
        assert all(fb.basis[n] is IDENTITY for n in NAMES)
    assert restaged.version == staged.version
    for fb in (staged, restaged):
        fb.commit(torch.tensor(False))
        block, flag = fb.recorded(fb.held(NAMES))
        assert not bool(flag) and torch.equal(block, torch.arange(17.0 + 8))
        assert not fb.residual_in("b.bias", IDENTITY).any()


OTHER, OTHER_SHAPES = ["d.weight", "e.weight"], [(4, 2), (6,)]


def _two_buckets():
    """Residuals of two buckets (NAMES, OTHER), each read as its flat vector: the first's
    held vector."""
    fb = _staged("fp32")
    for name, shape in zip(OTHER, OTHER_SHAPES):
        fb.stage(name, torch.ones(shape), IDENTITY)
    fb.commit(torch.tensor(True))
    fb.bucket_in(NAMES, SHAPES)
    return fb, fb.held(NAMES)


def test_a_buckets_vector_stays_live_while_another_bucket_is_resolved_again():
    """Another bucket's vector made, its residuals re-based and written, a whole step
    committed: the first bucket's vector is still live (its record followed), the version
    unmoved, and what it holds is what bucket_in reads again."""
    from geofp8.geometry.transforms import DiagonalInput

    fb, held = _two_buckets()
    version = fb.version
    other, _ = fb.bucket_in(OTHER, OTHER_SHAPES)  # the other bucket's vector made
    moved = DiagonalInput(torch.eye(2), 0.1)
    fb.stage(OTHER[0], torch.zeros(OTHER_SHAPES[0]), moved)  # one of its residuals re-based
    fb.stage(OTHER[1], torch.zeros(OTHER_SHAPES[1]), IDENTITY)
    fb.restage(tuple(NAMES))
    fb.commit(torch.tensor(True))
    assert held.live and fb.version == version and not fb.held(OTHER).live
    block, flag = fb.recorded(held)
    assert block is fb.bucket_in(NAMES, SHAPES)[0] and bool(flag)
    assert fb.held(NAMES) is held  # checked again: still the same live vector


def test_a_buckets_vector_is_not_live_once_one_of_its_residuals_changes():
    """Each change to a residual the first bucket reads (re-based, made anew in another
    shape, dropped, re-bucketed with another vector) or to the whole state (rescaled,
    loaded) ends its record: its vector no longer live, or the version moved; bucket_in
    then checks it again (a re-based one is not read flat in its old coordinates)."""
    from geofp8.geometry.transforms import DiagonalInput

    moved = DiagonalInput(torch.eye(4), 0.1)
    changes = [
        lambda fb: fb.stage("a.weight", torch.zeros(3, 4), moved),
        lambda fb: fb.stage("b.bias", torch.zeros(6), IDENTITY),
        lambda fb: fb.drop("c.weight"),
        lambda fb: fb.bucket_in(["a.weight", "b.bias"], SHAPES[:2]),
    ]
    for change in changes:
        fb, held = _two_buckets()
        version = fb.version
        change(fb)
        assert not held.live and fb.version == version
    assert _two_buckets()[0].bucket_in(NAMES, SHAPES) is not None
    fb, held = _two_buckets()
    for name, shape, route in zip(NAMES, SHAPES, [moved, IDENTITY, IDENTITY]):
        fb.stage(name, torch.zeros(shape), route)  # the step re-based a.weight: tensor by tensor
    fb.commit(torch.tensor(True))
    assert fb.bucket_in(NAMES, SHAPES) is None  # a.weight is in the map's coordinates now
    block, _ = fb.bucket_in(NAMES, SHAPES, [moved, IDENTITY, IDENTITY])
    assert block is held.vector and not held.live and fb.held(NAMES).live  # held anew
    for whole in (lambda fb: fb.rescale(0.5),
                  lambda fb: fb.load_state_dict(fb.state_dict(), {})):
        fb, held = _two_buckets()
        version = fb.version
        whole(fb)
        assert fb.version != version
