"""The Triton kernel of :class:`mx_refit.copies.BatchedCopy` (CUDA; imported only when a batched
copy is launched). One program per table row (see :func:`mx_refit.copies.chunk_table`): it copies
``rows`` rows of ``width`` elements, 8 KiB a step; ``VEC`` tells the compiler every address,
width and stride is a multiple of that many elements, so the loads and stores are 16-byte
vectors. Addresses are element offsets from ``base`` (signed: IPC mappings may lie below it)."""

from __future__ import annotations

import triton  # type: ignore[import-untyped,import-not-found,unused-ignore]
import triton.language as tl  # type: ignore[import-untyped,import-not-found,unused-ignore]

__all__ = ["batched_copy_kernel"]


@triton.jit
def batched_copy_kernel(base, table, BLOCK: tl.constexpr, VEC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * 6
    src = tl.multiple_of(tl.load(table + row), VEC)
    dst = tl.multiple_of(tl.load(table + row + 1), VEC)
    rows = tl.load(table + row + 2)
    width = tl.multiple_of(tl.load(table + row + 3), VEC)
    src_stride = tl.multiple_of(tl.load(table + row + 4), VEC)
    dst_stride = tl.multiple_of(tl.load(table + row + 5), VEC)
    lanes = tl.arange(0, BLOCK)
    for r in range(0, rows):
        s = src + r * src_stride
        d = dst + r * dst_stride
        for c in range(0, width, BLOCK):
            idx = c + lanes
            mask = idx < width
            tl.store(base + d + idx, tl.load(base + s + idx, mask=mask), mask=mask)
