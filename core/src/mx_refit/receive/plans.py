"""A receiver's plans, cached by layout: the plan, its per-source coalesced reads, and (with
checksums) those reads widened to whole checksum blocks.

Trainers republish the same buffers every step, so from the second cycle on the layout
(sources, descriptors, sidecar) is unchanged and neither planning nor coalescing is redone.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from mx_refit.compile_targets import check_compile_targets
from mx_refit.errors import InvalidArgument
from mx_refit.types import SourceInfo, TargetLayout, VersionInfo

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.checksums import Verification
    from mx_refit.plan import ReceivePlan
    from mx_refit.plugins import Hooks

__all__ = ["PlanCache", "layout_key", "region_edges"]

# per source id: (source address, arena offset, nbytes)
Requests = dict[str, list[tuple[int, int, int]]]


class PlanCache:
    """The last plan and widening of one receiver (one target layout)."""

    def __init__(self) -> None:
        self._plan: "tuple[int, ReceivePlan, Requests] | None" = None
        self._widening: "tuple[Any, Verification] | None" = None
        self._checked: tuple[int, tuple[Any, ...]] | None = None
        self.compile_target = "hf_raw"  # of the last checked version

    def plan(self, info: VersionInfo, target: TargetLayout, hooks: "Hooks") -> "tuple[ReceivePlan, Requests]":
        """The plan of ``info`` for ``target`` (by the plugins) and its per-source coalesced
        arena-relative reads, cut at the sources' region edges."""
        from mx_refit.ranges import coalesce, split_at

        key = layout_key(info, target)
        checked = (key, tuple(s.compat for s in info.sources))
        if self._checked != checked:  # the version's form against the receiver's (issue 23)
            self.compile_target = check_compile_targets(info, target)
            self._checked = checked
        if self._plan is not None and self._plan[0] == key:
            return self._plan[1], self._plan[2]
        plan = hooks.plan_receive(info, target)
        grouped: Requests = defaultdict(list)
        for read in plan.reads:
            grouped[read.source_id].append((read.remote_addr, read.local_offset, read.nbytes))
        sources = {s.source_id: s for s in info.sources}
        requests = {
            source_id: split_at(coalesce(ops), region_edges(sources[source_id]))
            for source_id, ops in grouped.items()
        }
        for source in info.sources:
            kinds = {(d.mem_type.value, d.device_id) for d in source.tensors}
            if len(kinds) > 1:
                raise InvalidArgument(
                    f"source {source.source_id!r} publishes tensors in {len(kinds)} memory locations "
                    f"{sorted(kinds)}; one source must publish from one device"
                )
        self._plan = (key, plan, requests)
        return plan, requests

    @property
    def key(self) -> object:
        """The layout key of the cached plan (None before the first)."""
        return self._plan[0] if self._plan is not None else None

    def widen(self, info: VersionInfo, plan: "ReceivePlan", requests: Requests) -> "Verification":
        """The plan's reads widened to whole checksum blocks (see :mod:`mx_refit.checksums`),
        cached like the plan: by its layout and each source's block size."""
        from mx_refit.checksums import widen

        blocks = tuple((s.source_id, s.checksums.block_bytes if s.checksums else 0) for s in info.sources)
        key = (self._plan[0] if self._plan else None, blocks)
        if self._widening is None or self._widening[0] != key:
            sources = {s.source_id: s for s in info.sources}
            self._widening = (key, widen(requests, sources, plan.arena_bytes))
        return self._widening[1]


def region_edges(source: SourceInfo) -> list[int]:
    """Sorted start/end addresses of the source's registered regions (each tensor's own extent
    when the source did not say), where a merged read must be cut."""
    spans = source.regions or tuple((d.addr, d.nbytes) for d in source.tensors)
    return sorted({edge for addr, nbytes in spans for edge in (addr, addr + nbytes)})


def layout_key(info: VersionInfo, target: TargetLayout) -> int:
    """A fingerprint of everything a plan depends on (not the version number or NIXL metadata).

    The catalog stamps every source with a digest of its descriptors and regions, and the
    version with one of its sidecar: when all are there, the key is built from them, without
    walking every descriptor or re-encoding the sidecar. Otherwise (a VersionInfo built by
    hand, or an older catalog) every descriptor is walked.
    """
    if info.sidecar_digest and all(s.layout_digest for s in info.sources):
        digests = tuple((s.source_id, s.layout_digest) for s in info.sources)
        return hash((info.model, target, "digests", digests, info.sidecar_digest))
    sources = tuple(
        (s.source_id, s.regions, tuple(
            (d.name, d.dtype, d.global_shape, d.local_shape, d.addr, d.nbytes, d.role, d.shard_axis,
             d.shard_offset, d.mem_type, d.device_id, repr(d.extras) if d.extras else "",
             d.compile_target, repr(d.compile_metadata) if d.compile_metadata else "")
            for d in s.tensors
        ))
        for s in info.sources
    )
    return hash((info.model, target, sources, json.dumps(info.sidecar, sort_keys=True, default=str)))
