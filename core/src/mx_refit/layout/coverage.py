"""Does a version's set of sources hold every byte of every tensor it publishes?

The catalog asks before a version becomes READY (:func:`version_gaps`): a split tensor whose
shards leave part of its global extent unpublished (a TP or expert-TP rank that published nothing,
say, because the job counted its publishing ranks wrongly) or a name the Megatron name map lists
that no source publishes refuses the version, naming the tensor and the missing range, instead of
letting every reader fail (or time out) later. Pure: types only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from mx_refit.types import SourceInfo

__all__ = ["describe_gaps", "version_gaps"]

_CONFIG_KEY, _HF_MAP_KEY = "megatron.config", "megatron.hf_map"  # see mx_refit.layout.manifest


def version_gaps(sources: Iterable[SourceInfo], sidecar: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(tensor name, what is missing)`` for every gap, in name order; empty when covered."""
    sources = list(sources)
    whole = {d.name for s in sources for d in s.tensors if d.shard_axis < 0}
    # Every shard as (name, first, end, extent, axis, source id), sorted: one pass finds the holes
    # (comprehensions and one sort: a 19k-descriptor version is checked in tens of milliseconds).
    shards = sorted([
        (d.name, d.shard_offset, d.shard_offset + d.local_shape[d.shard_axis], d.global_shape[d.shard_axis],
         d.shard_axis, s.source_id)
        for s in sources for d in s.tensors if 0 <= d.shard_axis < len(d.local_shape)
    ])
    gaps: list[tuple[str, str]] = []
    split: set[str] = set()
    i, count = 0, len(shards)
    while i < count:
        name, _, _, extent, axis, _ = shards[i]
        j = i
        cursor = 0
        while j < count and shards[j][0] == name:
            first, end = shards[j][1], shards[j][2]
            if first > cursor and name not in whole:
                gaps.append((name, _hole(axis, cursor, first, extent, shards[i:j + 1])))
            cursor = max(cursor, end)
            j += 1
        if cursor < extent and name not in whole:
            gaps.append((name, _hole(axis, cursor, extent, extent, shards[i:j])))
        split.add(name)
        i = j
    hf_map = sidecar.get(_HF_MAP_KEY)
    if isinstance(hf_map, Mapping):
        config = sidecar.get(_CONFIG_KEY)
        tied = isinstance(config, Mapping) and bool(config.get("tie_word_embeddings"))
        published = whole | split
        for name in sorted(hf_map.keys() - published):
            if tied and name.endswith("output_layer.weight"):
                continue  # tied: the embedding is published once, the output layer never
            gaps.append((name, "listed in the Megatron name map but published by no source"))
    return gaps


def _hole(axis: int, first: int, end: int, extent: int, shards: list[tuple[Any, ...]]) -> str:
    held = ", ".join(f"[{a}, {b}) by {sid}" for _, a, b, _, _, sid in shards[:4]) + (" ..." if len(shards) > 4 else "")
    return f"dim {axis} [{first}, {end}) of {extent} published by no source (shards: {held})"


def describe_gaps(gaps: list[tuple[str, str]], limit: int = 8) -> str:
    """``name: what; name: what ...`` (the first ``limit``; the count of the rest)."""
    text = "; ".join(f"{name}: {what}" for name, what in gaps[:limit])
    return text + (f"; and {len(gaps) - limit} more" if len(gaps) > limit else "")
