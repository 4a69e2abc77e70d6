"""What ``mx-refit verify`` expects each receiver to hold, and the byte comparison.

Deliberately independent of the planner: the windows below restate vLLM's tensor-parallel
conventions from scratch (q/k/v/gate/up and vocabulary rows on dim 0, with KV heads replicated
when there are fewer than ranks; o_proj/down_proj columns on dim 1; norms, routers and row-layer
biases whole; with target EP > 1 a worker holds only its own experts, whole). A planner window bug
therefore shows up as a mismatch instead of being mirrored.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections import Counter
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from mx_refit.types import Role, TargetLayout, VersionInfo

__all__ = ["CheckpointTensor", "Window", "checkpoint_dtype", "checkpoint_index", "compare_received",
           "expected_windows", "vllm_vocab_window"]

# safetensors dtype codes -> torch dtype names
_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}
_EXPERT_ROLES = (Role.EXPERT_COLUMN, Role.EXPERT_ROW)
_HF_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")
VLLM_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


class CheckpointTensor(NamedTuple):
    file: str
    dtype: str  # torch dtype name
    shape: tuple[int, ...]


class Window(NamedTuple):
    """Rows (``axis=0``) or columns (``axis=1``) ``[lo, hi)`` of an HF tensor."""

    axis: int
    lo: int
    hi: int


@lru_cache(maxsize=8)
def _index_cached(hf_dir: str, stamp: tuple[tuple[str, float], ...]) -> dict[str, CheckpointTensor]:
    index: dict[str, CheckpointTensor] = {}
    for name, _ in stamp:
        path = os.path.join(hf_dir, name)
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for tensor, meta in header.items():
            if tensor == "__metadata__":
                continue
            index[tensor] = CheckpointTensor(path, _ST_DTYPES.get(meta["dtype"], meta["dtype"]), tuple(meta["shape"]))
    return index


def checkpoint_index(hf_dir: str | os.PathLike[str]) -> dict[str, CheckpointTensor]:
    """Every tensor of the checkpoint's ``*.safetensors`` files (headers only, no torch)."""
    root = Path(hf_dir)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"--hf-dir {os.fspath(hf_dir)!r} has no *.safetensors files")
    stamp = tuple((f.name, f.stat().st_mtime) for f in files)
    return _index_cached(os.fspath(root), stamp)


def checkpoint_dtype(hf_dir: str | os.PathLike[str]) -> str:
    """The dtype of most 2-D weights (what the Megatron model is built in)."""
    counts = Counter(t.dtype for t in checkpoint_index(hf_dir).values() if len(t.shape) >= 2)
    if not counts:
        raise ValueError(f"{os.fspath(hf_dir)!r}: no 2-D tensors in the checkpoint")
    return counts.most_common(1)[0][0]


def _even(extent: int, parts: int, rank: int) -> tuple[int, int]:
    if extent % parts:
        raise ValueError(f"extent {extent} does not split evenly over {parts} target ranks")
    size = extent // parts
    return rank * size, (rank + 1) * size


