"""Per-geometry receive templates: which bytes of which shard slot land where, for one tensor.

A template answers, for one Megatron tensor *geometry* (role, transform, global shape, dtype,
shard slots) and the planner's target layout: which byte ranges of each shard slot to read, where
they land relative to the tensor's arena region, how large that region is, which HF outputs it
holds (shape and offset), which staged blocks need one local copy, and which needed ranges no slot
covers. Thousands of tensors share a handful of geometries (every layer, every expert), so the
planner builds each template once and only instantiates it per tensor (choose a source per slot,
add addresses): that is what keeps planning a 19k-tensor MoE manifest within milliseconds.

Two shapes of template:

* rows (dim-0 split, or not split): bands of :mod:`mx_refit.layout.bands` restricted to the
  receiver windows and intersected with each slot; every piece is contiguous on the source and
  lands directly at its HF place, so the arena region *is* the HF tensors (views, no copy).
* columns (row-parallel, dim-1 split): a slot that is exactly the window is one read into place;
  whole slots that are part of a wider window are staged and placed with one strided copy; a
  column sub-block of a slot (target TP wider than source TP) goes through
  :func:`mx_refit.transport.ranges.plan_row_slice` (per-row descriptors vs the contiguous hull,
  by its cost model), landing in place when per-row reads can fill the window directly.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

from mx_refit.layout.bands import Band, Window, restrict, subtract
from mx_refit.transport.ranges import plan_row_slice

__all__ = ["Copy", "Out", "Template", "columns_template", "rows_template"]

OUT_ALIGN = 16  # outputs inside a region: dtype-aligned views, 16 B for vectorised kernels


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class Copy(NamedTuple):
    """A staged block of ``rows x width`` bytes (source rows ``row_stride`` bytes apart, starting
    at ``landing`` in the region) copied into output byte column ``dst_col``."""

    landing: int
    rows: int
    row_stride: int
    width: int
    dst_col: int


class Out(NamedTuple):
    """One HF output (or its receiver window) at ``rel`` in the tensor's arena region."""

    rel: int
    nbytes: int
    shape: tuple[int, ...]
    copies: tuple[Copy, ...]


class Template(NamedTuple):
    """Everything about one geometry except addresses and the chosen sources."""

    outs: tuple[Out, ...]
    pieces: tuple[tuple[int, int, int, int], ...]  # (slot, src byte offset in slot, nbytes, region offset)
    slot_bytes: tuple[int, ...]  # bytes read from each slot (0: slot not needed)
    region: int  # bytes of arena the tensor needs (outputs, then staging)
    pulled: int
    needed: int
    gaps: tuple[tuple[int, str], ...]  # (output index, uncovered range in HF coordinates)


