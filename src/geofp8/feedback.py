"""Error feedback in communication coordinates.

For a parameter routed through ``T`` (identity for Euclidean FP8): the sender encodes
``Ũ = G T + R`` and keeps ``R ← Ũ − deq(Q(Ũ))`` for the next step. The residual remembers the
coordinates it lives in; when a refresh or a selection change moves them, it is re-based
``R ← R T_old⁻¹ T_new`` so its Euclidean meaning is kept (DESIGN rule 3).

One set of residuals, written in place: a step's new residual of a tensor overwrites the
last one as soon as its gradient is encoded (:meth:`ErrorFeedback.stage`; a compact storage
replaces it tensor by tensor), so a step never holds two sets. Whether the step came back
finite on every rank is known only on the device when it settles: :meth:`ErrorFeedback.commit`
attaches that 0-dim flag to the residuals the step wrote, and a residual read later is
``torch.where(flag, R, 0)``: a non-finite (skipped) step *resets* the residuals it wrote to
zero, on the device, without reading the flag back (nothing else of them is kept). The
removal of a residual (:meth:`ErrorFeedback.drop`: an owner's residual handed over to the
sender's, see :meth:`geofp8.pipeline.GradientPipeline.prepare_into`) happens at once.

A bucket's residuals read as one flat vector (:meth:`ErrorFeedback.bucket_in`) are held as a
:class:`FlatResiduals`, which stays ``live`` while the residuals it holds are as they were when
it was made (none made anew, re-based or dropped, the vector not let go): a bucket's record
of its decisions (:mod:`geofp8.bucket_record`) is followed while its own vector is, whatever
the other buckets' vectors do; :attr:`ErrorFeedback.version` moves for whole-state events
alone (a loaded state, a rescale).

Storage (``storage``): ``"fp32"`` keeps ``R`` exactly (4 bytes per element); ``"bf16"``
rounds it to BF16 (2 bytes; relative error ``2⁻⁹``); ``"fp8"`` to E4M3 with one FP32 scale
per row (``amax/448``; 1 byte per element plus 4 per row; relative error ``2⁻⁴``);
``"nvfp4"`` to the NVFP4 wire format (E2M1 codes, an E4M3 scale per 16 elements, one FP32
scale: 0.5625 bytes per element; relative error about 0.1, which the next step's feedback
carries on). The default (:class:`~geofp8.config.GeoFP8Config` ``residual``) is BF16.
Arithmetic stays FP32: a compact residual is widened when read and rounded once when written.
"""

from __future__ import annotations

import torch

from .codecs.fp4 import NVFP4Codec
from .codecs.fp8 import FP8Codec, Packed
from .geometry.transforms import IDENTITY, Transform, rebase, transform_from_state

__all__ = ["ErrorFeedback", "FlatResiduals"]

STORAGES = ("fp32", "bf16", "fp8", "nvfp4")
ROW_FP8 = FP8Codec("e4m3", "row")  # the compact residual: the wire codec, one scale per row
NVFP4 = NVFP4Codec("nvfp4")  # the 4-bit residual: the wire format, one segment per tensor


def pack(residual: torch.Tensor, storage: str):
    """``residual`` (FP32) in ``storage``: a tensor, or for ``"fp8"`` ``{"codes", "scale"}``
    (E4M3 codes shaped like ``residual`` and :data:`ROW_FP8`'s per-row scales), for
    ``"nvfp4"`` ``{"payload", "shape"}`` (the NVFP4 bytes and the shape as a list)."""
    if storage == "fp32":
        return residual
    if storage == "bf16":
        return residual.to(torch.bfloat16)
    if storage == "nvfp4":
        shape = list(residual.shape)
        segments = [NVFP4.groups(tuple(shape))]
        payload = torch.empty(NVFP4.payload_bytes(segments), dtype=torch.uint8,
                              device=residual.device)
        NVFP4.encode_into(payload, residual.reshape(-1), segments)
        return {"payload": payload, "shape": shape}
    packed = ROW_FP8.quantize(residual)
    return {"codes": packed.codes.view(residual.shape), "scale": packed.scales}


def unpack(stored) -> torch.Tensor:
    """FP32 view of a :func:`pack` ed residual."""
    if isinstance(stored, dict) and "payload" in stored:
        shape = tuple(stored["shape"])
        out = torch.empty(shape, dtype=torch.float32, device=stored["payload"].device)
        NVFP4.decode_into(out.view(-1), stored["payload"], [NVFP4.groups(shape)])
        return out
    if isinstance(stored, dict):
        codes = stored["codes"]
        shape = tuple(codes.shape)
        return Packed(codes.reshape(-1), stored["scale"], shape, ROW_FP8,
                      tuple(ROW_FP8.groups(shape))).dequantize()
    return stored if stored.dtype == torch.float32 else stored.float()


