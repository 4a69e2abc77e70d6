"""``CatalogService``: the catalog's transport-agnostic, thread-safe state machine.

Per (model, version) the service records the expected number of sources, each registered source
(mesh position, NIXL agent name and metadata, tensor descriptors), the merged sidecar, the
lifecycle state and the live reader leases::

    PENDING --(all expected sources registered and ready)--> READY
    PENDING/READY --retire_version--> DRAINING --(no live lease)--> RETIRED
    PENDING/READY/DRAINING --(a source missed its heartbeats)--> EXPIRED

With ``expected_readers`` > 0 a version counts the distinct readers that released a lease with
``completed=True``; :meth:`CatalogService.wait_read` waits for them without retiring it, so a
trainer with no central driver waits first and retires second (never locking a reader out).

Every public method validates its whole request before it mutates anything, so a rejected call
leaves the catalog exactly as it was. TTLs use the injectable ``clock`` (seconds, monotonic);
expirations are applied lazily at the start of every call (from a deadline heap, so the cost is
proportional to what actually expired) and by :meth:`CatalogService.reap`, which the server's
reaper thread calls so that drain waiters wake up even when no other traffic arrives.

Returned :class:`~mx_refit.types.VersionInfo` objects share their descriptors with the catalog:
treat them as read-only (the sidecar is a fresh copy on every call). Every registered source is
stamped with a ``layout_digest`` and every version carries a ``sidecar_digest``
(:mod:`mx_refit.catalog.digests`), which let readers skip unchanged layouts.

Error choices: an expired lease is reported as ``NotFound`` (it is dropped when it expires, so
it is indistinguishable from a lease that never existed, and for a reader both mean "acquire a
new one"); state conflicts (leasing a version that is not READY, replacing a source of a version
that left PENDING) are ``FailedPrecondition`` naming the state; contradictions between a
request and what other sources registered (expected_sources, mesh position, tensor dtype/shape/
role, sidecar values) are ``InvalidArgument`` naming the field and both values.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mx_refit.catalog._records import (
    Deadlines,
    EndedLeases,
    LeaseRecord,
    Manifest,
    SourceLife,
    VersionRecord,
    check_tensors_agree,
    find_predecessor,
    index_tensors,
    republishable,
)
from mx_refit.catalog._replicas import ReplicaCatalog, check_lease_sources
from mx_refit.catalog.api import DEFAULT_TTL_S, LeasedVersion, ReadProgress, VersionSummary
from mx_refit.catalog.digests import Layout, stamp_layout
from mx_refit.catalog.validation import (
    CatalogLimits,
    check_incarnations,
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
from mx_refit.errors import FailedPrecondition, InvalidArgument, NotFound
from mx_refit.types import SourceInfo, VersionInfo, VersionState

__all__ = ["CatalogService", "ReapReport"]

_LIVE = (VersionState.PENDING, VersionState.READY, VersionState.DRAINING)
_TERMINAL = (VersionState.RETIRED, VersionState.EXPIRED)


@dataclass(frozen=True)
class ReapReport:
    """What one :meth:`CatalogService.reap` pass expired."""

    leases: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    versions: tuple[tuple[str, int], ...] = ()  # (model, version) marked EXPIRED


class CatalogService(ReplicaCatalog):
    """Thread-safe catalog state machine (see the module docstring and docs/design.md).

    :param clock: monotonic seconds used for every TTL (inject a fake clock in tests); waits in
        :meth:`wait_drained` always use real time for their timeout.
    :param limits: size and time bounds; requests beyond them raise ``InvalidArgument``.
    :param history: RETIRED/EXPIRED versions kept per model (for ``list_versions``); older
        ones without live leases are forgotten.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        limits: CatalogLimits | None = None,
        history: int = 4,
    ) -> None:
        if history < 0:
            raise ValueError(f"history must be >= 0, got {history}")
        self._clock = clock
        self.limits = limits or CatalogLimits()
        self._history = history
        self._cond = threading.Condition(threading.Lock())
        self._models: dict[str, dict[int, VersionRecord]] = {}
        self._sources: dict[str, SourceLife] = {}
        self._leases: dict[str, LeaseRecord] = {}
        self._deadlines = Deadlines()
        self._ended_leases = EndedLeases()
        # Each live source id's last registered layout: a republished identical layout reuses
        # its descriptor tuple and digest instead of being hashed again.
        self._layouts: dict[str, Layout] = {}

    def counts(self) -> dict[str, Any]:
        """Point-in-time sizes for monitoring: models, versions by state, live sources and leases."""
        with self._cond:
            by_state = {state.name: 0 for state in VersionState}
            for versions in self._models.values():
                for rec in versions.values():
                    by_state[rec.state.name] += 1
            return {"models": len(self._models), "versions": by_state, "sources": len(self._sources),
                    "leases": len(self._leases)}

    # --- publisher side -------------------------------------------------------------------

    def register_source(
        self,
        model: str,
        version: int,
        expected_sources: int,
        source: SourceInfo,
        sidecar: Mapping[str, Any] | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        expected_readers: int = 0,
    ) -> VersionState:
        """Register one source of ``(model, version)``; return the version's state afterwards.

        The first registration creates the version as PENDING. While PENDING, registering an
        already registered ``source_id`` replaces it (a restarted rank). Re-sending an identical
        registration is a no-op until the version is RETIRED or EXPIRED (safe to retry). A
        source sent with ``ready=True`` is registered and marked ready in one step. ``ttl_s``
        is how long the source stays alive without a heartbeat; when it lapses, every version
        it belongs to that is not yet RETIRED becomes EXPIRED. ``expected_readers`` (0: not
        tracked) is how many distinct readers :meth:`wait_read` waits for; like
        ``expected_sources`` it must agree across the version's registrations.
        """
        model = check_name(model, "model")
        version = check_int(version, "version", minimum=0)
        expected = check_int(expected_sources, "expected_sources", minimum=1)
        if expected > self.limits.max_expected_sources:
            raise InvalidArgument(
                f"expected_sources: {expected} exceeds the limit of "
                f"{self.limits.max_expected_sources}"
            )
        readers = check_int(expected_readers, "expected_readers", minimum=0)
        if readers > self.limits.max_expected_readers:
            raise InvalidArgument(
                f"expected_readers: {readers} exceeds the limit of "
                f"{self.limits.max_expected_readers}"
            )
        ttl = check_seconds(ttl_s, "ttl_s", maximum=self.limits.max_ttl_s)
        # Pure validation happens outside the lock: a 1M-descriptor manifest must not stall
        # heartbeats from every other rank.
        src = validate_source(source, self.limits)
        extra = validate_sidecar(sidecar, self.limits)
        sid = src.source_id
        with self._cond:
            previous = self._layouts.get(sid)
        src, layout = stamp_layout(src, previous)  # outside the lock, like validation
        with self._cond:
            now = self._reap_locked(self._clock())
            predecessor = find_predecessor(self._sources, src)
            rec = self._models.get(model, {}).get(version)
            if rec is not None and republishable(rec, predecessor):
                rec = None  # a dead version's number: published afresh
            if rec is None:
                rec = VersionRecord(model, version, expected, expected_readers=readers)
                is_new = True
            else:
                is_new = False
                if rec.expected_sources != expected:
                    raise InvalidArgument(
                        f"expected_sources: {expected} does not match {rec.expected_sources} "
                        f"registered earlier for {rec.label}"
                    )
                if rec.expected_readers != readers:
                    raise InvalidArgument(
                        f"expected_readers: {readers} does not match {rec.expected_readers} "
                        f"registered earlier for {rec.label}"
                    )
            old = rec.sources.get(sid)
            if (
                old is not None
                and predecessor is None
                and rec.state in _LIVE
                and self._same_registration(rec, old, src, extra)
            ):
                if src.ready and not old.ready and rec.state is VersionState.PENDING:
                    rec.sources[sid] = replace(old, ready=True)
                    self._maybe_ready_locked(rec)
                self._touch_source_locked(sid, ttl, now, rec)
                return rec.state
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
            others = [s for s in rec.sources.values() if s.source_id != sid]
            if old is None:
                index, merged = rec.tensors, rec.sidecar
            else:  # replacing: check against everyone except the previous incarnation
                index, merged = {}, {}
                for other in others:
                    index_tensors(index, other)
                    merge_sidecar(merged, rec.sidecars[other.source_id])
            check_tensors_agree(index, src)
            conflict = find_sidecar_conflict(merged, extra, sid)
            if conflict:
                raise InvalidArgument(conflict)

            # Everything checked: commit.
            if predecessor is not None:
                # A restarted rank: its predecessor's versions die with it (this one, if still
                # PENDING, keeps the other ranks' registrations and takes the new one).
                self._expire_source_locked(predecessor, spare=rec)
            if is_new:
                self._models.setdefault(model, {})[version] = rec
            rec.tensors, rec.sidecar = index, merged
            index_tensors(rec.tensors, src)
            merge_sidecar(rec.sidecar, extra)
            rec.sidecar_text = None
            rec.sources[sid] = src
            rec.sidecars[sid] = extra
            self._layouts[sid] = layout
            self._touch_source_locked(sid, ttl, now, rec, src.incarnation)
            self._maybe_ready_locked(rec)
            return rec.state

    def mark_ready(self, model: str, version: int, source_id: str) -> VersionState:
        """Mark a registered source ready; the version becomes READY once every expected source
        is registered and ready. Idempotent; returns the version's state afterwards."""
        source_id = check_name(source_id, "source_id")
        with self._cond:
            now = self._reap_locked(self._clock())
            rec = self._record_locked(model, version)
            src = rec.sources.get(source_id)
            replica = rec.replicas.get(source_id)
            if src is None and replica is not None and source_id not in rec.withdrawn:
                rec.replicas[source_id] = replace(replica, ready=True)  # offered from now on
                return rec.state
            if src is None:
                raise NotFound(
                    f"source_id: {source_id!r} is not registered for {rec.label} "
                    f"(registered: {', '.join(sorted(rec.sources)) or 'none'})"
                )
            if rec.state is VersionState.PENDING:
                rec.sources[source_id] = replace(src, ready=True)
                self._maybe_ready_locked(rec)
            elif rec.state is not VersionState.READY:
                raise FailedPrecondition(
                    f"{rec.label} is {rec.state.value}; source {source_id!r} cannot be marked ready"
                )
            life = self._sources.get(source_id)
            if life is not None:  # a sign of life: renew
                self._deadlines.set(life, now + life.ttl_s)
            return rec.state

    def heartbeat(
        self,
        source_ids: Sequence[str] = (),
        lease_ids: Sequence[str] = (),
        incarnations: Mapping[str, str] | None = None,
    ) -> None:
        """Renew sources and leases by their own TTLs.

        All or nothing: if any id is unknown (never registered, or already expired) nothing is
        renewed and ``NotFound`` lists every unknown id and why — the caller's sources/leases
        are gone and must be re-registered/re-acquired. ``incarnations`` maps source ids to the
        incarnation the caller registered them with: a source now held by another incarnation
        (the caller was replaced by a restarted rank) is ``FailedPrecondition``.
        """
        sources = _ids(source_ids, "source_ids")
        leases = _ids(lease_ids, "lease_ids")
        claimed = check_incarnations(incarnations)
        with self._cond:
            now = self._reap_locked(self._clock())
            replaced = [
                f"{sid!r} (registered by incarnation {self._sources[sid].incarnation!r}, "
                f"not {claimed[sid]!r})"
                for sid in sources
                if sid in claimed and sid in self._sources
                and self._sources[sid].incarnation not in ("", claimed[sid])
            ]
            if replaced:
                raise FailedPrecondition(
                    f"heartbeat: source_ids {', '.join(replaced)} were replaced by a restarted "
                    "rank; nothing was renewed"
                )
            missing_sources = [s for s in sources if s not in self._sources]
            missing_leases = [s for s in leases if s not in self._leases]
            if missing_sources or missing_leases:
                parts = []
                if missing_sources:
                    parts.append(f"source_ids {missing_sources}")
                if missing_leases:
                    why = "; ".join(self._ended_leases.why_gone(lease, now) for lease in missing_leases)
                    parts.append(f"lease_ids {missing_leases} ({why})")
                raise NotFound(
                    f"heartbeat: unknown or expired {' and '.join(parts)}; nothing was renewed"
                )
            for timed in [*(self._sources[s] for s in sources), *(self._leases[s] for s in leases)]:
                self._deadlines.set(timed, now + timed.ttl_s)

    def retire_version(self, model: str, version: int) -> VersionState:
        """Stop offering a version: no new leases from now on. Idempotent.

        PENDING and READY versions become DRAINING, and RETIRED as soon as no live lease
        remains (immediately when there is none). DRAINING, RETIRED and EXPIRED versions are
        left as they are. Returns the state afterwards.
        """
        with self._cond:
            self._reap_locked(self._clock())
            rec = self._record_locked(model, version)
            if rec.state in (VersionState.PENDING, VersionState.READY):
                rec.state = VersionState.DRAINING
                self._settle_locked(rec)
            return rec.state

    def wait_drained(self, model: str, version: int, timeout_s: float) -> bool:
        """Block until a retired (or expired) version has no live lease; False on timeout.

        A lease stops counting when it is released or its TTL lapses. On True the version is
        RETIRED (or stays EXPIRED) and its buffers may be mutated. ``timeout_s`` is real time,
        bounded by ``limits.max_wait_s``. Raises ``FailedPrecondition`` for a PENDING or READY
        version (retire it first: otherwise new leases could arrive while waiting).
        """
        timeout = check_seconds(
            timeout_s, "timeout_s", maximum=self.limits.max_wait_s, allow_zero=True
        )
        deadline = time.monotonic() + timeout
        with self._cond:
            self._reap_locked(self._clock())
            rec = self._record_locked(model, version)
            if rec.state in (VersionState.PENDING, VersionState.READY):
                raise FailedPrecondition(
                    f"{rec.label} is {rec.state.value}; retire it before waiting for it to drain"
                )
            while holding := rec.trainer_leases():  # replica-only readers do not hold it up
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # Wake at the next lease expiry too (exact with a real clock); releases and the
                # reaper notify the condition.
                next_expiry = min(lease.expires_at for lease in holding)
                self._cond.wait(min(remaining, max(next_expiry - self._clock(), 0.001)))
                self._reap_locked(self._clock())
            return True

    # --- reader side ----------------------------------------------------------------------

    def get_version(
        self, model: str, version: int | None = None, min_version: int = 0
    ) -> VersionInfo:
        """Return the newest READY version ``>= min_version``, or exactly ``version``.

        ``NotFound`` when the model, the version, or any READY version ``>= min_version`` is
        unknown; ``FailedPrecondition`` (naming the state) when an exact version exists but is
        not READY.
        """
        return self.get_manifest(model, version, min_version).version_info()

    def get_manifest(
        self, model: str, version: int | None = None, min_version: int = 0
    ) -> Manifest:
        """:meth:`get_version` for transports: the sidecar stays canonical JSON text, with the
        version's digests, so a server can send it (or leave it out) without decoding it."""
        version, min_version = _check_lookup(version, min_version)
        with self._cond:
            self._reap_locked(self._clock())
            return self._ready_record_locked(model, version, min_version).manifest()

    def inspect_version(self, model: str, version: int) -> VersionInfo:
        """A version's manifest in whatever state it is (diagnostics; readers use
        :meth:`get_version`, which only offers READY versions)."""
        with self._cond:
            self._reap_locked(self._clock())
            manifest = self._record_locked(model, version).manifest()
        return manifest.version_info()

    def list_versions(self, model: str) -> list[VersionSummary]:
        """Summaries of the versions of ``model`` the catalog remembers, oldest first.

        A model that was never published (or fully forgotten) yields an empty list rather than
        ``NotFound``: "no versions" is a valid answer to a listing.
        """
        model = check_name(model, "model")
        with self._cond:
            self._reap_locked(self._clock())
            return [
                VersionSummary(
                    model=rec.model,
                    version=rec.version,
                    state=rec.state,
                    expected_sources=rec.expected_sources,
                    registered_sources=len(rec.sources),
                    ready_sources=sum(s.ready for s in rec.sources.values()),
                    leases=len(rec.leases),
                    expected_readers=rec.expected_readers,
                    completed_reads=len(rec.completed_readers),
                )
                for _, rec in sorted(self._models.get(model, {}).items())
            ]

    def acquire_lease(
        self,
        model: str,
        version: int,
        reader_id: str,
        ttl_s: float = DEFAULT_TTL_S,
        lease_id: str | None = None,
        sources: Sequence[str] = (),
        max_readers_per_source: int = 0,
    ) -> str:
        """Lease a READY version for ``reader_id``; return the lease id.

        While a lease is live the publisher's ``wait_drained`` blocks, so the source buffers stay
        intact. Renew it with :meth:`heartbeat` within ``ttl_s``. A caller-chosen ``lease_id``
        makes the call idempotent (a retry renews and returns the same lease).

        Fan-out: ``sources`` names what the reader reads from (trainer sources and offered
        replicas; empty: every trainer source). A lease naming only replicas does not hold up
        the trainer's drain; a replica's withdrawal waits for the leases naming it.
        ``max_readers_per_source`` > 0 refuses the lease (``SourcesBusy``, nothing leased) when
        a named source already has that many live leases reading it.
        """
        reader_id = check_name(reader_id, "reader_id")
        ttl = check_seconds(ttl_s, "ttl_s", maximum=self.limits.max_ttl_s)
        if lease_id is not None:
            lease_id = check_name(lease_id, "lease_id")
        with self._cond:
            now = self._reap_locked(self._clock())
            rec = self._record_locked(model, version)
            return self._lease_locked(rec, reader_id, ttl, lease_id, now, sources, max_readers_per_source)

    def lease_version(
        self,
        model: str,
        reader_id: str,
        version: int | None = None,
        min_version: int = 0,
        ttl_s: float = DEFAULT_TTL_S,
        lease_id: str | None = None,
    ) -> LeasedVersion:
        """:meth:`get_version` and :meth:`acquire_lease` in one atomic step: the exact READY
        ``version`` or the newest READY one >= ``min_version``, leased for ``reader_id`` (a
        lease naming no sources: every trainer source, as readers without fan-out take).

        A retry with the same ``lease_id`` renews that lease and answers its version again,
        even when a newer version turned READY in between.
        """
        manifest, leased = self.lease_manifest(model, reader_id, version, min_version, ttl_s, lease_id)
        return LeasedVersion(manifest.version_info(), leased)

    def lease_manifest(
        self,
        model: str,
        reader_id: str,
        version: int | None = None,
        min_version: int = 0,
        ttl_s: float = DEFAULT_TTL_S,
        lease_id: str | None = None,
    ) -> tuple[Manifest, str]:
        """:meth:`lease_version` for transports: the manifest as :meth:`get_manifest` gives it,
        and the lease id."""
        version, min_version = _check_lookup(version, min_version)
        reader_id = check_name(reader_id, "reader_id")
        ttl = check_seconds(ttl_s, "ttl_s", maximum=self.limits.max_ttl_s)
        if lease_id is not None:
            lease_id = check_name(lease_id, "lease_id")
        with self._cond:
            now = self._reap_locked(self._clock())
            existing = self._leases.get(lease_id) if lease_id else None
            held = existing.record if existing is not None else None
            if held is not None and held.model == model and version in (None, held.version):
                rec = held  # a retry: the version this lease was taken on
            else:
                rec = self._ready_record_locked(model, version, min_version)
            return rec.manifest(), self._lease_locked(rec, reader_id, ttl, lease_id, now, (), 0)

    def _lease_locked(
        self,
        rec: VersionRecord,
        reader_id: str,
        ttl: float,
        lease_id: str | None,
        now: float,
        sources: Sequence[str],
        max_readers_per_source: int,
    ) -> str:
        existing = self._leases.get(lease_id) if lease_id else None
        if existing is not None:
            if existing.record is not rec or existing.reader_id != reader_id:
                held = existing.record
                raise InvalidArgument(
                    f"lease_id: {lease_id!r} is already held by reader {existing.reader_id!r} "
                    f"on {held.label if held else 'another version'}"
                )
            existing.ttl_s = ttl
            self._deadlines.set(existing, now + ttl)
            return existing.lease_id
        if rec.state is not VersionState.READY:
            raise FailedPrecondition(
                f"{rec.label} is {rec.state.value}; only READY versions can be leased"
            )
        names, _ = check_lease_sources(rec, sources, max_readers_per_source)
        lease = LeaseRecord(
            ttl_s=ttl,
            expires_at=now + ttl,
            lease_id=lease_id or uuid.uuid4().hex,
            reader_id=reader_id,
            record=rec,
            sources=names,
        )
        self._leases[lease.lease_id] = lease
        rec.leases[lease.lease_id] = lease
        self._deadlines.set(lease, lease.expires_at, new=True)
        return lease.lease_id

    def release_lease(self, lease_id: str, completed: bool = False) -> None:
        """Release a live lease. Releasing it again is a no-op (a retry after a lost reply).

        ``NotFound`` when the lease expired (its TTL ran out) or is unknown to this catalog
        (never acquired here, or the catalog restarted since): in both cases the lease was not
        held until now, and a reader must not trust what it pulled under it.

        ``completed=True``: the reader pulled every byte it needed, so its reader id counts as a
        completed read of the version (once). An expired lease counts nothing.
        """
        lease_id = check_name(lease_id, "lease_id")
        if not isinstance(completed, bool):
            raise InvalidArgument(f"completed: must be a bool, got {completed!r}")
        with self._cond:
            now = self._reap_locked(self._clock())
            lease = self._leases.get(lease_id)
            if lease is None:
                if self._ended_leases.released(lease_id):
                    return
                raise NotFound(
                    f"lease_id: unknown or expired lease {lease_id!r} "
                    f"({self._ended_leases.why_gone(lease_id, now)})"
                )
            if completed and lease.record is not None:
                lease.record.completed_readers.add(lease.reader_id)
            self._drop_lease_locked(lease, "released", now)  # notifies wait_read and wait_drained waiters

    def wait_read(self, model: str, version: int, timeout_s: float) -> ReadProgress:
        """Block (bounded, real time) until every expected reader completed a read of
        ``version``; the progress says whether they did. Never retires the version.

        ``FailedPrecondition`` when the version has no expected readers, or expired before
        they all completed (nobody can lease it any more).
        """
        timeout = check_seconds(
            timeout_s, "timeout_s", maximum=self.limits.max_wait_s, allow_zero=True
        )
        deadline = time.monotonic() + timeout
        with self._cond:
            self._reap_locked(self._clock())
            rec = self._record_locked(model, version)
            if rec.expected_readers == 0:
                raise FailedPrecondition(
                    f"{rec.label} was registered without expected_readers; reads are not counted"
                )
            while not (progress := rec.read_progress()).done:
                if rec.state is VersionState.EXPIRED and not rec.leases:
                    raise FailedPrecondition(
                        f"{rec.label} is EXPIRED with {progress.describe()}; the rest can "
                        "never read it"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)  # releases, expiries and the reaper notify
                self._reap_locked(self._clock())
            return progress

    # --- maintenance ----------------------------------------------------------------------

    def reap(self) -> ReapReport:
        """Expire every lease and source whose TTL has lapsed; wake drain waiters."""
        with self._cond:
            report: dict[str, list[Any]] = {"leases": [], "sources": [], "versions": []}
            self._reap_locked(self._clock(), report)
            return ReapReport(
                leases=tuple(report["leases"]),
                sources=tuple(report["sources"]),
                versions=tuple(report["versions"]),
            )

    # --- internals (all called with the lock held) ---------------------------------------

    def _ready_record_locked(self, model: str, version: int | None, min_version: int) -> VersionRecord:
        """The exact READY ``version``, or the newest READY one >= ``min_version`` (checked)."""
        if version is not None:
            rec = self._record_locked(model, version)
            if rec.state is not VersionState.READY:
                raise FailedPrecondition(f"{rec.label} is {rec.state.value}, not READY")
        else:
            versions = self._versions_locked(model)
            ready = [
                r
                for r in versions.values()
                if r.state is VersionState.READY and r.version >= min_version
            ]
            if not ready:
                known = ", ".join(
                    f"{v} {versions[v].state.value}" for v in sorted(versions)[-8:]
                )
                raise NotFound(
                    f"model {model!r} has no READY version >= {min_version} "
                    f"(known: {known or 'none'})"
                )
            rec = max(ready, key=lambda r: r.version)
        return rec

    def _versions_locked(self, model: object) -> dict[int, VersionRecord]:
        model = check_name(model, "model")
        versions = self._models.get(model)
        if versions is None:
            known = ", ".join(sorted(self._models)[:8])
            raise NotFound(f"model: unknown model {model!r} (known: {known or 'none'})")
        return versions

    def _record_locked(self, model: object, version: object) -> VersionRecord:
        version = check_int(version, "version", minimum=0)
        versions = self._versions_locked(model)
        rec = versions.get(version)
        if rec is None:
            known = ", ".join(str(v) for v in sorted(versions)[-8:])
            raise NotFound(
                f"version: model {model!r} has no version {version} (known: {known or 'none'})"
            )
        return rec

    @staticmethod
    def _same_registration(
        rec: VersionRecord, old: SourceInfo, new: SourceInfo, sidecar: dict[str, Any]
    ) -> bool:
        # Digests first: type-strict on extras, and cheap to compare.
        return (
            new.layout_digest == old.layout_digest
            and replace(new, ready=old.ready) == old
            and same_json(rec.sidecars[old.source_id], sidecar)
        )

    def _maybe_ready_locked(self, rec: VersionRecord) -> None:
        if (
            rec.state is VersionState.PENDING
            and len(rec.sources) == rec.expected_sources
            and all(s.ready for s in rec.sources.values())
        ):
            rec.state = VersionState.READY
            # Encode and hash the sidecar now, on the publisher's call: otherwise the first
            # reader of every version pays it inside its refit (14 ms for a 2,400-tensor MoE).
            rec.manifest()

    def _touch_source_locked(
        self, source_id: str, ttl: float, now: float, rec: VersionRecord, incarnation: str = ""
    ) -> None:
        life = self._sources.get(source_id)
        if life is None:
            life = SourceLife(
                ttl_s=ttl, expires_at=now + ttl, source_id=source_id, incarnation=incarnation
            )
            self._sources[source_id] = life
            self._deadlines.set(life, life.expires_at, new=True)
        else:
            life.ttl_s = ttl
            life.incarnation = life.incarnation or incarnation
            self._deadlines.set(life, now + ttl)
        life.versions.add((rec.model, rec.version))

    def _reap_locked(self, now: float, report: dict[str, list[Any]] | None = None) -> float:
        for timed in self._deadlines.expired(now):
            if isinstance(timed, LeaseRecord):
                self._drop_lease_locked(timed, "expired", timed.expires_at)
                if report is not None:
                    report["leases"].append(timed.lease_id)
            elif isinstance(timed, SourceLife):
                expired = self._expire_source_locked(timed)
                if report is not None:
                    report["sources"].append(timed.source_id)
                    report["versions"].extend(expired)
        return now

    def _expire_source_locked(
        self, life: SourceLife, spare: VersionRecord | None = None
    ) -> list[tuple[str, int]]:
        """The source's process is gone: every live version it serves is EXPIRED (except
        ``spare``, a PENDING version its successor is registering into)."""
        life.dead = True
        del self._sources[life.source_id]
        self._layouts.pop(life.source_id, None)
        self._expire_replica_locked(life, self._models)
        expired = []
        for model, version in sorted(life.versions):
            rec = self._models.get(model, {}).get(version)
            if rec is None or life.source_id not in rec.sources:
                continue  # that number was published afresh without this source
            if rec is spare and rec.state is VersionState.PENDING:
                continue
            if rec.state in _LIVE:
                rec.state = VersionState.EXPIRED
                expired.append((model, version))
                self._prune_locked(model)
        if expired:
            self._cond.notify_all()
        return expired

    def _drop_lease_locked(self, lease: LeaseRecord, how: str, at: float) -> None:
        lease.dead = True
        del self._leases[lease.lease_id]
        self._ended_leases.add(lease, how, at)
        rec = lease.record
        if rec is not None:
            rec.leases.pop(lease.lease_id, None)
            self._settle_locked(rec)

    def _settle_locked(self, rec: VersionRecord) -> None:
        """DRAINING with no live lease is RETIRED; wake waiters; forget old versions."""
        if rec.state is VersionState.DRAINING and not rec.trainer_leases():
            rec.state = VersionState.RETIRED
        if rec.state in _TERMINAL:
            self._prune_locked(rec.model)
        self._cond.notify_all()

    def _prune_locked(self, model: str) -> None:
        versions = self._models.get(model)
        if not versions:
            return
        terminal = sorted(v for v, r in versions.items() if r.state in _TERMINAL)
        excess = len(terminal) - self._history
        for version in terminal:
            if excess <= 0:
                break
            rec = versions[version]
            if rec.leases:  # an EXPIRED version still being read: keep it until its leases end
                continue
            del versions[version]
            excess -= 1
            for source_id in rec.sources:
                life = self._sources.get(source_id)
                if life is not None:
                    life.versions.discard((model, version))
            for source_id in list(rec.replicas):
                self._drop_replica_locked(rec, source_id)
        if not versions:
            del self._models[model]


def _check_lookup(version: int | None, min_version: int) -> tuple[int | None, int]:
    """Checked ``version`` and ``min_version`` of a READY-version lookup."""
    min_version = check_int(min_version, "min_version", minimum=0)
    if version is not None:
        version = check_int(version, "version", minimum=0)
        if version < min_version:
            raise InvalidArgument(f"version: {version} is below min_version {min_version}")
    return version, min_version


def _ids(values: Iterable[str], field: str) -> list[str]:
    if isinstance(values, (str, bytes)):
        # A bare string would iterate as characters: almost certainly a missing [...].
        raise InvalidArgument(f"{field}: must be a sequence of ids, got the string {values!r}")
    return [check_name(value, f"{field}[{i}]") for i, value in enumerate(values)]
