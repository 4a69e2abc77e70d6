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

Where the parts live: this module holds the public calls; :mod:`._registration` the rules of
:meth:`CatalogService.register_source` (validate, conflicts; the commit is here);
:mod:`._transitions` (``CatalogCore``) the store calls and the transitions every call shares
(TTL reaping, expiry, leases, draining, pruning); :mod:`._replicas` (``ReplicaCatalog``) the
fan-out replicas; :mod:`._records` the records and the deadline heap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mx_refit.catalog._records import Manifest, SourceLife, TensorIndex, VersionRecord, index_tensors
from mx_refit.catalog._registration import (
    Registration,
    check_conflicts,
    find_predecessor,
    is_repeat,
    validate_registration,
    version_to_join,
)
from mx_refit.catalog._replicas import ReplicaCatalog
from mx_refit.catalog._transitions import CatalogCore, check_ids, check_lookup
from mx_refit.catalog.api import DEFAULT_TTL_S, LeasedVersion, ReadProgress, VersionSummary
from mx_refit.catalog.digests import Layout
from mx_refit.catalog.store.base import Txn
from mx_refit.catalog.validation import (
    check_incarnations,
    check_name,
    check_seconds,
    merge_sidecar,
)
from mx_refit.checks import check_flag
from mx_refit.errors import FailedPrecondition, NotFound
from mx_refit.types import SourceInfo, VersionInfo, VersionState

__all__ = ["CatalogService", "ReapReport"]



@dataclass(frozen=True)
class ReapReport:
    """What one :meth:`CatalogService.reap` pass expired."""

    leases: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    versions: tuple[tuple[str, int], ...] = ()  # (model, version) marked EXPIRED