def _shape(stored) -> tuple[int, ...]:
    """The residual's shape (of a tensor or a :func:`pack` ed dict)."""
    if isinstance(stored, dict):
        return tuple(stored["shape"]) if "shape" in stored else tuple(stored["codes"].shape)
    return tuple(stored.shape)


def _nbytes(stored) -> int:
    parts = stored.values() if isinstance(stored, dict) else (stored,)
    return sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))


class FlatResiduals:
    """A bucket's residuals ``names`` as one flat ``vector`` (each a view of it, in that
    order), ``live`` until one of them is made anew, re-based or dropped, or the vector is let
    go (then ``vector`` is ``None``); never live again (a vector checked again is held anew)."""

    __slots__ = ("live", "names", "vector")

    def __init__(self, names: tuple[str, ...], vector: torch.Tensor) -> None:
        self.names, self.vector, self.live = names, vector, True


# the flat residuals of a bucket sent without error feedback: none, and live for good
NO_RESIDUALS = FlatResiduals((), None)


class ErrorFeedback:
    """Per-parameter residuals ``R`` (the gradient's shape, stored as ``storage``), their
    coordinates and the finite flags of the steps that wrote them (module notes)."""

    def __init__(self, storage: str = "fp32") -> None:
        if storage not in STORAGES:
            raise ValueError(f"residual storage must be one of {STORAGES}, got {storage!r}")
        self.storage = storage
        self.residuals: dict = {}
        self.basis: dict[str, Transform] = {}
        self.finite: dict[str, torch.Tensor] = {}  # 0-dim bool: the writing step's verdict
        self._written: list[str] = []  # this step's, until it settles
        self._blocks: dict[tuple[str, ...], FlatResiduals] = {}  # a bucket's residuals, flat
        self._block_of: dict[str, FlatResiduals] = {}  # the flat vector holding a residual
        # moves when the whole state may change (loaded, rescaled): a bucket's record is valid
        # while this stays and its own FlatResiduals is live (see recorded)
        self.version = 0

    def residual_in(self, name: str, route: Transform) -> torch.Tensor | None:
        """The residual of ``name`` in ``route``'s coordinates (``None``: none yet; zero if
        the step that wrote it was not finite)."""
        stored = self.residuals.get(name)
        if stored is None:
            return None
        residual = unpack(stored)
        basis = self.basis.get(name, IDENTITY)
        residual = residual if basis is route else rebase(residual, basis, route)
        flag = self.finite.get(name)
        if flag is None:
            return residual
        if residual is stored:
            return torch.where(flag, residual, 0.0)
        # a widened or re-based residual is a temporary of its own: zeroed in it
        return torch.where(flag, residual, residual.new_zeros(()), out=residual)

    def bucket_in(self, names: list[str], shapes: list[tuple[int, ...]],
                  routes: list[Transform] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(R, flag)`` of a bucket's tensors ``names`` (of ``shapes``) read as one: their
        residuals as one flat vector in that order, each a view of it (made once, by one copy;
        held as a live :class:`FlatResiduals`, :meth:`held`), and the finite flag of the step
        that wrote them all (``None``: kept; a residual is read as ``torch.where(flag, R, 0)``,
        as by :meth:`residual_in`). ``None`` unless every
        one is stored plain (FP32 or BF16) in its route's coordinates (``routes``; default
        identity: none to re-base), by the same step."""
        stored = [self.residuals.get(n) for n in names]
        routes = routes or [IDENTITY] * len(names)
        if self.storage not in ("fp32", "bf16") or not names or any(
                s is None or tuple(s.shape) != shape or self.basis.get(n, IDENTITY) is not route
                for n, s, shape, route in zip(names, stored, shapes, routes)):
            return None
        flag = self.finite.get(names[0])
        if any(self.finite.get(n) is not flag for n in names):
            return None
        key = tuple(names)
        held = self._blocks.get(key)
        if held is None or not _tiles(held.vector, stored):
            self._forget(names)
            block = torch.cat([s.reshape(-1) for s in stored])
            pos = 0
            for name, s in zip(names, stored):
                self.residuals[name] = block[pos : pos + s.numel()].view(s.shape)
                pos += s.numel()
            held = self._hold(key, block)
        elif not held.live:  # the same vector, its residuals checked again just now
            held = self._hold(key, held.vector)
        return held.vector, flag

    def held(self, names: list[str]) -> FlatResiduals:
        """The :class:`FlatResiduals` of a bucket :meth:`bucket_in` or :meth:`stage_bucket`
        has just read or written (live)."""
        return self._blocks[tuple(names)]

    def recorded(self, held: FlatResiduals) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`bucket_in` of a bucket it accepted, while its ``held`` vector is live and
        :attr:`version` has not moved since: the vector and the flag of the step that wrote it
        (every tensor of a bucket is written, and its flag set, with the others: the first
        one's stands for all), without looking at each tensor again."""
        return held.vector, self.finite.get(held.names[0])

    def _hold(self, key: tuple[str, ...], block: torch.Tensor) -> FlatResiduals:
        """``block`` held as the live flat vector of the residuals ``key``."""
        held = self._blocks[key] = FlatResiduals(key, block)
        self._block_of.update(dict.fromkeys(key, held))
        return held

    def first_bucket(self, names: list[str]) -> bool:
        """Whether a bucket's tensors ``names`` have no residual yet and are stored plain:
        :meth:`stage_bucket` then makes their flat vector from the first residual itself."""
        return self.storage in ("fp32", "bf16") and bool(names) and all(
            n not in self.residuals for n in names)

    def stage_bucket(self, names: list[str], residual: torch.Tensor,
                     shapes: list[tuple[int, ...]] | None = None,
                     routes: list[Transform] | None = None) -> None:
        """:meth:`stage` of every tensor of a bucket (in ``routes``' coordinates; default
        identity) at once: its flat
        vector ← ``residual`` (FP32, that order), one copy, none when ``residual`` is that
        vector (written in place by the encode). The vector is :meth:`bucket_in`'s, or, at a
        :meth:`first_bucket` (``shapes`` given), made here from ``residual``, each tensor's
        residual a view of it (no second set is ever held to join them later)."""
        key = tuple(names)
        if key in self._blocks:
            if residual is not self._blocks[key].vector:
                self._blocks[key].vector.copy_(residual)
        else:  # a first bucket (a vector that held one of these is let go: none should)
            self._forget(names)
            block = residual.to(torch.float32 if self.storage == "fp32" else torch.bfloat16,
                                copy=True)
            pos = 0
            for name, shape in zip(names, shapes):
                n = torch.Size(shape).numel()
                self.residuals[name] = block[pos : pos + n].view(shape)
                pos += n
            self._hold(key, block)
        # _wrote of every tensor, by whole-dict operations (no Python per tensor); the routes
        # of a kept vector are its residuals' bases already (bucket_in checked them), a new
        # one has no record yet
        self.basis.update(zip(names, routes or [IDENTITY] * len(names)))
        self.finite.update(dict.fromkeys(names))  # None: kept as written, until committed
        self._written.extend(names)

    def restage(self, names: tuple[str, ...]) -> None:
        """:meth:`stage_bucket` of a :meth:`recorded` bucket whose vector the encode wrote in
        place (its vector live since: no copy, and the residuals' bases are its routes
        already): its tensors marked written this step."""
        self.finite.update(dict.fromkeys(names))  # None: kept as written, until committed
        self._written.extend(names)

    def _forget(self, names) -> None:
        """Let go of the flat vectors that hold any of ``names`` (re-bucketed or dropped): no
        longer live, nor held (the others stay as they are)."""
        gone = {self._block_of.pop(n) for n in names if n in self._block_of}
        for held in gone:
            held.live, held.vector = False, None
            del self._blocks[held.names]
            for n in held.names:
                if self._block_of.get(n) is held:
                    del self._block_of[n]

    def _stale(self, name: str) -> None:
        """The residual of ``name`` is made anew or re-based: the flat vector holding it (if
        any) no longer live (kept: :meth:`bucket_in` checks it again)."""
        held = self._block_of.get(name)
        if held is not None:
            held.live = False

    def stage(self, name: str, residual: torch.Tensor, route: Transform) -> None:
        """Write this step's new residual of ``name`` (in ``route``'s coordinates) over the
        last one, in place (FP32 and BF16 are copied from ``residual``, which may be a view
        of a bucket's buffer; a packed storage is packed, then copied). Call :meth:`commit`
        when the step settles."""
        stored = self.residuals.get(name)
        plain = self.storage in ("fp32", "bf16")
        packed = None if plain else pack(residual, self.storage)
        if stored is None or _shape(stored) != tuple(residual.shape):
            self.residuals[name] = packed if packed is not None else residual.to(
                torch.float32 if self.storage == "fp32" else torch.bfloat16, copy=True)
            self._stale(name)
        elif packed is None:
            stored.copy_(residual)  # rounds to BF16 on the way
        else:
            for key, t in packed.items():
                if isinstance(t, torch.Tensor):
                    stored[key].copy_(t)
        self._wrote(name, route)

    def stage_rows(self, name: str, shape: tuple[int, ...], pieces, route: Transform) -> None:
        """:meth:`stage` from pieces of the residual's dim-0 rows, ``[(view, lo, hi)]`` (a
        view of rows ``lo:hi``, e.g. FSDP's chunks of a unit's flat buffer; at least one):
        copied straight into a plain residual of that shape (no whole copy assembled), else
        assembled and staged."""
        stored = self.residuals.get(name)
        if self.storage in ("fp32", "bf16") and stored is not None and \
                tuple(stored.shape) == tuple(shape):
            _copy_rows(stored, pieces)
            self._wrote(name, route)
            return
        whole = torch.empty(shape, dtype=torch.float32, device=pieces[0][0].device)
        _copy_rows(whole, pieces)
        self.stage(name, whole, route)

    def _wrote(self, name: str, route: Transform) -> None:
        if _moved(self.basis.get(name), route):
            self._stale(name)
        self.basis[name] = route
        self.finite.pop(name, None)
        self._written.append(name)

    def drop(self, name: str) -> None:
        """Remove the residual of ``name`` (at once)."""
        for held in (self.residuals, self.basis, self.finite):
            held.pop(name, None)
        self._forget([name])

    def commit(self, finite: torch.Tensor) -> None:
        """The step settled: ``finite`` (0-dim bool, on the device) holds the residuals it
        wrote, or resets them to zero (read as zero until written again)."""
        written, self._written = self._written, []
        # whole-dict: no Python per tensor
        self.finite.update(dict.fromkeys(filter(self.residuals.__contains__, written), finite))

    def rescale(self, factor: float) -> None:
        """Multiply every residual by ``factor`` (a loss scale changed by that ratio)."""
        for name, stored in self.residuals.items():
            if self.storage == "fp32":
                stored.mul_(factor)
            else:
                self.residuals[name] = pack(unpack(stored) * factor, self.storage)
        self.version += 1

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(r) for r in self.residuals.values())

    def state_dict(self) -> dict:
        """Residuals (those of a skipped step as zeros) and their coordinates as tensors and
        plain containers."""
        return {"residuals": {n: _zeroed(r, self.finite.get(n))
                              for n, r in self.residuals.items()},
                "basis": {n: {"kind": t.name, "state": t.state()}
                          for n, t in self.basis.items()}}

    def load_state_dict(self, state: dict, transforms: dict[str, Transform]) -> None:
        """Restore; a basis equal to a live transform of ``transforms`` becomes that object
        again, so the residual is not re-based needlessly."""
        self.residuals = {n: _zeroed(r, None) for n, r in state["residuals"].items()}
        self.basis, self.finite, self._written, self._blocks = {}, {}, [], {}
        self._block_of = {}
        self.version += 1
        for name, saved in state["basis"].items():
            live = transforms.get(name)
            if live is not None and _same(live, saved):
                self.basis[name] = live
            elif saved["kind"] == IDENTITY.name:
                self.basis[name] = IDENTITY
            else:
                self.basis[name] = transform_from_state(saved["kind"], saved["state"])


