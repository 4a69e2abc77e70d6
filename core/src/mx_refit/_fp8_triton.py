"""The Triton kernel of :func:`mx_refit.fp8.quantize_into` (CUDA; imported only when a CUDA
tensor is quantised). One program per 128x128 block: it loads the block once, takes its amax,
and writes the FP8 block and its scale, reading 2 bytes and writing ~1 per element. Divisions are
IEEE-rounded (``div_rn``) and the cast rounds to nearest even, so the bytes equal
:func:`mx_refit.fp8.quantize_reference` (vLLM's ``per_block_cast_to_fp8``)."""

from __future__ import annotations

import triton  # type: ignore[import-untyped,import-not-found,unused-ignore]
import triton.language as tl  # type: ignore[import-untyped,import-not-found,unused-ignore]

__all__ = ["block_quant_kernel"]


@triton.jit
def block_quant_kernel(x_ptr, q_ptr, s_ptr, m, n, x_stride, q_stride, s_stride,
                       BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, FLOOR: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = pid_n * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < m) & (cols[None, :] < n)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), FLOOR)
    scale = tl.math.div_rn(amax, FP8_MAX)
    inv = tl.math.div_rn(1.0, scale)
    q = (x * inv).to(tl.float8e4nv)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * q_stride + cols[None, :], q, mask=mask)
    tl.store(s_ptr + pid_m * s_stride + pid_n, scale)