class CatalogService(ReplicaCatalog, CatalogCore):
    """Thread-safe catalog state machine (see the module docstring and docs/design.md).

    :param clock: monotonic seconds used for every TTL (inject a fake clock in tests); waits in
        :meth:`wait_drained` always use real time for their timeout.
    :param limits: size and time bounds; requests beyond them raise ``InvalidArgument``.
    :param history: RETIRED/EXPIRED versions kept per model (for ``list_versions``); older
        ones without live leases are forgotten.
    """

    def counts(self) -> dict[str, Any]:
        """Point-in-time sizes for monitoring: models, versions by state, live sources and leases."""

        def body(now: float) -> dict[str, Any]:
            by_state = {state.name: 0 for state in VersionState}
            for versions in self._st.models.values():
                for rec in versions.values():
                    by_state[rec.state.name] += 1
            return {"models": len(self._st.models), "versions": by_state,
                    "sources": len(self._st.sources), "leases": len(self._st.leases)}

        return self._txn(body)

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
        reg = validate_registration(self.limits, model, version, expected_sources, source, sidecar, ttl_s,
                                    expected_readers, self._last_layout)  # outside the lock
        return self._txn(lambda now: self._register_locked(reg, now))

    def _last_layout(self, source_id: str) -> Layout | None:
        return self.store.run(lambda txn: txn.state.layouts.get(source_id))

    def _register_locked(self, reg: Registration, now: float) -> VersionState:
        """Steps 2 and 3 of a registration (:mod:`mx_refit.catalog._registration`): find its
        version and check it against the other sources, then commit it."""
        predecessor = find_predecessor(self._st.sources, reg.source)
        rec, is_new = version_to_join(self._st.models, reg, predecessor)
        old = rec.sources.get(reg.source_id)
        if old is not None and is_repeat(rec, old, reg, predecessor):
            if reg.source.ready and not old.ready and rec.state is VersionState.PENDING:
                rec.sources[reg.source_id] = replace(old, ready=True)
                self._maybe_ready_locked(rec)
            self._touch_source_locked(reg.source_id, reg.ttl_s, now, rec)
            return rec.state
        index, merged = check_conflicts(rec, reg, old)
        self._commit_registration_locked(reg, rec, is_new, predecessor, (index, merged), now)
        return rec.state

    def _commit_registration_locked(
        self,
        reg: Registration,
        rec: VersionRecord,
        is_new: bool,
        predecessor: SourceLife | None,
        checked: tuple[TensorIndex, dict[str, Any]],
        now: float,
    ) -> None:
        """Write ``reg`` into ``rec`` (inserting ``rec`` when new), the tensor index and sidecar
        it was ``checked`` against extended with its own."""
        if predecessor is not None:
            # A restarted rank: its predecessor's versions die with it (this one, if still
            # PENDING, keeps the other ranks' registrations and takes the new one).
            self._expire_source_locked(predecessor, spare=rec)
        if is_new:
            rec.epoch = self._st.epoch
            self._st.models.setdefault(reg.model, {})[reg.version] = rec
        sid, src = reg.source_id, reg.source
        rec.tensors, rec.sidecar = checked
        index_tensors(rec.tensors, src)
        merge_sidecar(rec.sidecar, reg.sidecar)
        rec.sidecar_text = None
        rec.sources[sid] = src
        rec.sidecars[sid] = reg.sidecar
        self._st.layouts[sid] = reg.layout
        self._touch_source_locked(sid, reg.ttl_s, now, rec, src.incarnation)
        self._maybe_ready_locked(rec)

    def mark_ready(self, model: str, version: int, source_id: str) -> VersionState:
        """Mark a registered source ready; the version becomes READY once every expected source
        is registered and ready. Idempotent; returns the version's state afterwards."""
        source_id = check_name(source_id, "source_id")
        def body(now: float) -> Any:
            rec = self._record_locked(model, version)
            src = rec.sources.get(source_id)
            replica = rec.replicas.get(source_id)
            if src is None and replica is not None and source_id not in rec.withdrawn:
                rec.replicas[source_id] = replace(replica, ready=True)  # offered from now on
                self._txn_now().notify()
                return rec.state
            if src is None:
                raise NotFound(
                    f"source_id: {source_id!r} is not registered for {rec.label} "
                    f"(registered: {', '.join(sorted(rec.sources)) or 'none'})"
                )
            if rec.state is VersionState.PENDING:
                marked = replace(src, ready=True)
                self._refuse_gaps_locked(rec, marked)  # before any change: a refusal leaves it PENDING
                rec.sources[source_id] = marked
                self._maybe_ready_locked(rec)
            elif rec.state is not VersionState.READY:
                raise FailedPrecondition(
                    f"{rec.label} is {rec.state.value}; source {source_id!r} cannot be marked ready"
                )
            life = self._st.sources.get(source_id)
            if life is not None:  # a sign of life: renew
                self._st.deadlines.set(life, now + life.ttl_s)
            return rec.state

        return self._txn(body)

    def heartbeat(
        self,
        source_ids: Sequence[str] = (),
        lease_ids: Sequence[str] = (),
        incarnations: Mapping[str, str] | None = None,
        watch_source_ids: Sequence[str] = (),
    ) -> frozenset[str]:
        """Renew sources and leases by their own TTLs; return the ``watch_source_ids`` that are
        not live (expired, never registered, or withdrawn): a reader mid-pull stops waiting on them.

        All or nothing: if any id is unknown (never registered, or already expired) nothing is
        renewed and ``NotFound`` lists every unknown id and why — the caller's sources/leases
        are gone and must be re-registered/re-acquired. ``incarnations`` maps source ids to the
        incarnation the caller registered them with: a source now held by another incarnation
        (the caller was replaced by a restarted rank) is ``FailedPrecondition``.
        """
        sources = check_ids(source_ids, "source_ids")
        leases = check_ids(lease_ids, "lease_ids")
        claimed = check_incarnations(incarnations)
        watched = check_ids(watch_source_ids, "watch_source_ids", limit=self.limits.max_watched_sources)

        def body(now: float) -> Any:
            replaced = [
                f"{sid!r} (registered by incarnation {self._st.sources[sid].incarnation!r}, "
                f"not {claimed[sid]!r})"
                for sid in sources
                if sid in claimed and sid in self._st.sources
                and self._st.sources[sid].incarnation not in ("", claimed[sid])
            ]
            if replaced:
                raise FailedPrecondition(
                    f"heartbeat: source_ids {', '.join(replaced)} were replaced by a restarted "
                    "rank; nothing was renewed"
                )
            missing_sources = [s for s in sources if s not in self._st.sources]
            missing_leases = [s for s in leases if s not in self._st.leases]
            if missing_sources or missing_leases:
                parts = []
                if missing_sources:
                    parts.append(f"source_ids {missing_sources}")
                if missing_leases:
                    why = "; ".join(self._st.ended_leases.why_gone(lease, now) for lease in missing_leases)
                    parts.append(f"lease_ids {missing_leases} ({why})")
                raise NotFound(
                    f"heartbeat: unknown or expired {' and '.join(parts)}; nothing was renewed"
                )
            for timed in [*(self._st.sources[s] for s in sources), *(self._st.leases[s] for s in leases)]:
                self._st.deadlines.set(timed, now + timed.ttl_s)
            return frozenset(s for s in watched if s not in self._st.sources)

        return self._txn(body)

    def retire_version(self, model: str, version: int) -> VersionState:
        """Stop offering a version: no new leases from now on. Idempotent.

        PENDING and READY versions become DRAINING, and RETIRED as soon as no live lease
        remains (immediately when there is none). DRAINING, RETIRED and EXPIRED versions are
        left as they are. Returns the state afterwards.
        """
        def body(now: float) -> Any:
            rec = self._record_locked(model, version)
            if rec.state in (VersionState.PENDING, VersionState.READY):
                rec.state = VersionState.DRAINING
                self._settle_locked(rec)
            return rec.state

        return self._txn(body)

    def wait_drained(self, model: str, version: int, timeout_s: float, registered_epoch: str = "") -> bool:
        """Block until a retired (or expired) version has no live lease; False on timeout.

        A lease stops counting when it is released or its TTL lapses. On True the version is
        RETIRED (or stays EXPIRED) and its buffers may be mutated. ``timeout_s`` is real time,
        bounded by ``limits.max_wait_s``. Raises ``FailedPrecondition`` for a PENDING or READY
        version (retire it first: otherwise new leases could arrive while waiting).

        The lease fence, for every caller: when the version was created (or, per
        ``registered_epoch``, registered by the caller) in an earlier store epoch, the catalog
        may have lost leases on it without a release (a restart, a Redis rollback), so True
        comes only once the smallest ``lease_fence_s`` of its sources has passed since the
        current epoch began: readers confirm a lease by its deadline only within that fence.
        """
        timeout = check_seconds(
            timeout_s, "timeout_s", maximum=self.limits.max_wait_s, allow_zero=True
        )
        deadline = time.monotonic() + timeout

        def check(now: float) -> tuple[bool, float, object]:
            rec = self._record_locked(model, version)
            if rec.state in (VersionState.PENDING, VersionState.READY):
                raise FailedPrecondition(
                    f"{rec.label} is {rec.state.value}; retire it before waiting for it to drain"
                )
            holding = rec.trainer_leases()  # replica-only readers do not hold it up
            if holding:  # wake at the next lease expiry too (exact with a real clock)
                next_expiry = min(lease.expires_at for lease in holding)
                return False, max(next_expiry - now, 0.001), self._generation()
            fenced = self._drain_fence_locked(rec, registered_epoch) - now
            if fenced > 0:
                return False, fenced, self._generation()
            return True, 0.0, 0

        return self._wait_until_unread(check, deadline)

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
        version, min_version = check_lookup(version, min_version)

        def body(now: float) -> Manifest:
            return self._ready_record_locked(model, version, min_version).manifest()

        return self._txn(body)

    def inspect_version(self, model: str, version: int) -> VersionInfo:
        """A version's manifest in whatever state it is (diagnostics; readers use
        :meth:`get_version`, which only offers READY versions)."""
        def body(now: float) -> Any:
            return self._record_locked(model, version).manifest()

        manifest: Manifest = self._txn(body)
        return manifest.version_info()

    def list_versions(self, model: str) -> list[VersionSummary]:
        """Summaries of the versions of ``model`` the catalog remembers, oldest first.

        A model that was never published (or fully forgotten) yields an empty list rather than
        ``NotFound``: "no versions" is a valid answer to a listing.
        """
        model = check_name(model, "model")
        def body(now: float) -> Any:
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
                for _, rec in sorted(self._st.models.get(model, {}).items())
            ]

        return self._txn(body)

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
        def body(now: float) -> str:
            rec = self._record_locked(model, version)
            return self._lease_locked(rec, reader_id, ttl, lease_id, now, sources, max_readers_per_source)

        return self._txn(body)

    def lease_version(
        self,
        model: str,
        reader_id: str,
        version: int | None = None,
        min_version: int = 0,
        ttl_s: float = DEFAULT_TTL_S,
        lease_id: str | None = None,
        *,
        while_waiting: Callable[[], None] | None = None,
    ) -> LeasedVersion:
        """:meth:`get_version` and :meth:`acquire_lease` in one atomic step: the exact READY
        ``version`` or the newest READY one >= ``min_version``, leased for ``reader_id`` (a
        lease naming no sources: every trainer source, as readers without fan-out take).

        A retry with the same ``lease_id`` renews that lease and answers its version again,
        even when a newer version turned READY in between. ``while_waiting`` runs first (in
        process there is no reply to wait for).
        """
        if while_waiting is not None:
            while_waiting()
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
        version, min_version = check_lookup(version, min_version)
        reader_id = check_name(reader_id, "reader_id")
        ttl = check_seconds(ttl_s, "ttl_s", maximum=self.limits.max_ttl_s)
        if lease_id is not None:
            lease_id = check_name(lease_id, "lease_id")

        def body(now: float) -> tuple[Manifest, str]:
            existing = self._st.leases.get(lease_id) if lease_id else None
            held = existing.record if existing is not None else None
            if held is not None and held.model == model and version in (None, held.version):
                rec = held  # a retry: the version this lease was taken on
            else:
                rec = self._ready_record_locked(model, version, min_version)
            return rec.manifest(), self._lease_locked(rec, reader_id, ttl, lease_id, now, (), 0)

        return self._txn(body)

    def release_lease(self, lease_id: str, completed: bool = False) -> None:
        """Release a live lease. Releasing it again is a no-op (a retry after a lost reply).

        ``NotFound`` when the lease expired (its TTL ran out) or is unknown to this catalog
        (never acquired here, or the catalog restarted since): in both cases the lease was not
        held until now, and a reader must not trust what it pulled under it.

        ``completed=True``: the reader pulled every byte it needed, so its reader id counts as a
        completed read of the version (once). An expired lease counts nothing.
        """
        lease_id = check_name(lease_id, "lease_id")
        check_flag(completed, "completed")
        def body(now: float) -> Any:
            lease = self._st.leases.get(lease_id)
            if lease is None:
                if self._st.ended_leases.released(lease_id):
                    return
                raise NotFound(
                    f"lease_id: unknown or expired lease {lease_id!r} "
                    f"({self._st.ended_leases.why_gone(lease_id, now)})"
                )
            if completed and lease.record is not None:
                lease.record.completed_readers.add(lease.reader_id)
            self._drop_lease_locked(lease, "released", now)  # notifies wait_read and wait_drained waiters

        return self._txn(body)

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

        def check(now: float) -> tuple[ReadProgress, object]:
            rec = self._record_locked(model, version)
            if rec.expected_readers == 0:
                raise FailedPrecondition(
                    f"{rec.label} was registered without expected_readers; reads are not counted"
                )
            progress = rec.read_progress()
            if not progress.done and rec.state is VersionState.EXPIRED and not rec.leases:
                raise FailedPrecondition(
                    f"{rec.label} is EXPIRED with {progress.describe()}; the rest can never read it"
                )
            return progress, self._generation()

        while True:
            progress, generation = self._txn(check)
            remaining = deadline - time.monotonic()
            if progress.done or remaining <= 0:
                return progress
            self.store.wait_for_change(generation, remaining)  # releases, expiries, the reaper

    # --- maintenance ----------------------------------------------------------------------

    def reap(self) -> ReapReport:
        """Expire every lease and source whose TTL has lapsed; wake drain waiters."""
        report: dict[str, list[Any]] = {"leases": [], "sources": [], "versions": []}

        def run(txn: Txn) -> None:
            self._enter(txn)
            try:
                for values in report.values():
                    values.clear()  # a store may run this again on a fresher state
                self._reap_locked(txn.now, report)
            finally:
                self._t = None

        self.store.run(run)
        return ReapReport(
            leases=tuple(report["leases"]),
            sources=tuple(report["sources"]),
            versions=tuple(report["versions"]),
        )
