"""Row bands: the integer geometry that maps a Megatron tensor's rows onto HF tensors' rows.

A Megatron tensor that is split on dim 0 (column, vocab, fused QKV, fused gate/up, expert fc1) is
a stack of *bands*: runs of consecutive rows that land, unchanged and in order, at consecutive
rows of one HF tensor. Every row of an HF tensor comes from exactly one band. Because a band moves
whole rows, a band restricted to any row interval of a source shard is one contiguous byte range
on the source and one contiguous byte range in the HF tensor: this is what lets the planner read
exactly the needed bytes and land them directly at their HF destination (no un-interleave copy).

Coordinates are "Megatron concat coordinates": the global tensor is the concatenation of the TP
shards along dim 0 (for gated MLPs that is ``[gate_0; up_0; gate_1; up_1; ...]``). A "row" is one
slice along dim 0 (a single element for 1-D biases).

This module is pure integer arithmetic (no torch) so the planner can run it for thousands of
tensors in a few milliseconds and tests can check it exhaustively.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "Band",
    "Window",
    "gated_bands",
    "identity_bands",
    "kv_rows_window",
    "qkv_bands",
    "restrict",
    "split_window",
    "subtract",
    "vocab_window",
]

# vLLM pads the vocabulary to a multiple of this before splitting it over TP ranks
# (vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE).
VLLM_VOCAB_PADDING = 64


class Band(NamedTuple):
    """``rows`` consecutive rows starting at Megatron row ``src`` land at row ``dst`` of HF output
    number ``out`` (the index into the mapping's HF name list)."""

    src: int
    rows: int
    out: int
    dst: int


class Window(NamedTuple):
    """The part of an HF tensor a receiver needs: ``[lo, hi)`` along ``axis`` (0 rows, 1 columns).

    The full tensor is ``Window(0, 0, shape[0])``.
    """

    axis: int
    lo: int
    hi: int


def identity_bands(rows: int) -> tuple[Band, ...]:
    """One band: HF rows ``[0, rows)`` are Megatron rows ``[0, rows)``.

    ``rows`` may be smaller than the Megatron extent: that trims the tail (vocab padding).
    """
    return (Band(0, rows, 0, 0),)


def qkv_bands(num_heads: int, num_groups: int, head_dim: int) -> tuple[Band, ...]:
    """Bands of Megatron's fused, group-interleaved QKV into HF ``[q, k, v]``.

    Group ``g`` is the contiguous block ``[q heads g*r .. g*r+r-1 | k head g | v head g]`` of
    ``(r + 2) * head_dim`` rows (``r = num_heads / num_groups``), matching Megatron-Bridge's
    ``merge_qkv_weights``/``split_qkv_weights``. Band units are rows of the fused tensor, so the
    same bands serve the 2-D weight and the 1-D bias. Any TP split (including one that cuts
    through a group when there are fewer KV heads than ranks) is handled by :func:`restrict`.
    """
    if num_heads <= 0 or num_groups <= 0 or head_dim <= 0 or num_heads % num_groups:
        raise ValueError(
            f"num_attention_heads={num_heads} must be a positive multiple of num_query_groups={num_groups} "
            f"(head_dim={head_dim})"
        )
    r = num_heads // num_groups
    group_rows = (r + 2) * head_dim
    out: list[Band] = []
    for g in range(num_groups):
        base = g * group_rows
        out.append(Band(base, r * head_dim, 0, g * r * head_dim))
        out.append(Band(base + r * head_dim, head_dim, 1, g * head_dim))
        out.append(Band(base + (r + 1) * head_dim, head_dim, 2, g * head_dim))
    return tuple(out)


def gated_bands(rows: int, tp_size: int) -> tuple[Band, ...]:
    """Bands of a fused gate/up tensor published by ``tp_size`` ranks into HF ``[gate, up]``.

    Rank ``t`` holds ``[gate_t; up_t]`` (Megatron-Bridge ``GatedMLPMapping``), so the concat of
    shards is ``[gate_0; up_0; gate_1; up_1; ...]``; gate rows of rank ``t`` land at HF row
    ``t * I / tp_size``. ``tp_size`` is the *publishing* TP (or expert-TP) size, from the
    descriptor extras: never inferred from how many sources a window happens to touch.
    """
    if tp_size <= 0 or rows % (2 * tp_size):
        raise ValueError(f"gated MLP rows={rows} must split into gate/up halves over tp_size={tp_size}")
    half = rows // (2 * tp_size)  # gate (or up) rows per rank
    out: list[Band] = []
    for t in range(tp_size):
        out.append(Band(2 * t * half, half, 0, t * half))
        out.append(Band((2 * t + 1) * half, half, 1, t * half))
    return tuple(out)


def restrict(
    bands: Sequence[Band], src_lo: int, src_hi: int, windows: Sequence[tuple[int, int] | None]
) -> list[Band]:
    """The parts of ``bands`` inside Megatron rows ``[src_lo, src_hi)`` whose destinations fall in
    the receiver windows (``windows[out] = (lo, hi)`` in HF rows, ``None`` = output not wanted).

    Returned bands keep absolute coordinates on both sides; empty intersections are dropped.
    """
    result: list[Band] = []
    for src, rows, out, dst in bands:
        win = windows[out]
        if win is None:
            continue
        # Intersect in destination space with the window, then map to source space.
        d_lo = max(dst, win[0], dst + (src_lo - src))
        d_hi = min(dst + rows, win[1], dst + (src_hi - src))
        if d_lo < d_hi:
            result.append(Band(src + (d_lo - dst), d_hi - d_lo, out, d_lo))
    return result


def subtract(lo: int, hi: int, covered: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[lo, hi)`` minus the union of the (sorted, possibly overlapping) ``covered`` intervals."""
    gaps: list[tuple[int, int]] = []
    cursor = lo
    for c_lo, c_hi in covered:
        if c_hi <= cursor:
            continue
        if c_lo >= hi:
            break
        if c_lo > cursor:
            gaps.append((cursor, c_lo))
        cursor = max(cursor, c_hi)
        if cursor >= hi:
            break
    if cursor < hi:
        gaps.append((cursor, hi))
    return gaps


def split_window(extent: int, parts: int, rank: int, *, what: str) -> tuple[int, int]:
    """Rank ``rank``'s even share ``[lo, hi)`` of ``extent`` split into ``parts``.

    Raises ``ValueError`` naming ``what`` when the extent does not divide (vLLM refuses uneven
    splits of these dimensions too).
    """
    if extent % parts:
        raise ValueError(f"{what}: extent {extent} does not divide by target TP size {parts}")
    size = extent // parts
    return rank * size, (rank + 1) * size


def kv_rows_window(num_groups: int, head_dim: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Rows of HF ``k_proj``/``v_proj`` a vLLM TP rank holds.

    With at least as many KV heads as ranks they split evenly; with fewer, vLLM replicates each KV
    head over ``tp_size / num_groups`` consecutive ranks, so rank ``t`` holds head
    ``t // (tp_size / num_groups)``.
    """
    if num_groups >= tp_size:
        if num_groups % tp_size:
            raise ValueError(f"num_query_groups={num_groups} does not divide by target TP size {tp_size}")
        per = num_groups // tp_size
        return tp_rank * per * head_dim, (tp_rank + 1) * per * head_dim
    if tp_size % num_groups:
        raise ValueError(f"target TP size {tp_size} is not a multiple of num_query_groups={num_groups}")
    head = tp_rank // (tp_size // num_groups)
    return head * head_dim, (head + 1) * head_dim


def vocab_window(
    vocab_size: int, tp_size: int, tp_rank: int, padding: int = VLLM_VOCAB_PADDING
) -> tuple[int, int]:
    """HF vocabulary rows a vLLM TP rank holds: the padded vocabulary split evenly, clipped to
    the real vocabulary (the last rank holds fewer real rows; the engine pads the rest)."""
    padded = -(-vocab_size // padding) * padding
    per = -(-padded // tp_size)
    lo = min(tp_rank * per, vocab_size)
    return lo, min(lo + per, vocab_size)
