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
    whole: set[str] = set()
    # name -> (axis, extent along it, [(first, end, source id)])
    split: dict[str, tuple[int, int, list[tuple[int, int, str]]]] = {}
    for source in sources:
        for desc in source.tensors:
            axis = desc.shard_axis
            if axis < 0 or axis >= len(desc.local_shape):
                whole.add(desc.name)
                continue
            entry = split.get(desc.name)
            if entry is None:
                entry = split[desc.name] = (axis, int(desc.global_shape[axis]), [])
            entry[2].append((desc.shard_offset, desc.shard_offset + int(desc.local_shape[axis]), source.source_id))
    gaps: list[tuple[str, str]] = []
    for name in sorted(split.keys() - whole):
        axis, extent, shards = split[name]
        shards.sort()
        cursor = 0
        for first, end, _ in shards:
            if first > cursor:
                gaps.append((name, _hole(axis, cursor, first, extent, shards)))
            cursor = max(cursor, end)
        if cursor < extent:
            gaps.append((name, _hole(axis, cursor, extent, extent, shards)))
    hf_map = sidecar.get(_HF_MAP_KEY)
    if isinstance(hf_map, Mapping):
        config = sidecar.get(_CONFIG_KEY)
        tied = isinstance(config, Mapping) and bool(config.get("tie_word_embeddings"))
        published = whole | split.keys()
        for name in sorted(hf_map.keys() - published):
            if tied and name.endswith("output_layer.weight"):
                continue  # tied: the embedding is published once, the output layer never
            gaps.append((name, "listed in the Megatron name map but published by no source"))
    return gaps


def _hole(axis: int, first: int, end: int, extent: int, shards: list[tuple[int, int, str]]) -> str:
    held = ", ".join(f"[{a}, {b}) by {sid}" for a, b, sid in shards[:4]) + (" ..." if len(shards) > 4 else "")
    return f"dim {axis} [{first}, {end}) of {extent} published by no source (shards: {held})"


def describe_gaps(gaps: list[tuple[str, str]], limit: int = 8) -> str:
    """``name: what; name: what ...`` (the first ``limit``; the count of the rest)."""
    text = "; ".join(f"{name}: {what}" for name, what in gaps[:limit])
    return text + (f"; and {len(gaps) - limit} more" if len(gaps) > limit else "")
