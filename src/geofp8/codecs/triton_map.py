"""Every low-rank map of a bucket in one Triton launch each way, beside its torch reference.

A layer on a low-rank map sends ``G + (G V) Uᵀ`` (``V = U diag(a)``, ``G`` its
``rows × d_in`` slot of the flat bucket) and maps the mean back the same way with the
inverse's ``V`` (:class:`~geofp8.geometry.transforms.LowRankInput`): ``mm`` + ``addmm``,
two launches per layer each way in torch (:func:`reference`). :class:`GroupedMaps` applies
every layer of a bucket in **one** launch each way: a program per (layer, block of
``BLOCK_M`` rows) computes ``P = G_rows V`` (a loop over ``d_in``, ``tl.dot`` in IEEE FP32,
the rank padded to a power of two ≥ 16, the padding's ``V`` and ``Uᵀ`` read as 0), then writes
``G_rows + P Uᵀ`` over its rows in place (every row read whole by the first loop before the
second writes it; rows are a program's own).

The maps are packed once per set of maps (a bucket's record, at a refresh): ``U``, ``V_fwd``
and ``V_inv`` of every map in one FP32 device buffer (a map over several slots, as an FSDP
unit's over each rank's chunk of a parameter, packed once), and a program table, int64
``[P, 7]``: ``(first element of the rows, rows, d_in, rank, U's, V_fwd's, V_inv's offset)``,
so a call passes its tensors and flags (no per-call host work). The table depends on the
slots' geometry alone: maps made every step (``fresh``) repack their values, one ``cat``,
under the table of the last packing. Layers of rank 0 (the
identity) get no program: ``G + 0`` is ``G``. FP32 only; a bucket whose maps are not all
FP32 low-rank maps on the kernels' device stays on the torch path (decided once, by
:func:`places`).

The map back checks what it writes: given a 0-dim uint8 ``finite`` (a bucket's slot of the
step's verdict, holding the collective's flag "every element of the sum finite"), the
kernel's last program to finish ANDs it with "every value written finite" (exponent bits not
all ones): each program adds ``1 + 2³² · [it wrote a non-finite value]`` to an int64 *ticket*
(one atomic; the one that finds ``P − 1`` programs counted before it is the last, and reads
the others' verdicts in the high word), and the last writes the flag and zeroes the ticket
for the next call. With the elements outside the maps (the sum's, unchanged) that is "every
element of the mean finite", the torch path's check of the whole mean after ``mm`` +
``addmm`` (:func:`geofp8.comm.stages.all_finite`) without its pass over the bucket. Its
``VERDICT`` variant then decides the step from the earlier units' flags, as a fused decode
does (:func:`~geofp8.codecs.triton_fp8.decode_launches`, :mod:`geofp8.verdict`): a mapped
last bucket's map back, not its decode, writes the step's verdict.

:meth:`GroupedMaps.bind` binds the launches to one bucket's vector (a bucket record's,
:class:`BoundMaps`): each way one launch with nothing left to pass but the flag.

Agreement with the reference: the same products summed in another order (blocks of
``BLOCK_K`` here, the BLAS's order there), so each element differs by at most FP32
summation round-off, ``|Δ| ≤ 2 (d_in + rank) ε (|G| |V| |Uᵀ| + |G|)`` elementwise
(``ε = 2⁻²³``); a non-finite row stays non-finite (the step is skipped), as in torch.
"""

from __future__ import annotations

import torch

from .triton_fp8 import Launch, attempt, available, decode_launches, failed, triton

if triton is not None:
    import triton.language as tl

    from .triton_fp8 import _settle

__all__ = ["BLOCK_M", "BoundMaps", "GroupedMaps", "places", "reference", "round_off_bound"]

# rows per program: each program reads V and U whole (2 d_in k floats, from L2) beside its
# rows' 3 BLOCK_M d_in (G read twice, written once), 1/3 more at k = 32 with 64 rows, 4/3
# with 16; a guess to time on a GPU (not measured)
BLOCK_M = 64
BLOCK_K = 32  # columns of d_in per step of a program's loops


def reference(flat: torch.Tensor, maps: list[tuple[int, int, int, torch.Tensor, torch.Tensor,
                                                   torch.Tensor]], inverse: bool) -> None:
    """The torch path: ``G ← G + (G V) Uᵀ`` over each ``(offset, rows, d_in, U, V_fwd,
    V_inv)`` slot of ``flat``, ``mm`` + ``addmm`` per layer (the bits of
    :meth:`LowRankInput.forward_over` / ``inverse_over``)."""
    for pos, rows, d, U, V_fwd, V_inv in maps:
        G = flat[pos : pos + rows * d].view(rows, d)
        torch.addmm(G, G @ (V_inv if inverse else V_fwd), U.T, out=G)


