"""One step of gradient synchronisation, for any layout: the engine behind every adapter.

DDP's comm hook (:mod:`geofp8.ddp`), FSDP2's reduce-scatter and HSDP's replica all-reduce
(:mod:`geofp8.fsdp`) are small adapters that hand the engine *units* of a step (a bucket, a
``fully_shard`` unit's reduction) and launch their collectives. The engine owns the rest:

* **begin** (the first unit of a step): the cross-rank consistency check (first step only,
  every rank fails with the differing fields named), the loss scale, refreshes and
  selection decisions (collectives on the data-parallel group, :meth:`start_unit`);
* **route, EF, encode** per unit: :attr:`pipeline` (``Ũ = G T + R``, new residuals written);
* **finite agreement**: every unit's result gives a device flag (:meth:`observe`, no host
  sync), and the step's verdict stays on the device (:mod:`geofp8.verdict`: one kernel
  where the fused decodes wrote the flags into the step's slots, :meth:`StepVerdict.slot`):
  nothing is read back in an ordinary step. Adapters whose collective does not already
  give every rank the same verdict (a reduce-scatter leaves each rank its own shard) set
  ``agree=True``: the flags are then all-reduced at settling;
* **settle** (every unit of a launched step done): hand the verdict to what the step
  produced: residuals (those of a skipped step read as zero, :mod:`geofp8.feedback`),
  statistics and selections (a skipped step's are chosen away by ``torch.where``), the
  ``on_skip`` callbacks (per unit flags, on the device); take the bytes every
  :class:`DeviceGroup` counted at the process-group door; advance the step clock (a skipped
  step counts on the clock too; the skipped steps are counted on the device and read by
  :meth:`stats`);
* **rollback** (an exception inside a unit): the residuals the step wrote are reset to zero,
  its statistics and selections dropped, and the step forgotten, so the next one starts
  clean;
* **FP32 warm-up** (:attr:`fp8` is false for the first ``warmup_steps`` steps), stochastic
  rounding seeds, :meth:`stats` (read-only) and a versioned :meth:`state_dict`.
"""

from __future__ import annotations

import functools
import operator
import threading

import torch
import torch.distributed as dist
from torch import nn

from .comm.group import DeviceGroup
from .comm.stages import all_finite
from .feedback import ErrorFeedback
from .ledger import Phase, StepLedger
from .pipeline import GradientPipeline
from .verdict import StepVerdict
from .verification import checksum, differences, refusal

__all__ = ["STATE_VERSION", "SyncEngine"]

STATE_VERSION = 5  # 4: rank, parameters, checksum; shared inputs agreed; 5: low-rank maps
#   up to their scale (U, a_fwd, a_inv), residuals in those coordinates
_TAKE_BYTES = operator.methodcaller("take_bytes")  # a DeviceGroup's bytes since the last call


