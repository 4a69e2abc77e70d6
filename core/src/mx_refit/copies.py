"""Batched device copies: many scattered ranges, or 2-D strided blocks, in one kernel launch.

Why: a device copy call costs ~2.5 us of launch and tail whatever its size, so 10,000 separately
allocated tensors read one call per range spend more time in calls than in bytes (issue 22), and
a row-parallel merge done one torch copy per block is one launch per block. Here every range of a
read (or every staged block of a plan) is one row of a table that lives on the device; one
Triton kernel walks the table, each program copying one chunk with 16-byte vector loads.

The API is small on purpose (another kernel, e.g. a fused copy + checksum, can reuse the table):

* :class:`Block` ``(src, dst, rows, width, src_stride, dst_stride)``: absolute device addresses
  and byte counts; a plain range is ``Block(src, dst, 1, n, n, n)`` (:func:`ranges_as_blocks`).
* :func:`chunk_table` (pure Python, tested on CPU): blocks -> per alignment class (16, 4 or 1
  bytes) the rows of the device table, each at most ``chunk_bytes`` of work, in elements of the
  class's word relative to a base address. Every byte of every block is covered exactly once.
* :class:`BatchedCopy`: the tables on the device (built once, reused every cycle) and
  :meth:`BatchedCopy.launch`, at most one launch per alignment class on the current stream.
* :func:`available`: whether the kernel can run here (CUDA and Triton importable).

Nothing here checks that the addresses are mapped: callers pass addresses they own (the
arena, opened IPC mappings). No torch or triton import at module import time.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["CHUNK_BYTES", "Block", "BatchedCopy", "ChunkTable", "available", "batched_ranges", "chunk_table",
           "copy_mode", "ranges_as_blocks"]

CHUNK_BYTES = 256 << 10  # per program: large enough to stream, small enough to balance 132 SMs
FIELDS = 6  # int64 per table row: src, dst, rows, width, src_stride, dst_stride (elements)
# alignment class (bytes) -> (element size in bytes, vector width in elements)
CLASSES = {16: (4, 4), 4: (4, 1), 1: (1, 1)}


class Block(NamedTuple):
    """``rows`` rows of ``width`` bytes: row ``r`` goes from ``src + r * src_stride`` to
    ``dst + r * dst_stride``."""

    src: int
    dst: int
    rows: int
    width: int
    src_stride: int
    dst_stride: int


class ChunkTable(NamedTuple):
    """One alignment class's rows: ``align`` bytes divide every address, width and stride;
    ``rows`` holds :data:`FIELDS` ints per program, in elements of ``elem`` bytes from ``base``."""

    align: int
    elem: int
    vec: int
    rows: list[int]

    @property
    def programs(self) -> int:
        return len(self.rows) // FIELDS


def ranges_as_blocks(copies: Iterable[tuple[int, int, int]]) -> list[Block]:
    """``(src, dst, nbytes)`` ranges as one-row blocks."""
    return [Block(s, d, 1, n, n, n) for s, d, n in copies if n]


def _alignment(block: Block, base: int) -> int:
    for align in (16, 4):
        if not ((block.src - base) % align or (block.dst - base) % align or block.width % align
                or (block.rows > 1 and (block.src_stride % align or block.dst_stride % align))):
            return align
    return 1


def chunk_table(blocks: Sequence[Block], base: int, chunk_bytes: int = CHUNK_BYTES) -> list[ChunkTable]:
    """The blocks as device-table rows, per alignment class (see the module docs).

    A block wider than ``chunk_bytes`` is cut along its rows' width; narrower rows are grouped,
    ``chunk_bytes // width`` rows per program. ``base`` must be 16-byte aligned."""
    if base % 16:
        raise ValueError(f"base: {base:#x} must be 16-byte aligned")
    if chunk_bytes < 16 or chunk_bytes % 16:
        raise ValueError(f"chunk_bytes: {chunk_bytes} must be a positive multiple of 16")
    out: dict[int, list[int]] = {a: [] for a in CLASSES}
    for block in blocks:
        if block.rows <= 0 or block.width <= 0:
            continue
        align = _alignment(block, base)
        elem = CLASSES[align][0]
        rows = out[align]
        src, dst = (block.src - base) // elem, (block.dst - base) // elem
        ss, ds = block.src_stride // elem, block.dst_stride // elem
        if block.width > chunk_bytes:  # cut every row into chunk-wide pieces
            step = chunk_bytes // elem
            width = block.width // elem
            for r in range(block.rows):
                s0, d0 = src + r * ss, dst + r * ds
                for c in range(0, width, step):
                    n = min(step, width - c)
                    rows.extend((s0 + c, d0 + c, 1, n, n, n))
        else:
            per = max(1, chunk_bytes // block.width)
            width = block.width // elem
            for r in range(0, block.rows, per):
                rows.extend((src + r * ss, dst + r * ds, min(per, block.rows - r), width, ss, ds))
    return [ChunkTable(a, CLASSES[a][0], CLASSES[a][1], rows) for a, rows in out.items() if rows]


def copy_mode() -> str:
    """``MX_REFIT_COPY_KERNEL``: ``auto`` (default: the kernel where it pays, see callers),
    ``always`` or ``never`` (one copy call per range, the path before the kernel)."""
    mode = os.environ.get("MX_REFIT_COPY_KERNEL", "auto").strip().lower() or "auto"
    if mode not in ("auto", "always", "never"):
        raise ValueError(f"MX_REFIT_COPY_KERNEL: {mode!r} is not one of auto, always, never")
    return mode


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """CUDA and Triton are importable and a device is present (cached)."""
    try:
        import torch
        import triton  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: F401

        return bool(torch.cuda.is_available())
    except Exception:
        return False


class BatchedCopy:
    """Blocks between device addresses, as device tables built once; :meth:`launch` enqueues
    the copies (at most three launches) on the current stream of ``anchor``'s device.

    ``anchor`` is any tensor on the device whose data pointer is 16-byte aligned (the arena):
    addresses are passed to the kernel relative to it, so it must outlive the copy."""

    def __init__(self, blocks: Sequence[Block], anchor: "torch.Tensor", chunk_bytes: int = CHUNK_BYTES) -> None:
        import torch

        self.anchor = anchor
        self.blocks = len(blocks)
        self.nbytes = sum(b.rows * b.width for b in blocks)
        self.tables = chunk_table(blocks, anchor.data_ptr(), chunk_bytes)
        start = anchor.view(-1).view(torch.uint8)[:16]  # the kernel only needs a typed pointer
        # (base pointer, device table, programs, elements per step, vector width) per launch
        self._launches: list[tuple[Any, Any, int, int, int]] = []
        for t in self.tables:
            base = start.view(torch.int32) if t.elem == 4 else start
            device_rows = torch.tensor(t.rows, dtype=torch.int64, device=anchor.device)
            self._launches.append((base, device_rows, t.programs, 8192 // t.elem, t.vec))  # 8 KiB a step

    @property
    def programs(self) -> int:
        return sum(t.programs for t in self.tables)

    def launch(self) -> None:
        """Enqueue every copy on the current stream of the anchor's device (no wait)."""
        import torch

        from mx_refit._copies_triton import batched_copy_kernel as kernel
        with torch.cuda.device(self.anchor.device):
            for base, rows, programs, step, vec in self._launches:
                kernel[(programs,)](base, rows, BLOCK=step, VEC=vec, num_warps=4)


# In auto mode the kernel takes a read only when its ranges average under this: on one H200 the
# kernel moved 10,000 x 256 KiB at 1,250 GB/s against 13-41 GB/s one copy call per range, but
# Qwen3-8B's 399 tensors (41 MB on average) at 1,794 GB/s against 1,865 GB/s for per-tensor
# copies (BENCHMARKS.md, issue 22): large copies run at full speed on their own.
KERNEL_MAX_MEAN_BYTES = 4 << 20


def batched_ranges(ranges: Sequence[tuple[int, int, int]], arena: "torch.Tensor", min_ranges: int) -> BatchedCopy | None:
    """One :class:`BatchedCopy` of ``(src, dst, nbytes)`` ranges anchored at ``arena``, or None
    where one copy call per range is the better path: in ``auto`` mode fewer than ``min_ranges``
    ranges or ranges of :data:`KERNEL_MAX_MEAN_BYTES` or more on average (a few large copies run
    at full speed on their own); ``never`` mode; no Triton or CUDA; an arena not 16-byte aligned."""
    mode = copy_mode()
    few_or_large = len(ranges) < min_ranges or sum(n for _, _, n in ranges) >= KERNEL_MAX_MEAN_BYTES * len(ranges)
    if mode == "never" or (mode == "auto" and few_or_large) or arena.data_ptr() % 16 or not available():
        return None
    return BatchedCopy(ranges_as_blocks(ranges), arena)