def round_off_bound(G: torch.Tensor, V: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on the kernel's difference from :func:`reference` over rows ``G``:
    ``2 (d_in + rank) ε (|G| |V| |Uᵀ| + |G|)``, ``ε = 2⁻²³`` (the same products summed in
    another order; module notes)."""
    eps = 2.0 ** -23
    return 2 * (G.shape[1] + V.shape[1]) * eps * ((G.abs() @ V.abs()) @ U.abs().T + G.abs())


def places(flat: torch.Tensor, Us: list[torch.Tensor]) -> bool:
    """Whether :class:`GroupedMaps` applies maps with these ``U`` over ``flat``: FP32 on a
    device the Triton kernels run on (CUDA, or the CPU under the interpreter)."""
    return (flat.dtype == torch.float32 and all(U.dtype == torch.float32 for U in Us)
            and available(flat, *Us))


class GroupedMaps:
    """A bucket's low-rank maps packed for one launch each way (module notes)."""

    __slots__ = ("geometry", "launches", "maps", "packed", "table", "ticket")

    def __init__(self, maps: list[tuple[int, int, int, torch.Tensor, torch.Tensor,
                                        torch.Tensor]], device: torch.device,
                 like: GroupedMaps | None = None) -> None:
        """``maps``: ``(offset, rows, d_in, U, V_fwd, V_inv)`` of each slot over the flat
        bucket (``U``, ``V`` ``d_in × rank``; slots with the same ``U`` object share one
        packing of their map). ``like``: the last packing of the same slots; where its
        geometry (offsets, shapes, ranks, where each map is packed) is this one's, its
        program table (and ticket) is taken as it is (maps made every step are packed with
        one ``cat``, no table)."""
        self.maps = maps
        parts, at, end = [], {}, 0  # id(U) -> where its map is packed (once, whatever its
        for *_, U, V_fwd, V_inv in maps:  # slots)
            if U.shape[1] and id(U) not in at:
                at[id(U)], end = end, end + 3 * U.numel()
                parts += [x.reshape(-1) for x in (U, V_fwd, V_inv)]
        self.geometry = tuple((pos, rows, d, U.shape[1], at.get(id(U)))
                              for pos, rows, d, U, _, _ in maps)
        self.packed = torch.cat(parts) if parts else None
        if like is not None and like.geometry == self.geometry:
            self.table, self.ticket, self.launches = like.table, like.ticket, like.launches
            return
        programs, most = [], 1
        for pos, rows, d, k, u in self.geometry:
            if k == 0:  # the identity: no program
                continue
            most = max(most, k)
            programs += [(pos + r0 * d, min(BLOCK_M, rows - r0), d, k, u, u + d * k,
                          u + 2 * d * k) for r0 in range(0, rows, BLOCK_M)]
        self.table = torch.tensor(programs, dtype=torch.int64, device=device) \
            if programs else None
        self.ticket = torch.zeros(1, dtype=torch.int64, device=device) if programs else None
        rank = max(16, 1 << (most - 1).bit_length())  # the next power of two
        # (plain, deciding): the step's decision's pointers bound to the ticket in the first
        self.launches = decode_launches(Launch(
            _map_kernel, (len(programs),), table_ptr=self.table, ticket_ptr=self.ticket,
            RANK=rank, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K), self.ticket) if programs else None

    def __call__(self, flat: torch.Tensor, inverse: bool,
                 finite: torch.Tensor | None = None) -> bool:
        """``G ← G + (G V) Uᵀ`` over every layer's slot of ``flat`` (``V`` the inverse's
        when ``inverse``), one launch (none when every map has rank 0). ``finite``: a 0-dim
        uint8 flag the kernel clears where a value it writes is not finite (left as it is
        where all are: ANDed with what it holds; rank 0 writes nothing). Returns whether
        it did (``False``: the torch path ran, which checks nothing)."""
        if self.launches is None:
            return True
        return attempt(lambda: self._fused(flat, inverse, finite),
                       lambda: self._reference(flat, inverse))

    def _fused(self, flat: torch.Tensor, inverse: bool, finite: torch.Tensor | None) -> bool:
        self.launches[0](flat_ptr=flat, maps_ptr=self.packed, INVERSE=int(inverse),
                         flag_ptr=flat if finite is None else finite, FLAG=finite is not None)
        return True

    def _reference(self, flat: torch.Tensor, inverse: bool) -> bool:
        reference(flat, self.maps, inverse)
        return False

    def bind(self, flat: torch.Tensor) -> BoundMaps | None:
        """These maps bound to ``flat`` (:class:`BoundMaps`; ``None``: every map has rank
        0, nothing to launch)."""
        return BoundMaps(self, flat) if self.launches is not None else None


class BoundMaps:
    """:class:`GroupedMaps` bound to one FP32 vector (a bucket record's, made again with it
    when the maps change): :meth:`forward` one launch, :meth:`back` one launch given its
    flag; the torch path where a kernel raises (:func:`~.triton_fp8.failed`)."""

    __slots__ = ("_forward", "flat", "grouped", "inverse")

    def __init__(self, grouped: GroupedMaps, flat: torch.Tensor) -> None:
        self.grouped, self.flat = grouped, flat
        plain = grouped.launches[0]
        self._forward = plain.bind(flat_ptr=flat, maps_ptr=grouped.packed, flag_ptr=flat,
                                   INVERSE=0, FLAG=False)
        # (plain, deciding), given the flag: see geofp8.verdict.decode_into
        self.inverse = tuple(launch.bind(flat_ptr=flat, maps_ptr=grouped.packed, INVERSE=1,
                                         FLAG=True) for launch in grouped.launches)

    def forward(self) -> None:
        """``G ← G + (G V_fwd) Uᵀ`` over every layer's slot of the vector."""
        try:
            self._forward()
        except Exception as exc:  # noqa: BLE001 - any compile or launch error
            self._torch_path(exc, False)

    def back(self, flag: torch.Tensor, launch_into) -> bool:
        """``G ← G + (G V_inv) Uᵀ``, ANDing the 0-dim uint8 ``flag`` with "every value
        written finite" (:meth:`GroupedMaps.__call__`'s ``finite``), launched by
        ``launch_into(self.inverse, flag)`` (the plain or the deciding launch,
        :func:`geofp8.verdict.map_into`). Returns whether the flag was (``False``: the torch
        path ran, which checks nothing)."""
        try:
            launch_into(self.inverse, flag)
        except Exception as exc:  # noqa: BLE001 - any compile or launch error
            return self._torch_path(exc, True)
        return True

    def _torch_path(self, exc: Exception, inverse: bool) -> bool:
        failed(exc)  # (re-raised under the interpreter)
        return self.grouped._reference(self.flat, inverse)


if triton is not None:
    @triton.jit
    def _map_kernel(flat_ptr, maps_ptr, flag_ptr, table_ptr, ticket_ptr, flags_ptr, n,
                    verdict_ptr, skipped_ptr, INVERSE: tl.constexpr, FLAG: tl.constexpr,
                    VERDICT: tl.constexpr, RANK: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        entry = table_ptr + tl.program_id(0) * 7
        start = tl.load(entry)
        rows = tl.load(entry + 1)
        d = tl.load(entry + 2)
        rank = tl.load(entry + 3)
        u0 = tl.load(entry + 4)
        v0 = tl.load(entry + 5 + INVERSE)
        m = tl.arange(0, BLOCK_M)
        r = tl.arange(0, RANK)
        kk = tl.arange(0, BLOCK_K)
        m_ok = m < rows
        r_ok = r < rank
        # the rank's padding reads V and Uᵀ as 0: a finite row's padded P is 0, and a
        # non-finite row stays non-finite as in torch (its real P is NaN or Inf already)
        P = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
        for k0 in range(0, d, BLOCK_K):  # P = G_rows V
            k = k0 + kk
            k_ok = k < d
            g = tl.load(flat_ptr + start + m[:, None] * d + k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            v = tl.load(maps_ptr + v0 + k[:, None] * rank + r[None, :],
                        mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            P = tl.dot(g, v, P, input_precision="ieee")
        bad = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32)  # non-finite values written
        for k0 in range(0, d, BLOCK_K):  # G_rows + P Uᵀ, over G_rows
            k = k0 + kk
            k_ok = k < d
            at = flat_ptr + start + m[:, None] * d + k[None, :]
            g = tl.load(at, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            ut = tl.load(maps_ptr + u0 + k[None, :] * rank + r[:, None],
                         mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            out = g + tl.dot(P, ut, input_precision="ieee")
            tl.store(at, out, mask=m_ok[:, None] & k_ok[None, :])
            if FLAG:  # exponent all ones: ±inf or NaN, over the values written
                bits = out.to(tl.uint32, bitcast=True)
                nonfinite = ((bits & 0x7F800000) == 0x7F800000) & m_ok[:, None] & k_ok[None, :]
                bad = tl.maximum(bad, nonfinite.to(tl.int32))
        if FLAG:  # the ticket (module notes): the last program ANDs the flag, may decide
            _settle(flat_ptr, table_ptr, ticket_ptr, flag_ptr, tl.max(tl.max(bad, 1), 0),
                    flags_ptr, n, verdict_ptr, skipped_ptr, False, VERDICT, BLOCK_M, True)
