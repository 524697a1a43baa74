"""A step's input statistics committed where finite in one Triton launch (two for very wide
moments), beside the torch reference (:meth:`geofp8.geometry.statistics.JoinedMoments.commit_into`).

Moments lie back to back in one flat buffer (the step's sums ``P``, the window's ``W``, the
same layout); moment ``i`` of a finite step joins the window only if all of it is finite:

    bad_i = any(¬isfinite(P_i)),  keep_i = finite ∧ ¬bad_i,
    W_i += where(keep_i, P_i, 0),  dropped_i += finite ∧ bad_i,  P_i = 0.

torch takes 18 launches for it (isfinite's four ops, a segment max, a repeat_interleave, the
where, the flags' logic). Here, :func:`commit` picks per layout:

* :func:`moment_commit` (every moment of at most :data:`ONE_PASS` elements: the sketches
  and the exact moments up to 1024 wide, so every layout of ``statistics="auto"``'s
  default): **one** launch, a program per moment that reads it twice, ``bad_i`` from the
  first pass, the add and ``P = 0`` in the second (a moment's device time is serial, in one
  program; the moments run side by side). The int64 ``[M, 2]`` map ``(first element, end)``
  is made once per layout.
* :class:`TiledCommit` (a wider moment, e.g. an exact 4096²: too long for one program): two
  launches, a program per *tile* (at most :data:`TILE` elements of one moment; the int64
  ``[T, 4]`` map ``(first element, end, moment, first tile of the moment)``):
  ``_nonfinite_kernel``, an atomic max of ``epoch + any bad`` into the moment's mark; then
  ``_commit_kernel``, the add where kept and ``P = 0``, and the moment's first tile
  advances its dropped count. The marks are :class:`~.triton_fp8.AmaxSlots` (an epoch per
  call above every mark of an earlier call: zeroed once, not by a launch per call).

Both call as ``commit(P, W, dropped, finite)``, ``dropped`` an int64 ``[len(lengths)]`` and
``finite`` a 0-dim bool, all on the layout's device (the step's own argument last: the rest
may be bound once, :meth:`~geofp8.geometry.statistics.JoinedMoments.bound_commit`); no host
read. The add is one IEEE add
of the same operands as torch's, so ``W``'s bits are the reference's (a dropped moment adds
+0: ``-0`` becomes ``+0`` there too).
"""

from __future__ import annotations

import torch

from .triton_fp8 import AmaxSlots, Launch, triton

if triton is not None:
    import triton.language as tl

__all__ = ["ONE_PASS", "TILE", "TiledCommit", "commit", "moment_commit"]

TILE = 1024  # elements per program (tiled), per loop iteration (a program per moment)
ONE_PASS = 1 << 20  # the widest moment committed by one program (4 MiB of FP32)


def commit(lengths: list[int], device: torch.device) -> Launch | TiledCommit:
    """The fused commit of moments of ``lengths`` elements lying back to back on ``device``
    (module notes): one launch when every moment fits :data:`ONE_PASS`, else two."""
    if max(lengths) <= ONE_PASS:
        return moment_commit(lengths, device)
    return TiledCommit(lengths, device)


def moment_commit(lengths: list[int], device: torch.device) -> Launch:
    """A program per moment (module notes): the launch bound to its ``(first, end)`` map."""
    ends = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    moments = torch.stack([ends - torch.tensor(lengths, dtype=torch.int64), ends], 1)
    return Launch(_commit_moment_kernel, (len(lengths),), moments_ptr=moments.to(device),
                  TILE=TILE)


