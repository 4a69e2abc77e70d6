"""A trainer source's registration: the rules of
:meth:`~mx_refit.catalog.service.CatalogService.register_source`, in its three steps.

1. Validate: :func:`validate_registration` checks the request on its own, outside the store
   call (a 1M-descriptor manifest must not stall the heartbeats of every other rank).
2. Conflicts: inside the store call, :func:`version_to_join` finds the version the source joins
   and :func:`check_conflicts` checks the source against the version's other sources, mutating
   nothing (:func:`is_repeat` recognises a retried registration first).
3. Commit: ``CatalogService._commit_registration_locked`` writes what step 2 checked.

Steps 1 and 2 raise before step 3 writes anything, so a rejected registration leaves the
catalog exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from mx_refit.catalog._records import SourceLife, TensorIndex, VersionRecord, index_tensors
from mx_refit.catalog._transitions import LIVE
from mx_refit.catalog.digests import Layout, stamp_layout
from mx_refit.catalog.validation import (
    CatalogLimits,
    check_int,
    check_name,
    check_seconds,
    describe_mesh,
    find_sidecar_conflict,
    merge_sidecar,
    same_json,
    validate_sidecar,
    validate_source,
)
from mx_refit.errors import FailedPrecondition, InvalidArgument
from mx_refit.types import SourceInfo, VersionState

__all__ = [
    "Registration",
    "check_conflicts",
    "check_tensors_agree",
    "find_predecessor",
    "is_repeat",
    "republishable",
    "validate_registration",
    "version_to_join",
]

@dataclass(frozen=True)
class Registration:
    """A validated ``register_source`` request."""

    model: str
    version: int
    expected_sources: int
    expected_readers: int
    ttl_s: float
    source: SourceInfo  # normalised, and stamped with its layout digest
    sidecar: dict[str, Any]
    layout: Layout

    @property
    def source_id(self) -> str:
        return self.source.source_id


# --- 1. validate (outside the store call) -----------------------------------------------------


def validate_registration(
    limits: CatalogLimits,
    model: str,
    version: int,
    expected_sources: int,
    source: SourceInfo,
    sidecar: Mapping[str, Any] | None,
    ttl_s: float,
    expected_readers: int,
    last_layout: Callable[[str], Layout | None],
) -> Registration:
    """The request checked field by field (``InvalidArgument`` naming the first bad one), its
    source stamped with its layout digest (reusing ``last_layout(source_id)``, the id's last
    registered layout, when unchanged)."""
    model = check_name(model, "model")
    version = check_int(version, "version", minimum=0)
    expected = check_int(expected_sources, "expected_sources", minimum=1)
    if expected > limits.max_expected_sources:
        raise InvalidArgument(
            f"expected_sources: {expected} exceeds the limit of {limits.max_expected_sources}"
        )
    readers = check_int(expected_readers, "expected_readers", minimum=0)
    if readers > limits.max_expected_readers:
        raise InvalidArgument(
            f"expected_readers: {readers} exceeds the limit of {limits.max_expected_readers}"
        )
    ttl = check_seconds(ttl_s, "ttl_s", maximum=limits.max_ttl_s)
    src = validate_source(source, limits)
    extra = validate_sidecar(sidecar, limits)
    src, layout = stamp_layout(src, last_layout(src.source_id))
    return Registration(model, version, expected, readers, ttl, src, extra, layout)


# --- 2. conflicts (inside the store call, mutating nothing) -----------------------------------


def find_predecessor(sources: dict[str, SourceLife], src: SourceInfo) -> SourceLife | None:
    """The live registration of ``src.source_id`` by another process, which ``src`` (a
    restarted rank) replaces; None when there is none or either incarnation is unknown."""
    life = sources.get(src.source_id)
    if life is None or not life.incarnation or not src.incarnation:
        return None
    return life if life.incarnation != src.incarnation else None


def republishable(rec: VersionRecord, predecessor: SourceLife | None) -> bool:
    """Whether ``rec``'s version number may be published afresh: it EXPIRED (a source died),
    or a restarted rank's predecessor served it and it left PENDING."""
    if rec.state is VersionState.EXPIRED:
        return True
    return (
        predecessor is not None
        and rec.state is not VersionState.PENDING
        and predecessor.source_id in rec.sources
    )


