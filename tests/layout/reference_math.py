"""Reference Megatron <-> HF tensor math for the tests (the production path is the planner's
placement in ``mx_refit.layout``), on full tensors, shards or receiver windows.

Everything is expressed through the row bands of :mod:`mx_refit.layout.bands`, so the math the
planner uses to lay bytes out in its arena and the math these functions apply to tensors are the
same code path. Results are byte-identical to Megatron-Bridge 0.6.2's ``split_qkv_weights`` /
``split_qkv_biases`` / ``GatedMLPMapping.megatron_to_hf`` (checked in tests against Bridge).

* :func:`split_qkv` / :func:`merge_qkv`: fused group-interleaved QKV <-> q, k, v (weights or 1-D
  biases, MHA or GQA).
* :func:`split_gated` / :func:`merge_gated`: per-rank ``[gate_t; up_t]`` concat <-> gate, up.
* :func:`scatter_rows`: the general primitive, for any contiguous run of Megatron rows (a TP shard
  that cuts through a query group, a partial window): copies each band piece to its HF place.
* :func:`trim_vocab`: drop Megatron's vocabulary padding (a view).

``place_column_blocks`` (used by the receive path) lives in ``mx_refit.plan`` (re-exported by ``mx_refit.layout.receive_plan``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mx_refit.layout.bands import Band, gated_bands, qkv_bands, restrict

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "gather_row_parallel",
    "merge_gated",
    "merge_qkv",
    "scatter_rows",
    "split_gated",
    "split_qkv",
    "trim_vocab",
]


def scatter_rows(
    src: torch.Tensor,
    src_start: int,
    bands: Sequence[Band],
    outs: Sequence[torch.Tensor | None],
    out_starts: Sequence[int] | None = None,
) -> int:
    """Copy the Megatron rows ``src`` (global rows ``[src_start, src_start + len(src))``) into
    the HF outputs they belong to.

    ``outs[j]`` holds HF rows ``[out_starts[j], out_starts[j] + len(outs[j]))`` of output ``j``
    (a full tensor when ``out_starts[j] == 0`` and it has all rows, or a receiver window);
    ``None`` skips that output. Rows outside every window are ignored. Returns rows copied.
    """
    starts = list(out_starts) if out_starts is not None else [0] * len(outs)
    windows = [None if o is None else (s, s + o.shape[0]) for o, s in zip(outs, starts, strict=True)]
    copied = 0
    for b in restrict(bands, src_start, src_start + src.shape[0], windows):
        out = outs[b.out]
        assert out is not None  # restrict() drops bands of unwanted outputs
        out[b.dst - starts[b.out] : b.dst - starts[b.out] + b.rows].copy_(
            src[b.src - src_start : b.src - src_start + b.rows]
        )
        copied += b.rows
    return copied


def _qkv_geometry(qkv_rows: int, num_heads: int, num_groups: int, head_dim: int) -> None:
    expected = (num_heads + 2 * num_groups) * head_dim
    if qkv_rows != expected:
        raise ValueError(
            f"fused QKV has {qkv_rows} rows, expected (heads {num_heads} + 2 x groups {num_groups}) "
            f"x head_dim {head_dim} = {expected}"
        )


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Un-interleave a full fused QKV weight ``[(H + 2G) d, h]`` or bias ``[(H + 2G) d]`` into
    contiguous ``q [H d, ...]``, ``k [G d, ...]``, ``v [G d, ...]``."""
    import torch

    _qkv_geometry(qkv.shape[0], num_heads, num_groups, head_dim)
    rest = tuple(qkv.shape[1:])
    q = torch.empty((num_heads * head_dim, *rest), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((num_groups * head_dim, *rest), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    scatter_rows(qkv, 0, qkv_bands(num_heads, num_groups, head_dim), (q, k, v))
    return q, k, v


def merge_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> torch.Tensor:
    """Inverse of :func:`split_qkv`: HF q, k, v -> Megatron's fused group-interleaved tensor."""
    import torch

    rows = (num_heads + 2 * num_groups) * head_dim
    out = torch.empty((rows, *q.shape[1:]), dtype=q.dtype, device=q.device)
    for b in qkv_bands(num_heads, num_groups, head_dim):
        out[b.src : b.src + b.rows].copy_((q, k, v)[b.out][b.dst : b.dst + b.rows])
    return out


def split_gated(fc1: torch.Tensor, tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a gathered fused gate/up tensor (concat of ``tp_size`` shards ``[gate_t; up_t]``)
    into contiguous ``gate`` and ``up``. ``tp_size`` is the publishing (expert-)TP size."""
    import torch

    half = fc1.shape[0] // 2
    gate = torch.empty((half, *fc1.shape[1:]), dtype=fc1.dtype, device=fc1.device)
    up = torch.empty_like(gate)
    scatter_rows(fc1, 0, gated_bands(fc1.shape[0], tp_size), (gate, up))
    return gate, up


def merge_gated(gate: torch.Tensor, up: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Inverse of :func:`split_gated`: the concat of ``[gate_t; up_t]`` over ``tp_size`` ranks."""
    import torch

    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    out = torch.empty((2 * gate.shape[0], *gate.shape[1:]), dtype=gate.dtype, device=gate.device)
    for b in gated_bands(out.shape[0], tp_size):
        out[b.src : b.src + b.rows].copy_((gate, up)[b.out][b.dst : b.dst + b.rows])
    return out


def trim_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Drop Megatron's padded vocabulary rows beyond ``vocab_size`` (a view, no copy)."""
    if weight.shape[0] < vocab_size:
        raise ValueError(f"tensor has {weight.shape[0]} vocabulary rows, fewer than vocab_size={vocab_size}")
    return weight[:vocab_size]


def gather_row_parallel(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full tensor of a dim-1 split (``RowParallelMapping`` export: cat on dim 1)."""
    import torch

    return torch.cat(list(shards), dim=1)