def _moved(basis: Transform | None, route: Transform) -> bool:
    """Whether a residual kept in ``basis`` (``None``: none kept) is now written in another
    ``route``'s coordinates (identity and no basis are the same coordinates)."""
    return (IDENTITY if basis is None else basis) is not route


def _copy_rows(target: torch.Tensor, pieces) -> None:
    """``target``'s dim-0 rows ``lo:hi`` ← ``view`` for each piece (any dtype: rounded)."""
    rows = target.flatten(1) if target.dim() > 1 else target.unsqueeze(1)
    for view, lo, hi in pieces:
        rows[lo:hi].view(view.shape).copy_(view)


def _tiles(block: torch.Tensor, stored: list) -> bool:
    """Whether the tensors ``stored`` are still ``block``'s views, one after the other."""
    at, size = block.data_ptr(), block.element_size()
    for s in stored:
        if not isinstance(s, torch.Tensor) or s.dtype != block.dtype or \
                not s.is_contiguous() or s.data_ptr() != at:
            return False
        at += s.numel() * size
    return at == block.data_ptr() + block.numel() * size


def _zeroed(stored, finite: torch.Tensor | None):
    """A copy of ``stored``, every tensor zero unless ``finite`` (``None``: kept). An all-zero
    packed residual reads as zero (zero codes, zero scales)."""
    def copy(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if finite is None else torch.where(finite, t, torch.zeros_like(t))
    if isinstance(stored, dict):
        return {k: copy(v) if isinstance(v, torch.Tensor) else list(v)
                for k, v in stored.items()}
    return copy(stored)


def _same(t: Transform, saved: dict) -> bool:
    mine = t.state()
    return t.name == saved["kind"] and mine.keys() == saved["state"].keys() and all(
        torch.equal(mine[k].cpu(), saved["state"][k].cpu()) for k in mine)