class TiledCommit:
    """The two-launch commit of a layout with a moment wider than :data:`ONE_PASS`."""

    __slots__ = ("_commit", "_flag", "marks", "tiles")

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        rows, pos = [], 0
        for i, n in enumerate(lengths):
            rows += [(a, min(a + TILE, pos + n), i, int(a == pos))
                     for a in range(pos, pos + n, TILE)]
            pos += n
        self.tiles = torch.tensor(rows, dtype=torch.int64).to(device)
        self.marks = AmaxSlots(len(lengths), device)
        fixed = {"tiles_ptr": self.tiles, "marks_ptr": self.marks.buffer, "TILE": TILE}
        self._flag = Launch(_nonfinite_kernel, (len(rows),), **fixed)
        self._commit = Launch(_commit_kernel, (len(rows),), **fixed)

    def __call__(self, pending: torch.Tensor, window: torch.Tensor, dropped: torch.Tensor,
                 finite: torch.Tensor) -> None:
        epoch = next(self.marks.epochs)
        self._flag(pending, epoch)
        self._commit(pending, window, dropped, finite, epoch)


if triton is not None:

    @triton.jit
    def _tile(tiles_ptr, TILE: tl.constexpr):
        row = tiles_ptr + 4 * tl.program_id(0)
        offs = tl.load(row) + tl.arange(0, TILE).to(tl.int64)
        return offs, offs < tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)

    @triton.jit
    def _nonfinite(p, mask):
        """Per element: masked in and not finite (NaN < ∞ is false), int64."""
        return (mask & ~(tl.abs(p) < float("inf"))).to(tl.int64)

    @triton.jit
    def _add_kept(p_ptr, w_ptr, offs, mask, keep):
        """``W += where(keep, P, 0)``, ``P = 0`` over ``offs``."""
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        tl.store(w_ptr + offs, w + tl.where(keep, p, 0.0), mask=mask)
        tl.store(p_ptr + offs, tl.zeros_like(p), mask=mask)

    @triton.jit
    def _commit_moment_kernel(p_ptr, w_ptr, dropped_ptr, finite_ptr, moments_ptr,
                              TILE: tl.constexpr):
        """Moment ``i`` (this program): ``bad_i`` over a first pass, then ``W += where(finite
        ∧ ¬bad_i, P, 0)``, ``P = 0`` and ``dropped[i] += finite ∧ bad_i``."""
        i = tl.program_id(0)
        start, end = tl.load(moments_ptr + 2 * i), tl.load(moments_ptr + 2 * i + 1)
        bad = tl.zeros((TILE,), tl.int64)
        for lo in range(start, end, TILE):
            offs = lo + tl.arange(0, TILE).to(tl.int64)
            mask = offs < end
            bad = tl.maximum(bad, _nonfinite(tl.load(p_ptr + offs, mask=mask, other=0.0), mask))
        bad_i = tl.max(bad, 0) != 0
        finite = tl.load(finite_ptr) != 0
        for lo in range(start, end, TILE):
            offs = lo + tl.arange(0, TILE).to(tl.int64)
            _add_kept(p_ptr, w_ptr, offs, offs < end, finite & ~bad_i)
        tl.store(dropped_ptr + i, tl.load(dropped_ptr + i) + (finite & bad_i).to(tl.int64))

    @triton.jit
    def _nonfinite_kernel(p_ptr, epoch, tiles_ptr, marks_ptr, TILE: tl.constexpr):
        """``mark[i] = max(mark[i], epoch + any(¬isfinite(tile)))``."""
        offs, mask, i, _ = _tile(tiles_ptr, TILE)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        tl.atomic_max(marks_ptr + i, epoch + tl.max(_nonfinite(p, mask), 0))

    @triton.jit
    def _commit_kernel(p_ptr, w_ptr, dropped_ptr, finite_ptr, epoch, tiles_ptr, marks_ptr,
                       TILE: tl.constexpr):
        """``W += where(finite ∧ ¬bad_i, P, 0)``, ``P = 0``; the moment's first tile:
        ``dropped[i] += finite ∧ bad_i``."""
        offs, mask, i, first = _tile(tiles_ptr, TILE)
        finite = tl.load(finite_ptr) != 0
        bad = tl.load(marks_ptr + i) != epoch
        _add_kept(p_ptr, w_ptr, offs, mask, finite & ~bad)
        count = (finite & bad).to(tl.int64)
        tl.store(dropped_ptr + i, tl.load(dropped_ptr + i) + count, mask=first != 0)