class SyncEngine:
    """Gradient synchronisation of one model's data-parallel step (module notes).

    Args:
        model: the module whose gradients are communicated (its parameter names key
            residuals, factors and selections).
        config: a :class:`~geofp8.config.GeoFP8Config` (identical on every rank: checked).
        group: the data-parallel :class:`DeviceGroup` (factors, selections, agreement).
        kind: the adapter's name (``"ddp"``, ``"fsdp"``), part of the fingerprint and state.
        residual_storage: storage of the error-feedback residuals (:mod:`geofp8.feedback`).
        agree: all-reduce the finite flag at settling (module notes).
        grad_scaler: a ``torch.amp.GradScaler`` whose scale changes rescale the residuals.
        serial: units start and finish one at a time, on one thread (DDP's reducer runs its
            hook under a mutex, whose units complete on its thread): no lock; else (FSDP)
            :meth:`start_unit` and :meth:`finish_unit` hold the engine's lock.
    """

    def __init__(self, model: nn.Module, config, group: DeviceGroup, kind: str,
                 residual_storage: str = "fp32", agree: bool = False,
                 grad_scaler: torch.amp.GradScaler | None = None, serial: bool = False) -> None:
        self.config, self.group, self.kind, self.agree = config, group, kind, agree
        self._stochastic = config.rounding_seed(0) is not None  # (else every seed is None)
        self.ledger = StepLedger()
        self.pipeline = GradientPipeline(model, config, group, self.ledger, config.candidates,
                                         residual_storage=residual_storage)
        self.feedbacks: dict[str, ErrorFeedback] = {"sender": self.pipeline.feedback}
        self._more_feedbacks: list[ErrorFeedback] = []  # committed here (not the pipeline's)
        # per unit, the number of ranks whose flag is down (``bad``: this rank's, FP32)
        self._agree = (lambda bad: self.group.all_reduce(bad, "flag")[0]) if agree else None
        self.groups: list[DeviceGroup] = [group]
        self._links = [group.link]  # each group's, in order
        self.grad_scaler, self.grad_scale = grad_scaler, 1.0
        self._scaled = grad_scaler is not None  # (a begin then reads the scale)
        self.fingerprint_extra: dict = {}
        # callbacks(per observed unit a factor, FP32 [U] on the device: 1 finite, NaN not)
        self.on_skip: list = []
        self._parameters = [[n, list(p.shape), str(p.dtype), p.requires_grad]
                            for n, p in model.named_parameters()]
        self._checked = False
        self._begin = self._first_begin  # a step's begin (collectives), given its number
        self._lock = threading.RLock()
        self._outstanding = 0
        if not serial:  # units may start or finish on other threads: one at a time
            self.start_unit = _locked(self._lock, self.start_unit)
            self.finish_unit = _locked(self._lock, self.finish_unit)
        self.verdict = StepVerdict(self.ledger.skipped_counter)  # the observed units' flags
        self._hooks = [model.register_forward_pre_hook(self._on_forward),
                       model.register_forward_hook(self._on_forward_end), *self.pipeline.hooks]

    # -- set-up by the adapters --------------------------------------------------------------

    def device_group(self, group: dist.ProcessGroup | None, device,
                     link: str | None = None) -> DeviceGroup:
        """The :class:`DeviceGroup` of ``group``, whose bytes this engine counts (also per
        ``link``, when given)."""
        for known in self.groups:
            if known.group is group and known.device == torch.device(device):
                return known
        made = DeviceGroup(group, device, link)
        self.groups.append(made)
        self._links = [g.link for g in self.groups]
        return made

    def add_feedback(self, name: str, storage: str) -> ErrorFeedback:
        """A further set of residuals (e.g. HSDP's replica hop), committed with the step."""
        self.feedbacks[name] = ErrorFeedback(storage=storage)
        self._more_feedbacks = [f for n, f in self.feedbacks.items() if n != "sender"]
        return self.feedbacks[name]

    def remove_hooks(self) -> None:
        """Detach the statistics hooks from the model."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _on_forward(self, *_) -> None:
        self.pipeline.shared.new_forward()

    @torch._disable_dynamo  # torch.compiler.disable, importing dynamo at the first call
    def _on_forward_end(self, module: nn.Module, *_) -> None:
        """Every rank's training forward returns here, whichever layers it ran: the point
        where the statistics' collectives are launched (:meth:`GradientPipeline.forward_done`)."""
        if module.training and torch.is_grad_enabled():
            self.pipeline.forward_done()

    # -- the step ----------------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.ledger.step

    @property
    def fp8(self) -> bool:
        """Whether this step is communicated in low precision (the warm-up is FP32)."""
        return self.ledger.step >= self.config.warmup_steps

    def seed(self, *index: int) -> int | None:
        """Stochastic rounding's seed for this step and ``index`` (bucket, unit, hop);
        ``None`` when rounding to nearest."""
        return self.config.rounding_seed(self.ledger.step, *index) if self._stochastic else None

    def start_unit(self, last: bool = False) -> None:
        """A unit of the step starts; the first one begins the step (collectives) when its
        begin has anything to do: the loss scale to read, or a start of the pipeline due
        (:attr:`GradientPipeline.next_start`). The last one's decode, or its map back's
        kernel (:meth:`StepVerdict.to_map`), may decide the step (:meth:`StepVerdict.arm`):
        armed once the step has begun, unless the flags are agreed or wanted per unit."""
        self._outstanding += 1
        n = self.ledger.begin_unit(last)  # the unit's number in the step
        if n == 1 and (self.ledger.step >= self.pipeline.next_start or self._scaled):
            self._begin(self.ledger.step)
        if last and self._agree is None and not self.on_skip:
            self.verdict.arm(n)

    def _first_begin(self, step: int) -> None:
        """The first step's begin: the consistency check, then what begins a step, bound
        once as :attr:`_begin` (the loss scale read first when there is a scaler)."""
        if not self._checked:
            self.check_consistency()
        self._begin = self.pipeline.start_step if self.grad_scaler is None else \
            self._begin_scaled
        self._begin(step)

    def _begin_scaled(self, step: int) -> None:
        if self.grad_scaler.is_enabled():
            self.set_grad_scale(float(self.grad_scaler.get_scale()))
        self.pipeline.start_step(step)

    def observe(self, values: torch.Tensor, also: torch.Tensor | None = None,
                finite: torch.Tensor | None = None) -> None:
        """Record whether ``values`` (a unit's result) is finite, and ``also`` (a 0-dim bool
        the adapter knows, e.g. "every sender's input was finite"), as a device flag (no
        host sync); units are observed in the same order on every rank. ``finite``: the
        0-dim bool "every element of ``values`` is finite" when the adapter has it already
        (the fused decode's), instead of a pass over them."""
        finite = all_finite(values) if finite is None else finite
        with self._lock:
            self.verdict.observe(finite if also is None else finite & also)

    def finish_unit(self, values: torch.Tensor | None = None,
                    finite: torch.Tensor | None = None) -> None:
        """A unit's result is ready (``values``: observed first, as :meth:`observe`); the last
        one of a launched step settles it."""
        if values is not None:
            self.verdict.flags.append(all_finite(values) if finite is None else finite)
        self._outstanding -= 1
        if self._outstanding == 0 and self.ledger.phase is Phase.LAUNCHED:
            self._settle()

    def end_step(self) -> None:
        """No more units this step (FSDP: the end of backward); settle once all are done."""
        with self._lock:
            if self.ledger.begin_unit(last=True) == 1:  # nothing started: nothing to settle
                self.ledger.reset_phase()
                return
            if self._outstanding == 0:
                self._settle()

    def _settle(self) -> None:
        finite, factors, count = self.verdict.settle(self.group.device, self._agree, self.on_skip)
        self.pipeline.settle(finite)  # the sender's residuals too
        self.ledger.settle(finite, count, self._links, list(map(_TAKE_BYTES, self.groups)))
        if self._more_feedbacks or self.on_skip or self.pipeline.selection.charges:
            _settle_more(self, finite, factors)

    def rollback(self) -> None:
        """Forget the step in flight after an exception: the residuals it wrote are reset to
        zero, nothing else it produced is kept."""
        with self._lock:
            failed = torch.zeros((), dtype=torch.bool, device=self.group.device)
            self.pipeline.forget_records()  # it may have stopped between a bucket's tensors
            self.pipeline.settle(failed)
            for feedback in self.feedbacks.values():
                feedback.commit(failed)
            for group in self.groups:
                group.take_bytes()
            self.ledger.reset_phase()
            self._outstanding = 0
            self.verdict.rollback()

    def set_grad_scale(self, scale: float) -> None:
        """The loss scale of the coming backward: rescale the residuals if it changed."""
        if scale != self.grad_scale:
            for feedback in self.feedbacks.values():
                feedback.rescale(scale / self.grad_scale)
            self.grad_scale = float(scale)

    # -- consistency -------------------------------------------------------------------------

    def fingerprint(self) -> dict:
        """What every rank must agree on (JSON-serialisable): what it has, not what it ran."""
        mine = {k: v for k, v in _identity(self).items() if k not in ("version", "rank")}
        return {**mine, **self.pipeline.fingerprint(), **self.fingerprint_extra}

    def check_consistency(self) -> None:
        """Fail fast, on every rank, when ranks disagree on config or model structure
        (fingerprints travel as JSON text in uint8 tensors, outside the step's bytes)."""
        self._checked = True
        _refuse_disagreement(self.group.all_gather_json(self.fingerprint(), "consistency"))

    # -- reporting and checkpoints -----------------------------------------------------------

    def stats(self) -> dict:
        """Figures of the last settled step (reading changes nothing); see the adapters.
        ``geometry_layers``: the weights that went through a geometry map;
        ``geometry_since_step``: the first step that sent any that way (``None`` until then:
        a refreshed factor exists only from the first refresh on). ``step`` counts the steps
        settled as finite, ``skipped_steps`` the others (read from the device here: the one
        host read they cost); a layer's warning waiting on a device flag is given here too."""
        return _figures(self)

    def state_dict(self) -> dict:
        """Everything needed to continue bit-identically, tensors and plain containers only
        (``weights_only=True``), per rank; with who wrote it, for what, and a checksum."""
        return {**(state := self._state()), "checksum": checksum(state)}

    def _state(self) -> dict:
        return {**_identity(self), "step": self.ledger.step,
                "skipped_steps": self.ledger.skipped_steps, "grad_scale": self.grad_scale,
                **self.pipeline.state_dict(),
                "feedback": {n: f.state_dict() for n, f in self.feedbacks.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` whole or not at all: a state that
        :func:`~geofp8.verification.refusal` refuses is a ``ValueError`` naming the field,
        before anything changes; one that still does not fit is undone."""
        problem = refusal(state, _identity(self))
        if problem is not None:
            raise ValueError(f"GeoFP8 checkpoint refused, {problem}. Nothing was loaded.")
        before = self._state()
        try:
            self._load(state)
        except Exception as error:
            self._load(before)
            raise ValueError(f"GeoFP8 checkpoint refused: it does not fit this state "
                             f"({type(error).__name__}: {error}); nothing was loaded") from error

    def _load(self, state: dict) -> None:
        self.rollback()
        self.ledger.step = int(state["step"])
        self.ledger.skipped_steps = int(state["skipped_steps"])
        self.grad_scale = float(state["grad_scale"])
        self.pipeline.load_state_dict(state)
        transforms = self.pipeline.transforms()
        for name, feedback in self.feedbacks.items():
            feedback.load_state_dict(state["feedback"][name],
                                     transforms if name == "sender" else {})


def _settle_more(engine: SyncEngine, finite: torch.Tensor,
                 factors: torch.Tensor | None) -> None:
    """What only some engines have settled: further residuals, a selection charged the
    step's factor bytes, the ``on_skip`` callbacks (the units' factors)."""
    for feedback in engine._more_feedbacks:
        feedback.commit(finite)
    if engine.pipeline.selection.charges:
        engine.pipeline.selection.charged(engine.ledger.last["factor_bytes_sent"])
    for callback in engine.on_skip:
        callback(factors)


def _locked(lock: threading.RLock, method):
    """``method`` run under ``lock`` (an engine that is not ``serial``)."""
    @functools.wraps(method)
    def locked(*args, **kwargs):
        with lock:
            return method(*args, **kwargs)
    return locked


def _identity(engine: SyncEngine) -> dict:
    """What a state must match to be loaded into ``engine`` (see :func:`refusal`)."""
    return {"version": STATE_VERSION, "kind": engine.kind, "config": engine.config.to_dict(),
            "world_size": engine.group.size, "rank": engine.group.rank,
            "parameters": engine._parameters}


def _figures(engine: SyncEngine) -> dict:
    """:meth:`SyncEngine.stats` of ``engine``."""
    skipped = engine.ledger.skipped_steps
    engine.pipeline.report()
    last = engine.ledger.last
    return {
        "step": engine.ledger.step - skipped,
        "skipped_steps": skipped,
        **_byte_figures(last),
        "geometry_layers": engine.pipeline.geometry_layers(),
        "geometry_since_step": engine.pipeline.geometry_since,
        **engine.pipeline.budget_stats(),
        **{key: last[key] for key in ("codec_s", "transform_s", "statistics_s")},
        "ef_bytes": sum(f.nbytes for f in engine.feedbacks.values()),
        "factor_bytes": engine.pipeline.factor_nbytes,
        "nonfinite_factors": engine.pipeline.nonfinite_factors,
        **{f"bytes_{g.link}": int(last[f"bytes_{g.link}"]) for g in engine.groups if g.link},
    }


def _byte_figures(last: dict) -> dict:
    """A settled step's byte figures (``last``: its ledger figures): payload and factor
    bytes sent, their sum, its FP32 all-reduce's, and the bytes per gradient element."""
    sent = last["bytes_sent"] + last["factor_bytes_sent"]
    return {"bytes_sent": int(sent), "payload_bytes_sent": int(last["bytes_sent"]),
            "factor_bytes_sent": int(last["factor_bytes_sent"]),
            "bytes_fp32_equivalent": int(last["bytes_fp32_equivalent"]),
            "bytes_per_element": sent / last["elements"] if last["elements"] else 0.0}


def _refuse_disagreement(everyone: list[dict]) -> None:
    """A ``RuntimeError`` naming every field where a rank's fingerprint differs from rank
    0's (``everyone``: one per rank), if any does."""
    problems = [problem for r, other in enumerate(everyone)
                for problem in _differences(everyone[0], other, r)]
    if problems:
        raise RuntimeError("GeoFP8: ranks disagree:\n  " + "\n  ".join(problems))


def _differences(first: dict, other: dict, rank: int) -> list[str]:
    """What rank ``rank``'s fingerprint says differently from rank 0's."""
    problems = []
    for key in sorted(set(first) | set(other)):
        a, b = first.get(key), other.get(key)
        if a == b:
            continue
        if key == "config":
            detail = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
                      if a.get(k) != b.get(k)}
            problems.append(f"rank {rank} vs rank 0: config differs (rank 0, rank {rank}): "
                            f"{detail}")
        elif key == "parameters":
            problems.append(f"rank {rank} vs rank 0: model structure differs "
                            f"({differences('parameters', a, b)})")
        else:
            problems.append(f"rank {rank} vs rank 0: {key} differs: {a!r} vs {b!r}")
    return problems
