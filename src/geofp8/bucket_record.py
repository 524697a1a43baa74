"""A DDP bucket's per-tensor decisions, resolved once and kept while they hold.

An ordinary step sends a bucket the same way as the last one: every tensor
:meth:`~geofp8.bucket_path.BucketPath.steady`, the same route ``T_p`` (identity or its
layer's map), the same codec and layout, the bucket's residuals one flat vector
(:meth:`~geofp8.feedback.ErrorFeedback.bucket_in`). The first call of a bucket (and the
first after anything those decisions read has changed) resolves them tensor by tensor, as
always, into a :class:`BucketRecord`; later calls read it and run no Python per tensor.

Validity is by construction, not by a check of each tensor: the record carries the
*generation* it was resolved in, ``(decisions, residuals)``, and its bucket's own flat
residuals (:class:`~geofp8.feedback.FlatResiduals`). The pipeline moves the first part
whenever a step begins with other decisions than the last (selection, maps, a measuring
step), a checkpoint is loaded or a step is rolled back; the error feedback moves the second
for whole-state events (a loaded state, a rescale), and its bucket's flat residuals stop
being live when one of *its* residuals is made anew, re-based or dropped, or the vector is
let go: another bucket resolved again (its vector made, its residuals re-based) leaves this
record valid. A record whose generation is not the current one, or whose residuals are not
live, is resolved again: three O(1) checks a call.
"""

from __future__ import annotations

from dataclasses import dataclass

from .comm.bound import BoundStages
from .comm.layout import ShardLayout
from .feedback import FlatResiduals
from .geometry.transforms import Transform
from .selection import BudgetSelection

__all__ = ["BucketRecord", "RecordedDecisions"]


@dataclass(frozen=True)
class BucketRecord:
    """What :meth:`~geofp8.bucket_path.BucketPath.encode` resolved for one bucket on the
    flat path (``Ũ = G T + R`` over the bucket at once)."""

    generation: tuple[int, int]  # (the pipeline's decisions, the residuals' version)
    residuals: FlatResiduals  # the bucket's flat residuals (without error feedback: none,
    # feedback.NO_RESIDUALS, live for good)
    names: tuple[str, ...]  # the tensors, in the bucket's order (the residuals' key)
    shapes: tuple[tuple[int, ...], ...]
    routes: tuple[Transform, ...]
    per_sender: tuple[bool, ...]  # none on this path: every receiver maps back with T⁻¹
    slots: tuple  # (offset, numel, shape, T) of each tensor on a map (Encoded.slots)
    layout: ShardLayout
    side_bytes: int  # sender-factor bytes this rank sends the others (none on this path)
    # the layout's fused stages bound for the bucket's flat vector and residual, checked once
    # here (both kept while the record is: the same buffer, the same version), or None
    bound: BoundStages | None = None
    send: object | None = None  # its send bound for them (BoundStages.sender), with `bound`
    # its slots' maps bound for that vector (MapSlots.bind: one launch each way where
    # grouped), kept while the record is (new maps: a new generation, a new record); None
    # where nothing is mapped
    maps: object | None = None


class RecordedDecisions:
    """The generation of a pipeline's per-tensor decisions (mixed into
    :class:`~geofp8.pipeline.GradientPipeline`, whose selection, source, feedback and owner
    it reads)."""

    _decisions = 0  # moved by forget_records
    _decided = None  # what the decisions of the step begun last were made from
    _mapped = False  # whether a selected layer had a map then (note_decisions)

    def generation(self) -> tuple[int, int]:
        """The generation a bucket's record is valid in (module notes)."""
        return self._decisions, self.feedback.version

    def forget_records(self) -> None:
        """Every bucket resolves its decisions again at its next call (other decisions, a
        loaded checkpoint, a rolled-back step), and the next step's start is made in full
        (:meth:`~geofp8.pipeline.GradientPipeline.start_step`)."""
        self._decisions += 1
        self.next_start = 0

    def note_decisions(self) -> None:
        """A step begins (after its selection and refreshes): what the per-tensor decisions
        read (``steady``, ``route``, ``plain``: whether the step measures, the selected
        layers, the maps by layer) compared whole with the last step's, by set and dict
        equality (no Python per tensor; maps by identity); other decisions forget the
        records, and say whether a selected layer has a map (:attr:`_mapped`: the
        pipeline's ``geometry_layers`` not empty, looked up layer by layer once per change;
        a source that makes its maps every step may add one by the step's settling)."""
        decided = (self._observing, frozenset(self.selection.selected),
                   None if self.source is None else dict(self.source.transforms))
        if decided != self._decided:
            self._decided = decided
            self.forget_records()
            self._mapped = bool(self.geometry_layers())

    def recordable(self) -> bool:
        """Whether a bucket's decisions may be kept: not under a budget (whose codecs change
        with its decisions) nor with the owners' residuals (handed over as maps change)."""
        return self.owner is None and not isinstance(self.selection, BudgetSelection)
