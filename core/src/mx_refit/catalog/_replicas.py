"""Replica sources (fan-out): the catalog's part, mixed into
:class:`~mx_refit.catalog.service.CatalogService`.

A replica is a receiver that republishes, in place, the bytes it pulled: every
:class:`~mx_refit.types.Mirror` says "I hold these bytes of trainer source S of this version at
this address". Replicas join a READY version without a mesh position and without counting in
``expected_sources``; they are offered (``VersionInfo.replicas``) while ready and not withdrawn.
A replica's death drops the replica, never the version. Leases name the sources they read from,
so that a replica can withdraw and wait until nobody reads it before it reuses its arena, and so
that a per-source cap on concurrent readers can be enforced at acquire time. The state lives in
:class:`~mx_refit.catalog._records.VersionRecord` (``replicas``, ``withdrawn``),
:class:`~mx_refit.catalog._records.LeaseRecord` (``sources``) and
:class:`~mx_refit.catalog._records.SourceLife` (``replica_of``).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from mx_refit.catalog.api import DEFAULT_TTL_S
from mx_refit.catalog.validation import check_int, check_name, check_seconds, validate_source
from mx_refit.errors import FailedPrecondition, InvalidArgument, SourcesBusy
from mx_refit.types import Mirror, SourceInfo, VersionState

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.catalog._records import SourceLife, VersionRecord
    from mx_refit.catalog.store.base import CatalogState, CatalogStore, Txn
    from mx_refit.catalog.validation import CatalogLimits

T = TypeVar("T")

__all__ = ["ReplicaCatalog", "check_lease_sources", "validate_mirrors"]


def _spans(source: SourceInfo) -> list[tuple[int, int]]:
    return sorted(source.regions or ((d.addr, d.nbytes) for d in source.tensors))


def _inside(spans: list[tuple[int, int]], addr: int, nbytes: int) -> bool:
    i = bisect.bisect_right(spans, (addr, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= addr and addr + nbytes <= spans[i][0] + spans[i][1]


def validate_mirrors(rec: VersionRecord, replica: SourceInfo, mirrors: object, limit: int) -> tuple[Mirror, ...]:
    """Every mirror names a trainer source of ``rec`` and lies inside one region of that source
    and one region of the replica; errors name the mirror and the value."""
    if isinstance(mirrors, (str, bytes)) or not isinstance(mirrors, Sequence) or not mirrors:
        raise InvalidArgument(f"source.mirrors: a replica needs a non-empty sequence of mirrors, got {mirrors!r}")
    if len(mirrors) > limit:
        raise InvalidArgument(f"source.mirrors: {len(mirrors)} mirrors exceed the limit of {limit}")
    own = _spans(replica)
    theirs: dict[str, list[tuple[int, int]]] = {}
    clean = []
    for i, m in enumerate(mirrors):
        field = f"source.mirrors[{i}]"
        if not isinstance(m, tuple) or len(m) != 4:
            raise InvalidArgument(f"{field}: expected a Mirror(source_id, source_addr, nbytes, addr), got {m!r}")
        sid = check_name(m[0], f"{field}.source_id")
        src_addr = check_int(m[1], f"{field}.source_addr", minimum=0)
        nbytes = check_int(m[2], f"{field}.nbytes", minimum=1)
        addr = check_int(m[3], f"{field}.addr", minimum=0)
        source = rec.sources.get(sid)
        if source is None:
            raise InvalidArgument(
                f"{field}.source_id: {sid!r} is not a trainer source of {rec.label} "
                f"(sources: {', '.join(sorted(rec.sources))})"
            )
        if sid not in theirs:
            theirs[sid] = _spans(source)
        if not _inside(theirs[sid], src_addr, nbytes):
            raise InvalidArgument(
                f"{field}: bytes {src_addr:#x}+{nbytes} lie outside the registered regions of source {sid!r}"
            )
        if not _inside(own, addr, nbytes):
            raise InvalidArgument(
                f"{field}.addr: bytes {addr:#x}+{nbytes} lie outside the replica's own regions"
            )
        clean.append(Mirror(sid, src_addr, nbytes, addr))
    return tuple(clean)


def check_lease_sources(rec: VersionRecord, sources: object, cap: object) -> tuple[tuple[str, ...], int]:
    """A lease's named sources (trainer sources or offered replicas) and reader cap, checked
    against the record; ``SourcesBusy`` when one is not offered or already at the cap."""
    if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence):
        raise InvalidArgument(f"sources: must be a sequence of source ids, got {sources!r}")
    names = tuple(sorted({check_name(s, f"sources[{i}]") for i, s in enumerate(sources)}))
    limit = check_int(cap, "max_readers_per_source", minimum=0)
    offered = {r.source_id for r in rec.offered_replicas()}
    gone = [s for s in names if s not in rec.sources and s not in offered]
    if gone:  # not InvalidArgument: a replica may have withdrawn or died since the reader looked
        raise SourcesBusy(
            f"sources: {', '.join(gone)} are not offered by {rec.label} (withdrawn, not ready, "
            "gone or never joined); nothing was leased"
        )
    if limit:
        counts = rec.reader_counts()
        full = [f"{s} ({counts[s]} readers)" for s in (names or tuple(rec.sources)) if counts.get(s, 0) >= limit]
        if full:
            raise SourcesBusy(
                f"max_readers_per_source: {', '.join(full)} of {rec.label} already serve {limit} "
                "concurrent readers; nothing was leased"
            )
    return names, limit


class ReplicaCatalog:
    """The replica methods of :class:`~mx_refit.catalog.service.CatalogService` (same lock,
    same records; see the module docstring)."""

    limits: CatalogLimits

    if TYPE_CHECKING:  # provided by CatalogCore
        @property
        def _st(self) -> CatalogState: ...
        def _txn(self, body: Callable[[float], T]) -> T: ...
        def _txn_now(self) -> Txn: ...
        def _generation(self) -> int: ...
        def _record_locked(self, model: object, version: object) -> VersionRecord: ...
        def _wait_until_unread(self, check: Callable[[float], tuple[bool, float, object]], deadline: float) -> bool: ...
        store: CatalogStore

    def register_replica(
        self, model: str, version: int, source: SourceInfo, ttl_s: float = DEFAULT_TTL_S
    ) -> None:
        """Offer ``source`` as a replica of the READY ``(model, version)``.

        ``source.mirrors`` say which trainer-source bytes it holds; ``source.tensors`` is its
        registered arena. Sent with ``ready=False`` it joins but is not offered until
        :meth:`mark_ready` (the copy must be complete and verified first). Re-sending the same
        registration is a no-op; a different one under a live replica's id is
        ``FailedPrecondition`` (withdraw it first). ``ttl_s``: renewed by :meth:`heartbeat`
        like a source; when it lapses the replica is dropped (the version stays READY).
        """
        validated = validate_source(source, self.limits)
        ttl = check_seconds(ttl_s, "ttl_s", maximum=self.limits.max_ttl_s)

        def body(now: float) -> None:
            clean = validated  # a store may run this again: start from the validated source
            rec = self._record_locked(model, version)
            sid = clean.source_id
            if sid in rec.sources:
                raise InvalidArgument(f"source.source_id: {sid!r} is a trainer source of {rec.label}, not a replica")
            if rec.state is not VersionState.READY:
                raise FailedPrecondition(f"{rec.label} is {rec.state.value}; only READY versions take replicas")
            mirrors = validate_mirrors(rec, clean, source.mirrors, self.limits.max_descriptors_per_source)
            # A replica's arena is rewritten once the catalog says its readers left; it makes
            # no promise for leases a catalog restart loses, so its readers wait for answers.
            clean = replace(clean, mirrors=mirrors, incarnation="", lease_fence_s=0.0, delta=None)
            old = rec.replicas.get(sid)
            if old is not None and sid not in rec.withdrawn:
                if replace(old, ready=clean.ready) != clean:
                    raise FailedPrecondition(
                        f"source.source_id: replica {sid!r} of {rec.label} is registered with other "
                        "contents; withdraw it first"
                    )
                clean = replace(clean, ready=old.ready or clean.ready)
            life = self._st.sources.get(sid)
            if life is not None and life.versions:
                raise InvalidArgument(f"source.source_id: {sid!r} is a live trainer source id; a replica needs its own")
            rec.withdrawn.discard(sid)
            rec.replicas[sid] = clean
            if life is None:
                from mx_refit.catalog._records import SourceLife

                life = SourceLife(ttl_s=ttl, expires_at=now + ttl, source_id=sid)
                self._st.sources[sid] = life
                self._st.deadlines.set(life, life.expires_at, new=True)
            else:
                life.ttl_s = ttl
                self._st.deadlines.set(life, now + ttl)
            life.replica_of.add((rec.model, rec.version))
            self._txn_now().notify()

        self._txn(body)

    def withdraw_replica(self, model: str, version: int, source_id: str, timeout_s: float) -> bool:
        """Stop offering a replica (no new lease may name it) and wait, bounded (real time),
        until no live lease reads it; then forget it and return True. Its owner may then
        overwrite its arena. A replica (or version) the catalog does not know is drained."""
        source_id = check_name(source_id, "source_id")
        timeout = check_seconds(timeout_s, "timeout_s", maximum=self.limits.max_wait_s, allow_zero=True)
        deadline = time.monotonic() + timeout

        def check(now: float) -> tuple[bool, float, object]:
            try:
                rec = self._record_locked(model, version)
            except LookupError:
                return True, 0.0, 0  # forgotten with its leases: nobody can read it
            if source_id not in rec.replicas:
                return True, 0.0, 0
            rec.withdrawn.add(source_id)
            reading = [lease for lease in rec.leases.values() if source_id in lease.sources]
            if not reading:
                self._drop_replica_locked(rec, source_id)
                return True, 0.0, 0
            next_expiry = min(lease.expires_at for lease in reading)
            return False, max(next_expiry - now, 0.001), self._generation()

        return self._wait_until_unread(check, deadline)

    def _drop_replica_locked(self, rec: VersionRecord, source_id: str) -> None:
        rec.replicas.pop(source_id, None)
        rec.withdrawn.discard(source_id)
        life = self._st.sources.get(source_id)
        if life is not None:
            life.replica_of.discard((rec.model, rec.version))
            if not life.replica_of and not life.versions:
                life.dead = True
                del self._st.sources[source_id]

    def _expire_replica_locked(self, life: SourceLife, models: dict[str, dict[int, VersionRecord]]) -> None:
        """A replica's TTL lapsed: it is no longer offered (its version lives on)."""
        for model, version in sorted(life.replica_of):
            rec = models.get(model, {}).get(version)
            if rec is not None:
                rec.replicas.pop(life.source_id, None)
                rec.withdrawn.discard(life.source_id)
        life.replica_of.clear()
