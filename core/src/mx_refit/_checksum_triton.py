"""The Triton kernel of :mod:`mx_refit.checksum_kernels` (imported only through it, lazily:
importing this module imports Triton)."""

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]


@triton.jit
def checksum_blocks(tasks, out, COPY: tl.constexpr, CHUNK: tl.constexpr):  # type: ignore[no-untyped-def]
    """One program per task row ``src, dst, nbytes, slot``: ``out[slot]`` = the block's checksum
    (int64 words times odd weights, plus the tail bytes, modulo 2**64); with ``COPY`` the block
    is also stored to ``dst`` from the same loads."""
    t = tl.program_id(0).to(tl.int64)
    src = tl.load(tasks + t * 4)
    dst = tl.load(tasks + t * 4 + 1)
    nbytes = tl.load(tasks + t * 4 + 2)
    slot = tl.load(tasks + t * 4 + 3)
    nwords = nbytes // 8
    s64 = src.to(tl.pointer_type(tl.int64))
    d64 = dst.to(tl.pointer_type(tl.int64))
    offs = tl.arange(0, CHUNK).to(tl.int64)
    acc = tl.zeros([CHUNK], dtype=tl.int64)
    for start in range(0, nwords, CHUNK):
        idx = start + offs
        inside = idx < nwords
        x = tl.load(s64 + idx, mask=inside, other=0)
        if COPY:
            tl.store(d64 + idx, x, mask=inside)
        acc += x * (idx * 2 + 1)  # int64 arithmetic wraps modulo 2**64
    j = tl.arange(0, 8).to(tl.int64)
    in_tail = j < nbytes - nwords * 8
    tail = tl.load(src.to(tl.pointer_type(tl.uint8)) + nwords * 8 + j, mask=in_tail, other=0)
    if COPY:
        tl.store(dst.to(tl.pointer_type(tl.uint8)) + nwords * 8 + j, tail, mask=in_tail)
    total = tl.sum(acc, axis=0) + tl.sum(tail.to(tl.int64) * ((nwords + j) * 2 + 1), axis=0)
    tl.store(out + slot, total)
