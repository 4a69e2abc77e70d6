"""Per-geometry receive templates: which bytes of which shard slot land where, for one tensor.

A template answers, for one Megatron tensor *geometry* (role, transform, global shape, dtype,
shard slots) and the planner's target layout: which byte ranges of each shard slot to read, where
they land relative to the tensor's arena region, how large that region is, which HF outputs it
holds (shape and offset), which staged blocks need one local copy, and which needed ranges no slot
covers. Thousands of tensors share a handful of geometries (every layer, every expert), so the
planner builds each template once and only instantiates it per tensor (choose a source per slot,
add addresses): that is what keeps planning a 19k-tensor MoE manifest within milliseconds.

:func:`build_template` derives the HF outputs, the receiver windows (vLLM's TP/EP sharding) and
the bands of one geometry, then builds one of two shapes of template:

* rows (dim-0 split, or not split): bands of :mod:`mx_refit.layout.bands` restricted to the
  receiver windows and intersected with each slot; every piece is contiguous on the source and
  lands directly at its HF place, so the arena region *is* the HF tensors (views, no copy).
* columns (row-parallel, dim-1 split): a slot that is exactly the window is one read into place;
  whole slots that are part of a wider window are staged and placed with one strided copy; a
  column sub-block of a slot (target TP wider than source TP) goes through
  :func:`mx_refit.ranges.plan_row_slice` (per-row descriptors vs the contiguous hull,
  by its cost model), landing in place when per-row reads can fill the window directly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from mx_refit.layout.bands import (
    Band,
    Window,
    gated_bands,
    identity_bands,
    kv_rows_window,
    qkv_bands,
    restrict,
    split_window,
    vocab_window,
)
from mx_refit.layout.manifest import MegatronConfig
from mx_refit.ranges import plan_row_slice
from mx_refit.types import Role, TargetLayout, TensorDescriptor

__all__ = ["Copy", "Out", "Template", "build_template", "columns_template", "rows_template"]

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
    spec_rows: tuple[tuple[int, int, tuple[int, ...], int], ...]  # per output (rel, nbytes, shape, copies)


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
    outs: list[Out],
    pieces: list[tuple[int, int, int, int]],
    nslots: int,
    region: int,
    gaps: list[tuple[int, str]],
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
        spec_rows=tuple((o.rel, o.nbytes, o.shape, len(o.copies)) for o in outs),
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


_IDENTITY, _QKV, _GATED = 1, 3, 2  # transform kinds = number of HF outputs
_EXPECTED_OUTPUTS = {Role.QKV_COLUMN: _QKV, Role.GATED_MLP_COLUMN: _GATED, Role.EXPERT_COLUMN: _GATED}


def scale_grid_units(kind: int, desc: TensorDescriptor, cfg: MegatronConfig, tgt: TargetLayout) -> MegatronConfig:
    """An FP8 scale grid (one float per ``block_size`` block of its weight, see mx_refit.fp8) is
    planned like its weight in units of blocks: the config in blocks (head_dim / block) and a check
    that every boundary the target cuts (q/k/v heads, TP windows) falls on a block edge, as vLLM
    requires of block-FP8 layers; ``ValueError`` naming the boundary otherwise."""
    meta = desc.compile_metadata
    block_rows, _, block_cols = meta.get("block_size", "").partition(",")
    if not (block_rows.isdigit() and block_cols.isdigit()):
        raise ValueError(
            f"FP8 scale grid of {meta['scale_of']!r}: compile_metadata block_size {meta.get('block_size')!r} is not 'rows,cols'"
        )
    block = int(block_rows)
    if kind == _QKV:
        if cfg.head_dim % block:
            raise ValueError(f"FP8 scale grid of {meta['scale_of']!r}: head_dim {cfg.head_dim} is not a multiple of the "
                             f"{block}-row block, so q/k/v blocks straddle heads (publish bf16)")
        cfg = dataclasses.replace(cfg, head_dim=cfg.head_dim // block)
    shape = [int(n) for n in meta.get("weight_shape", "").split(",") if n.isdigit()]
    if not tgt.full_tensors and tgt.tp_size > 1 and desc.role is not Role.REPLICATED:
        ragged = [n for n, b in zip(shape, (block, int(block_cols))) if n % b]
        if ragged:
            raise ValueError(f"FP8 weight {meta['scale_of']!r} of shape {tuple(shape)}: target TP {tgt.tp_size} would cut its "
                             f"ragged last {block}x{block_cols} block; vLLM refuses such a block-FP8 split too")
    return cfg


def build_template(
    mname: str,
    kind: int,
    desc: TensorDescriptor,
    geometry: tuple[tuple[int, tuple[int, ...]], ...],
    vocab_like: bool,
    cfg: MegatronConfig,
    tgt: TargetLayout,
    row_slice_options: dict[str, Any] | None = None,
) -> Template:
    """The template of one Megatron tensor geometry for one receiver.

    ``kind`` is the number of HF outputs (3: fused QKV, 2: fused gate/up, 1: identity);
    ``geometry`` the shard slots ``((offset, local_shape), ...)`` (one slot covering the tensor
    when it is not split); ``vocab_like`` trims the vocabulary padding. Receiver windows follow
    vLLM (see :mod:`mx_refit.layout.planner`). Raises ``ValueError`` for an inconsistent
    geometry or a target that does not divide the tensor.
    """
    role, gshape, axis = desc.role, tuple(desc.global_shape), desc.shard_axis
    if desc.compile_metadata and "scale_of" in desc.compile_metadata:  # an FP8 block-scale grid
        cfg, vocab_like = scale_grid_units(kind, desc, cfg, tgt), False
    expected = _EXPECTED_OUTPUTS.get(role, _IDENTITY)
    if kind != expected and not (role is Role.EXPERT_COLUMN and kind == _IDENTITY):
        raise ValueError(f"role {role.value!r} maps to {expected} HF tensors, the sidecar lists {kind}")
    if axis not in (-1, 0, 1) or (axis == 1 and len(gshape) != 2):
        raise ValueError(f"unsupported shard_axis {axis} for a {len(gshape)}-D tensor")
    for offset, local in geometry:
        if (
            len(local) != len(gshape)
            or any(l != g for d, (l, g) in enumerate(zip(local, gshape)) if d != axis)
            or (axis >= 0 and offset + local[axis] > gshape[axis])
        ):
            raise ValueError(f"shard at offset {offset} of local shape {local} does not fit {gshape}")
    sliced = not tgt.full_tensors
    # vLLM's expert parallelism keeps expert TP at 1: an EP receiver takes its experts whole.
    whole_experts = role in (Role.EXPERT_COLUMN, Role.EXPERT_ROW) and tgt.ep_size > 1

    row_parallel = role in (Role.ROW, Role.EXPERT_ROW) and len(gshape) == 2
    if axis == 1 or row_parallel:
        if kind != _IDENTITY or not row_parallel:
            raise ValueError("only 2-D row-parallel tensors may be split on dim 1")
        cols = gshape[1]
        lo, hi = (
            split_window(cols, tgt.tp_size, tgt.tp_rank, what=f"{mname} columns")
            if sliced and not whole_experts
            else (0, cols)
        )
        slots = [(o, l[1]) for o, l in geometry] if axis == 1 else [(0, cols)]
        return columns_template(gshape, desc.itemsize, slots, Window(1, lo, hi), row_slice_options)

    rows = gshape[0]
    slots = [(o, l[0]) for o, l in geometry] if axis == 0 else [(0, rows)]
    if kind == _QKV:
        h, g, d = cfg.num_heads, cfg.num_groups, cfg.head_dim
        bands = qkv_bands(h, g, d)
        if rows != (h + 2 * g) * d:
            raise ValueError(f"fused QKV rows {rows} != (heads {h} + 2 x groups {g}) x head_dim {d}")
        full = (h * d, g * d, g * d)
        if sliced:
            if h % tgt.tp_size:
                raise ValueError(f"num_attention_heads={h} does not divide by target TP size {tgt.tp_size}")
            kv = kv_rows_window(g, d, tgt.tp_size, tgt.tp_rank)
            windows = [
                Window(0, *split_window(h * d, tgt.tp_size, tgt.tp_rank, what="q rows")),
                Window(0, *kv),
                Window(0, *kv),
            ]
        else:
            windows = [Window(0, 0, n) for n in full]
    elif kind == _GATED:
        # The publishing TP: from the descriptor, never from how many sources exist.
        tp = rows // geometry[0][1][0] if axis == 0 else 1
        if axis == 0 and desc.extras.get("tp_size") not in (None, tp):
            raise ValueError(
                f"extras tp_size={desc.extras['tp_size']} disagrees with the shard geometry ({tp})"
            )
        bands = gated_bands(rows, tp)
        half = rows // 2
        win = (
            split_window(half, tgt.tp_size, tgt.tp_rank, what=f"{mname} gate/up rows")
            if (sliced and not whole_experts)
            else (0, half)
        )
        windows = [Window(0, *win), Window(0, *win)]
    else:
        hf_rows = rows
        if vocab_like and cfg.vocab_size is not None:
            if cfg.vocab_size > rows:
                raise ValueError(f"vocab_size {cfg.vocab_size} exceeds the {rows} published vocabulary rows")
            hf_rows = cfg.vocab_size  # trim Megatron's vocabulary padding
        bands = identity_bands(hf_rows)
        if not sliced or whole_experts or role is Role.REPLICATED or row_parallel or role is Role.ROW:
            windows = [Window(0, 0, hf_rows)]
        elif vocab_like:
            windows = [Window(0, *vocab_window(hf_rows, tgt.tp_size, tgt.tp_rank))]
        else:
            windows = [Window(0, *split_window(hf_rows, tgt.tp_size, tgt.tp_rank, what=f"{mname} rows"))]
    return rows_template(gshape, desc.itemsize, slots, bands, windows)