def vllm_vocab_window(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """vLLM's VocabParallelEmbedding shard: the 64-padded vocabulary split evenly, clipped."""
    padded = -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    per = -(-padded // tp)
    lo = min(rank * per, vocab)
    return lo, min(lo + per, vocab)


def _kv_window(groups: int, head_dim: int, tp: int, rank: int) -> tuple[int, int]:
    if groups >= tp:
        lo, hi = _even(groups, tp, rank)
        return lo * head_dim, hi * head_dim
    head = rank * groups // tp  # each KV head is replicated on tp/groups consecutive ranks
    return head * head_dim, (head + 1) * head_dim


def expected_windows(version: VersionInfo, target: TargetLayout,
                     index: Mapping[str, CheckpointTensor]) -> dict[str, Window | None]:
    """``{hf_name: window or None (whole)}`` for every HF tensor ``target`` must receive."""
    sidecar = version.sidecar
    cfg = sidecar["megatron.config"]
    hf_map: Mapping[str, Any] = sidecar["megatron.hf_map"]
    heads, groups = int(cfg["num_attention_heads"]), int(cfg["num_query_groups"])
    head_dim, vocab = int(cfg["kv_channels"]), int(cfg["vocab_size"])
    experts = int(cfg.get("num_moe_experts") or 0)
    descriptors: dict[str, Any] = {}
    for source in version.sources:
        for published in source.tensors:
            descriptors.setdefault(published.name, published)
    tp, rank = target.tp_size, target.tp_rank

    def owned(expert_id: int) -> bool:
        return target.ep_size == 1 or expert_id // (experts // target.ep_size) == target.ep_rank

    out: dict[str, Window | None] = {}
    for mname, entry in hf_map.items():
        names = list(entry["hf"])
        desc = descriptors.get(mname)
        role = desc.role if desc is not None else None
        expert = role in _EXPERT_ROLES or ".experts." in mname
        if expert:
            eid = desc.extras.get("expert_id") if desc is not None else None
            match = _HF_EXPERT_RE.search(names[0])
            if eid is None and match:
                eid = int(match.group(1))
            if eid is not None and not owned(int(eid)):
                continue
        whole = target.full_tensors or role is None or (expert and target.ep_size > 1)
        for i, name in enumerate(names):
            shape = index[name].shape if name in index else ()
            window: Window | None = None
            if not whole and shape:
                if role is Role.QKV_COLUMN:
                    window = Window(0, *(_even(shape[0], tp, rank) if i == 0 else _kv_window(groups, head_dim, tp, rank)))
                    if i == 0 and heads % tp:
                        raise ValueError(f"{name}: {heads} heads do not split over target TP {tp}")
                elif role in (Role.ROW, Role.EXPERT_ROW) and len(shape) == 2:
                    window = Window(1, *_even(shape[1], tp, rank))
                elif role is Role.VOCAB_PARALLEL:
                    window = Window(0, *vllm_vocab_window(vocab, tp, rank))
                elif role in (Role.COLUMN, Role.GATED_MLP_COLUMN, Role.EXPERT_COLUMN):
                    window = Window(0, *_even(shape[0], tp, rank))
            out[name] = window
    for name in index:  # checkpoint tensors the sidecar never mentions: expected, whole
        if name in out:
            continue
        match = _HF_EXPERT_RE.search(name)
        if match and experts and not owned(int(match.group(1))):
            continue
        out[name] = None
    return out


def compare_received(hf_dir: str | os.PathLike[str], expected: Mapping[str, Window | None],
                     received: Iterable[tuple[str, Any]]) -> dict[str, list[str]]:
    """Compare received ``(hf_name, tensor)`` pairs with the checkpoint's bytes.

    Returns name lists: ``expected``, ``identical``, ``mismatched`` (wrong bytes, shape or dtype,
    or a name the receiver should not have produced) and ``missing``.
    """
    import torch
    from safetensors import safe_open

    index = checkpoint_index(hf_dir)
    got = dict(received)
    report: dict[str, list[str]] = {"expected": sorted(expected), "identical": [], "mismatched": [], "missing": []}
    handles: dict[str, Any] = {}
    try:
        for name in sorted(expected):
            window = expected[name]
            tensor = got.pop(name, None)
            if tensor is None:
                empty = window is not None and window.lo == window.hi
                report["identical" if empty else "missing"].append(name)
                continue
            entry = index.get(name)
            if entry is None:
                report["mismatched"].append(name)
                continue
            if entry.file not in handles:
                handles[entry.file] = safe_open(entry.file, framework="pt")
            piece = handles[entry.file].get_slice(name)
            if window is None:
                want = piece[:]
            elif window.axis == 0:
                want = piece[window.lo:window.hi]
            else:
                want = piece[:, window.lo:window.hi]
            same = (tensor.dtype == want.dtype and tuple(tensor.shape) == tuple(want.shape)
                    and torch.equal(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8),
                                    want.contiguous().view(-1).view(torch.uint8)))
            report["identical" if same else "mismatched"].append(name)
    finally:
        handles.clear()
    report["mismatched"].extend(sorted(got))  # produced but not expected: a wrong name map or window
    return report