def version_to_join(
    models: Mapping[str, Mapping[int, VersionRecord]], reg: Registration, predecessor: SourceLife | None
) -> tuple[VersionRecord, bool]:
    """The version ``reg`` joins and whether it is new (not yet in ``models``): the registered
    one, which must expect what ``reg`` expects, or a fresh PENDING one when the number is
    unused or :func:`republishable`."""
    rec = models.get(reg.model, {}).get(reg.version)
    if rec is None or republishable(rec, predecessor):
        return VersionRecord(reg.model, reg.version, reg.expected_sources, expected_readers=reg.expected_readers), True
    if rec.expected_sources != reg.expected_sources:
        raise InvalidArgument(
            f"expected_sources: {reg.expected_sources} does not match {rec.expected_sources} "
            f"registered earlier for {rec.label}"
        )
    if rec.expected_readers != reg.expected_readers:
        raise InvalidArgument(
            f"expected_readers: {reg.expected_readers} does not match {rec.expected_readers} "
            f"registered earlier for {rec.label}"
        )
    return rec, False


def is_repeat(rec: VersionRecord, old: SourceInfo, reg: Registration, predecessor: SourceLife | None) -> bool:
    """Whether ``reg`` re-sends ``old``, its source's registration in the live ``rec`` (a
    retry: a no-op, apart from readiness and the source's TTL)."""
    if predecessor is not None or rec.state not in LIVE:
        return False
    # Digests first: type-strict on extras, and cheap to compare.
    return (
        reg.source.layout_digest == old.layout_digest
        and replace(reg.source, ready=old.ready) == old
        and same_json(rec.sidecars[old.source_id], reg.sidecar)
    )


def check_tensors_agree(index: TensorIndex, source: SourceInfo) -> None:
    """Ranks holding shards of the same tensor must agree on what the full tensor is."""
    for i, desc in enumerate(source.tensors):
        known = index.get(desc.name)
        if known is None:
            continue
        for attr, old in zip(("dtype", "global_shape", "role"), known[:3], strict=True):
            new = getattr(desc, attr)
            if new != old:
                show = (lambda v: v.value) if attr == "role" else repr
                raise InvalidArgument(
                    f"source.tensors[{i}].{attr}: {show(new)} for tensor {desc.name!r} disagrees "
                    f"with {show(old)} registered by source {known[3]!r}"
                )


def check_conflicts(rec: VersionRecord, reg: Registration, old: SourceInfo | None) -> tuple[TensorIndex, dict[str, Any]]:
    """Check that ``reg`` may add (``old`` None) or replace ``old`` in ``rec``: the version is
    PENDING, has room, no other source holds its mesh position, and its tensors and sidecar
    agree with the other sources'. Returns the tensor index and merged sidecar of the other
    sources, for the commit to extend (``rec``'s own when adding: nothing is copied)."""
    sid, src = reg.source_id, reg.source
    if rec.state is not VersionState.PENDING:
        what = "replaced" if old is not None else "added"
        raise FailedPrecondition(
            f"{rec.label} is {rec.state.value}; source {sid!r} cannot be {what} "
            "(sources change only while PENDING)"
        )
    if old is None and len(rec.sources) >= rec.expected_sources:
        raise InvalidArgument(
            f"expected_sources: {rec.label} already has all {rec.expected_sources} "
            f"expected sources ({', '.join(sorted(rec.sources))}); "
            f"{sid!r} is not one of them"
        )
    for other in rec.sources.values():
        if other.source_id != sid and other.mesh == src.mesh:
            raise InvalidArgument(
                f"source.mesh: position ({describe_mesh(src.mesh)}) of source {sid!r} is "
                f"already held by source {other.source_id!r} of {rec.label}"
            )
    if old is None:
        index, merged = rec.tensors, rec.sidecar
    else:  # replacing: check against everyone except the previous incarnation
        index, merged = {}, {}
        for other in rec.sources.values():
            if other.source_id != sid:
                index_tensors(index, other)
                merge_sidecar(merged, rec.sidecars[other.source_id])
    check_tensors_agree(index, src)
    conflict = find_sidecar_conflict(merged, reg.sidecar, sid)
    if conflict:
        raise InvalidArgument(conflict)
    return index, merged
