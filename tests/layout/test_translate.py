"""Translator math vs Megatron-Bridge 0.6.2's own functions (byte-identical), plus the band
geometry it is built on."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mx_refit.layout.bands import (
    gated_bands,
    identity_bands,
    kv_rows_window,
    qkv_bands,
    restrict,
    subtract,
    vocab_window,
)
from mx_refit.layout.receive_plan import place_column_blocks

from tests.layout.reference_math import (
    gather_row_parallel,
    merge_gated,
    merge_qkv,
    scatter_rows,
    split_gated,
    split_qkv,
    trim_vocab,
)

# (heads, groups, head_dim, hidden): MHA, GQA, MQA, GQA with head_dim != hidden/heads
QKV_CONFIGS = [(4, 4, 8, 32), (8, 2, 4, 32), (8, 1, 4, 32), (6, 3, 10, 24)]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


@pytest.fixture(scope="module")
def pm(bridge: Any) -> Any:
    from megatron.bridge.models.conversion import param_mapping

    return param_mapping


def _cfg(h: int, g: int, d: int, hidden: int) -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=h, num_query_groups=g, kv_channels=d, hidden_size=hidden)


# -- bands ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("h,g,d", [(c[0], c[1], c[2]) for c in QKV_CONFIGS])
def test_qkv_bands_tile_both_sides(h: int, g: int, d: int) -> None:
    bands = qkv_bands(h, g, d)
    src = sorted((b.src, b.src + b.rows) for b in bands)
    assert src[0][0] == 0 and src[-1][1] == (h + 2 * g) * d
    assert all(a[1] == b[0] for a, b in itertools.pairwise(src))  # no hole, no overlap
    for out, rows in enumerate((h * d, g * d, g * d)):
        dst = sorted((b.dst, b.dst + b.rows) for b in bands if b.out == out)
        assert dst[0][0] == 0 and dst[-1][1] == rows and all(a[1] == b[0] for a, b in itertools.pairwise(dst))


def test_gated_bands_follow_rank_concat() -> None:
    # tp=2, I=4: [g0 g1 u0 u1 | g2 g3 u2 u3]
    assert gated_bands(8, 2) == ((0, 2, 0, 0), (2, 2, 1, 0), (4, 2, 0, 2), (6, 2, 1, 2))
    with pytest.raises(ValueError):
        gated_bands(6, 2)


def test_restrict_and_subtract() -> None:
    bands = qkv_bands(2, 1, 2)  # rows: q 0-3, k 4-5, v 6-7
    assert restrict(bands, 3, 7, [(0, 4), (0, 2), (0, 2)]) == [(3, 1, 0, 3), (4, 2, 1, 0), (6, 1, 2, 0)]
    assert restrict(bands, 0, 8, [None, (1, 2), None]) == [(5, 1, 1, 1)]
    assert restrict(identity_bands(5), 0, 8, [(0, 5)]) == [(0, 5, 0, 0)]  # vocab trim
    assert subtract(0, 10, [(0, 3), (2, 4), (6, 8)]) == [(4, 6), (8, 10)]
    assert subtract(2, 5, []) == [(2, 5)]
    assert subtract(2, 5, [(0, 9)]) == []


def test_receiver_windows() -> None:
    assert kv_rows_window(4, 8, 2, 1) == (16, 32)
    assert [kv_rows_window(2, 8, 4, t) for t in range(4)] == [(0, 8), (0, 8), (8, 16), (8, 16)]
    with pytest.raises(ValueError):
        kv_rows_window(2, 8, 3, 0)
    assert [vocab_window(50, 4, t) for t in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 50)]
    assert vocab_window(151936, 4, 3) == (113952, 151936)


# -- QKV -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("h,g,d,hidden", QKV_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_and_merge_qkv_match_bridge(
    pm: Any, h: int, g: int, d: int, hidden: int, dtype: torch.dtype
) -> None:
    cfg = _cfg(h, g, d, hidden)
    q, k, v = (
        torch.randn(h * d, hidden).to(dtype),
        torch.randn(g * d, hidden).to(dtype),
        torch.randn(g * d, hidden).to(dtype),
    )
    fused = pm.merge_qkv_weights(cfg, q, k, v)
    assert same_bytes(merge_qkv(q, k, v, h, g, d), fused)
    for ours, theirs in zip(split_qkv(fused, h, g, d), pm.split_qkv_weights(cfg, fused), strict=True):
        assert same_bytes(ours, theirs)
    qb, kb, vb = torch.randn(h * d).to(dtype), torch.randn(g * d).to(dtype), torch.randn(g * d).to(dtype)
    fused_b = pm.merge_qkv_biases(cfg, qb, kb, vb)
    assert same_bytes(merge_qkv(qb, kb, vb, h, g, d), fused_b)
    for ours, theirs in zip(split_qkv(fused_b, h, g, d), pm.split_qkv_biases(cfg, fused_b), strict=True):
        assert same_bytes(ours, theirs)


@pytest.mark.parametrize("h,g,d,hidden", QKV_CONFIGS)
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_qkv_shards_cutting_through_groups(pm: Any, h: int, g: int, d: int, hidden: int, tp: int) -> None:
    """Raw row shards (any TP, also more ranks than KV heads) scattered one by one, into full
    outputs and into every receiver window, reproduce Bridge's split exactly."""
    rows = (h + 2 * g) * d
    if rows % tp:
        pytest.skip("Megatron splits evenly")
    cfg = _cfg(h, g, d, hidden)
    fused = pm.merge_qkv_weights(
        cfg, torch.randn(h * d, hidden), torch.randn(g * d, hidden), torch.randn(g * d, hidden)
    )
    want = pm.split_qkv_weights(cfg, fused)
    outs = [torch.full_like(w, float("nan")) for w in want]
    bands = qkv_bands(h, g, d)
    per = rows // tp
    for t in range(tp):
        scatter_rows(fused[t * per : (t + 1) * per], t * per, bands, outs)
    for o, w in zip(outs, want, strict=True):
        assert same_bytes(o, w)
    # windows: the k rows of one head only, from shards that straddle it
    k_win = torch.empty(d, hidden)
    for t in range(tp):
        scatter_rows(fused[t * per : (t + 1) * per], t * per, bands, [None, k_win, None], [0, (g - 1) * d, 0])
    assert same_bytes(k_win, want[1][(g - 1) * d :])