def _coalesce(pieces: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Merge pieces of one slot that are contiguous on both sides (e.g. an expert's gate and up
    bands: one read instead of two)."""
    pieces.sort()
    merged: list[tuple[int, int, int, int]] = []
    for slot, src, n, dst in pieces:
        if merged:
            ps, psrc, pn, pdst = merged[-1]
            if ps == slot and psrc + pn == src and pdst + pn == dst:
                merged[-1] = (ps, psrc, pn + n, pdst)
                continue
        merged.append((slot, src, n, dst))
    return merged


def _finish(
    outs: list[Out], pieces: list[tuple[int, int, int, int]], nslots: int, region: int, gaps: list[tuple[int, str]]
) -> Template:
    pieces = _coalesce(pieces)
    slot_bytes = [0] * nslots
    for slot, _, n, _ in pieces:
        slot_bytes[slot] += n
    return Template(
        outs=tuple(outs),
        pieces=tuple(pieces),
        slot_bytes=tuple(slot_bytes),
        region=region,
        pulled=sum(slot_bytes),
        needed=sum(o.nbytes for o in outs),
        gaps=tuple(gaps),
    )


def rows_template(
    global_shape: Sequence[int],
    itemsize: int,
    slots: Sequence[tuple[int, int]],
    bands: Sequence[Band],
    windows: Sequence[Window],
) -> Template:
    """Template for a tensor whose shards are row ranges ``slots = [(first_row, rows), ...]``
    (sorted; a replicated tensor is one slot of every row) and whose rows map to the HF outputs
    through ``bands``; ``windows[j]`` is the row window of output ``j`` the receiver needs."""
    row_bytes = math.prod(global_shape[1:]) * itemsize
    rest = tuple(global_shape[1:])
    outs: list[Out] = []
    rel = 0
    for w in windows:
        nbytes = (w.hi - w.lo) * row_bytes
        outs.append(Out(rel, nbytes, (w.hi - w.lo, *rest), ()))
        rel = _align(rel + nbytes, OUT_ALIGN)
    pieces: list[tuple[int, int, int, int]] = []
    gaps: list[tuple[int, str]] = []

    def gap(b: Band, lo: int, hi: int) -> None:
        d = b.dst + lo - b.src
        gaps.append((b.out, f"rows [{d}, {d + hi - lo}) (Megatron rows [{lo}, {hi}))"))

    for b in restrict(bands, 0, global_shape[0], [(w.lo, w.hi) for w in windows]):
        cur, end = b.src, b.src + b.rows
        for slot, (lo, n) in enumerate(slots):
            hi = lo + n
            if hi <= cur:
                continue
            if lo >= end:
                break
            if lo > cur:
                gap(b, cur, lo)
                cur = lo
            top = min(end, hi)
            dst = outs[b.out].rel + (b.dst + cur - b.src - windows[b.out].lo) * row_bytes
            pieces.append((slot, (cur - lo) * row_bytes, (top - cur) * row_bytes, dst))
            cur = top
            if cur >= end:
                break
        if cur < end:
            gap(b, cur, end)
    return _finish(outs, pieces, len(slots), rel, gaps)


def columns_template(
    global_shape: Sequence[int],
    itemsize: int,
    slots: Sequence[tuple[int, int]],
    window: Window,
    row_slice_options: dict[str, Any] | None = None,
) -> Template:
    """Template for a 2-D row-parallel tensor whose shards are column ranges ``slots`` (each
    stored as a contiguous ``[rows, n]`` block) and whose receiver window is columns
    ``[window.lo, window.hi)`` of the single HF output."""
    if len(global_shape) != 2:
        raise ValueError(f"row-parallel tensors must be 2-D, got shape {tuple(global_shape)}")
    rows = global_shape[0]
    width = window.hi - window.lo
    out_row = width * itemsize
    out_bytes = rows * out_row
    region = _align(out_bytes, OUT_ALIGN)
    pieces: list[tuple[int, int, int, int]] = []
    copies: list[Copy] = []
    gaps: list[tuple[int, str]] = []
    options = row_slice_options or {}
    cursor = window.lo
    for slot, (lo, n) in enumerate(slots):
        a, b = max(lo, cursor), min(lo + n, window.hi)
        if a >= b:
            continue
        if a > cursor:
            gaps.append((0, f"columns [{cursor}, {a})"))
        cursor = b
        shard_row = n * itemsize
        piece_row = (b - a) * itemsize
        dst_col = (a - window.lo) * itemsize
        if a == lo and b == lo + n:
            if n == width:  # the slot is exactly the window: one read, in place
                pieces.append((slot, 0, rows * shard_row, 0))
                continue
            # A whole slot inside a wider window (target TP narrower): read it whole, one copy.
            pieces.append((slot, 0, rows * shard_row, region))
            copies.append(Copy(region, rows, shard_row, piece_row, dst_col))
            region = _align(region + rows * shard_row, OUT_ALIGN)
            continue
        # A column sub-block of every row (target TP wider): per-row descriptors or the hull.
        rs = plan_row_slice(0, rows, shard_row, (a - lo) * itemsize, (b - lo) * itemsize, **options)
        if rs.mode == "rows" and piece_row == out_row:
            landing = 0  # dense rows of exactly the window: they land in place
        else:
            landing = region
            stride = rs.row_bytes if rs.mode == "hull" else piece_row
            copies.append(Copy(landing, rows, stride, piece_row, dst_col))
            region = _align(region + rs.landing_bytes, OUT_ALIGN)
        pieces.extend((slot, r_off, nbytes, landing + l_off) for r_off, l_off, nbytes in rs.reads)
    if cursor < window.hi:
        gaps.append((0, f"columns [{cursor}, {window.hi})"))
    out = Out(0, out_bytes, (rows, width), tuple(copies))
    return _finish([out], pieces, len(slots), region, gaps)