# -- gated MLP, row parallel, vocab ------------------------------------------------------------------


def _bridge_export(pm: Any, cls_name: str, shards: list[torch.Tensor], megatron_param: str, hf: Any) -> dict:
    """Run a Bridge mapping's real ``megatron_to_hf`` with its TP gather fed from ``shards``."""
    base = getattr(pm, cls_name)

    class Fed(base):  # type: ignore[misc, valid-type]
        tp_size = len(shards)  # shadows the process-group property

        def gather_from_tp_ranks(self, tensor: torch.Tensor) -> list[torch.Tensor]:
            return list(shards)

    mapping = Fed(megatron_param, **hf) if isinstance(hf, dict) else Fed(megatron_param, hf)
    return mapping.megatron_to_hf(shards[0], None)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_gated_matches_bridge_export(pm: Any, tp: int) -> None:
    gate, up = torch.randn(16, 12).to(torch.bfloat16), torch.randn(16, 12).to(torch.bfloat16)
    fused = merge_gated(gate, up, tp)
    shards = list(torch.chunk(fused, tp, dim=0))
    got = _bridge_export(
        pm, "GatedMLPMapping", shards, "decoder.layers.0.mlp.linear_fc1.weight", {"gate": "g", "up": "u"}
    )
    ours = split_gated(fused, tp)
    assert same_bytes(ours[0], got["g"]) and same_bytes(ours[1], got["u"])
    assert same_bytes(ours[0], gate) and same_bytes(ours[1], up)
    # A window holding only some gate rows (the upstream bug: N = number of sources in it).
    window = torch.empty(16 // 4, 12, dtype=torch.bfloat16)
    scatter_rows(fused, 0, gated_bands(32, tp), [window, None], [4, 0])
    assert same_bytes(window, gate[4:8])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_matches_bridge_export(pm: Any, tp: int) -> None:
    full = torch.randn(6, 16).to(torch.bfloat16)
    shards = list(torch.chunk(full, tp, dim=1))
    got = _bridge_export(
        pm,
        "RowParallelMapping",
        [s.contiguous() for s in shards],
        "decoder.layers.0.self_attention.linear_proj.weight",
        "o",
    )
    assert same_bytes(gather_row_parallel(shards), got["o"])
    out = torch.empty(6, 8, dtype=torch.bfloat16)  # columns [4, 12): parts of several shards
    blocks = []
    for t, s in enumerate(shards):
        lo, hi = max(t * s.shape[1], 4), min((t + 1) * s.shape[1], 12)
        if lo < hi:
            blocks.append((lo, s[:, lo - t * s.shape[1] : hi - t * s.shape[1]]))
    assert same_bytes(place_column_blocks(out, blocks, col_start=4), full[:, 4:12])
    with pytest.raises(ValueError):
        place_column_blocks(out, [(10, shards[0])], col_start=4)


def test_trim_vocab_is_a_view() -> None:
    padded = torch.randn(64, 8)
    trimmed = trim_vocab(padded, 50)
    assert trimmed.shape == (50, 8) and trimmed.data_ptr() == padded.data_ptr()
    with pytest.raises(ValueError):
        trim_vocab(padded, 65)
