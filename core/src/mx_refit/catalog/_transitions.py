"""The catalog service's state transitions, shared by every public call of
:class:`~mx_refit.catalog.service.CatalogService`: TTL reaping, expiry, lease drops, draining,
pruning. Everything here runs inside one store call (:meth:`CatalogCore._txn`), on the state
that call sees."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from mx_refit.catalog._records import LeaseRecord, SourceLife, VersionRecord
from mx_refit.catalog._replicas import check_lease_sources
from mx_refit.catalog.store.base import CatalogState, CatalogStore, Txn
from mx_refit.catalog.store.memory import MemoryStore
from mx_refit.catalog.validation import CatalogLimits, check_int, check_name
from mx_refit.errors import FailedPrecondition, InvalidArgument, NotFound
from mx_refit.types import SourceInfo, VersionState

__all__ = ["LIVE", "TERMINAL", "CatalogCore", "check_ids", "check_lookup"]

T = TypeVar("T")
LIVE = (VersionState.PENDING, VersionState.READY, VersionState.DRAINING)
TERMINAL = (VersionState.RETIRED, VersionState.EXPIRED)


class CatalogCore:
    """The state-holding half of :class:`~mx_refit.catalog.service.CatalogService`."""

    if TYPE_CHECKING:  # provided by ReplicaCatalog
        def _drop_replica_locked(self, rec: VersionRecord, source_id: str) -> None: ...
        def _expire_replica_locked(self, life: SourceLife, models: dict[str, dict[int, VersionRecord]]) -> None: ...

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        limits: CatalogLimits | None = None,
        history: int = 4,
        store: CatalogStore | None = None,
    ) -> None:
        if history < 0:
            raise ValueError(f"history must be >= 0, got {history}")
        self.limits = limits or CatalogLimits()
        self._history = history
        # The state lives in the store; ``_t`` is the running call's view of it (set by the
        # store's ``run``, which serialises the calls of this process).
        self.store: CatalogStore = store if store is not None else MemoryStore(clock)
        self._t: Txn | None = None
        self._answers = threading.local()  # per calling thread: the epoch of its last answer

    def answer_epoch(self) -> str:
        """The store epoch of this thread's last call (see :attr:`Txn.epoch`): a caller that
        relies on an answer compares it with the epoch of the answers it relied on before."""
        return str(getattr(self._answers, "epoch", ""))

    def _enter(self, txn: Txn) -> None:
        """Start a store call: note a new store epoch (when it was first seen) in the state."""
        self._t = txn
        self._answers.epoch = txn.epoch
        if txn.state.epoch != txn.epoch:
            txn.state.epoch, txn.state.epoch_began = txn.epoch, txn.now

    @property
    def _st(self) -> CatalogState:
        assert self._t is not None, "catalog state touched outside a store call"
        return self._t.state

    def _txn(self, body: Callable[[float], T]) -> T:
        """Run ``body(now)`` as one atomic store call, after applying lapsed TTLs."""

        def run(txn: Txn) -> T:
            self._enter(txn)
            try:
                return body(self._reap_locked(txn.now))
            finally:
                self._t = None

        return self.store.run(run)

    def _wait_until_unread(self, check: Callable[[float], tuple[bool, float, object]], deadline: float) -> bool:
        """Run ``check(now)`` (one store call: no reader left?, seconds until the next lease
        expiry, the store's generation) until it says so (True) or ``deadline`` (monotonic)
        passes (False). In between, sleep until the store changes (a release, the reaper, in
        any catalog process on the store) or that expiry comes."""
        while True:
            unread, until_expiry, generation = self._txn(check)
            if unread:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.store.wait_for_change(generation, min(remaining, until_expiry))

    # --- internals (all called inside a store call) ---------------------------------------

    def _txn_now(self) -> Txn:
        assert self._t is not None, "catalog state touched outside a store call"
        return self._t

    def _generation(self) -> object:
        return self._txn_now().generation

    def _ready_record_locked(self, model: str, version: int | None, min_version: int) -> VersionRecord:
        """The exact READY ``version``, or the newest READY one >= ``min_version`` (checked)."""
        if version is not None:
            rec = self._record_locked(model, version)
            if rec.state is not VersionState.READY:
                raise FailedPrecondition(f"{rec.label} is {rec.state.value}, not READY")
            return rec
        versions = self._versions_locked(model)
        ready = [r for r in versions.values() if r.state is VersionState.READY and r.version >= min_version]
        if not ready:
            known = ", ".join(f"{v} {versions[v].state.value}" for v in sorted(versions)[-8:])
            raise NotFound(f"model {model!r} has no READY version >= {min_version} (known: {known or 'none'})")
        return max(ready, key=lambda r: r.version)

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
        existing = self._st.leases.get(lease_id) if lease_id else None
        if existing is not None:
            if existing.record is not rec or existing.reader_id != reader_id:
                held = existing.record
                raise InvalidArgument(
                    f"lease_id: {lease_id!r} is already held by reader {existing.reader_id!r} "
                    f"on {held.label if held else 'another version'}"
                )
            existing.ttl_s = ttl
            self._st.deadlines.set(existing, now + ttl)
            return existing.lease_id
        if rec.state is not VersionState.READY:
            raise FailedPrecondition(f"{rec.label} is {rec.state.value}; only READY versions can be leased")
        names, _ = check_lease_sources(rec, sources, max_readers_per_source)
        lease = LeaseRecord(
            ttl_s=ttl,
            expires_at=now + ttl,
            lease_id=lease_id or uuid.uuid4().hex,
            reader_id=reader_id,
            record=rec,
            sources=names,
        )
        self._st.leases[lease.lease_id] = lease
        rec.leases[lease.lease_id] = lease
        self._st.deadlines.set(lease, lease.expires_at, new=True)
        return lease.lease_id

    def _drain_fence_locked(self, rec: VersionRecord, registered_epoch: str) -> float:
        """Store time before which ``rec`` must not count as drained: leases on it may have been
        lost with an earlier store epoch (it was created, or the caller registered it, before
        the current one), and a reader may trust such a lease until its deadline, within the
        smallest ``lease_fence_s`` its sources promised. 0.0: no fence."""
        epoch = self._st.epoch
        if rec.epoch == epoch and registered_epoch in ("", epoch):
            return 0.0
        fence = min((s.lease_fence_s for s in rec.sources.values()), default=0.0)
        return self._st.epoch_began + fence if fence > 0 else 0.0

    def _versions_locked(self, model: object) -> dict[int, VersionRecord]:
        model = check_name(model, "model")
        versions = self._st.models.get(model)
        if versions is None:
            known = ", ".join(sorted(self._st.models)[:8])
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

    def _refuse_gaps_locked(self, rec: VersionRecord, marked: SourceInfo) -> None:
        """Refuse the mark that would make ``rec`` READY when its sources leave bytes of some
        tensor unpublished (:func:`mx_refit.layout.coverage.version_gaps`), naming them."""
        others = [s for sid, s in rec.sources.items() if sid != marked.source_id]
        if len(others) + 1 != rec.expected_sources or not all(s.ready for s in others):
            return
        from mx_refit.layout.coverage import describe_gaps, version_gaps

        gaps = version_gaps([*others, marked], rec.sidecar)
        if gaps:
            raise FailedPrecondition(
                f"{rec.label}: its {rec.expected_sources} sources cannot cover every byte it publishes, so it "
                f"will not become READY ({len(gaps)} gap(s): {describe_gaps(gaps)}); check the publishing ranks "
                "and expected_sources (mx_refit.expected_sources for a Megatron job)"
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
        life = self._st.sources.get(source_id)
        if life is None:
            life = SourceLife(
                ttl_s=ttl, expires_at=now + ttl, source_id=source_id, incarnation=incarnation
            )
            self._st.sources[source_id] = life
            self._st.deadlines.set(life, life.expires_at, new=True)
        else:
            life.ttl_s = ttl
            life.incarnation = life.incarnation or incarnation
            self._st.deadlines.set(life, now + ttl)
        life.versions.add((rec.model, rec.version))

    def _reap_locked(self, now: float, report: dict[str, list[Any]] | None = None) -> float:
        for timed in self._st.deadlines.expired(now):
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
        del self._st.sources[life.source_id]
        self._st.layouts.pop(life.source_id, None)
        self._expire_replica_locked(life, self._st.models)
        expired = []
        for model, version in sorted(life.versions):
            rec = self._st.models.get(model, {}).get(version)
            if rec is None or life.source_id not in rec.sources:
                continue  # that number was published afresh without this source
            if rec is spare and rec.state is VersionState.PENDING:
                continue
            if rec.state in LIVE:
                rec.state = VersionState.EXPIRED
                expired.append((model, version))
                self._prune_locked(model)
        if expired:
            self._txn_now().notify()
        return expired

    def _drop_lease_locked(self, lease: LeaseRecord, how: str, at: float) -> None:
        lease.dead = True
        self._st.deadlines.touch(lease)
        del self._st.leases[lease.lease_id]
        self._st.ended_leases.add(lease, how, at)
        rec, lease.record = lease.record, None  # its heap entry stays until its TTL: pin nothing
        if rec is not None:
            rec.leases.pop(lease.lease_id, None)
            self._settle_locked(rec)

    def _settle_locked(self, rec: VersionRecord) -> None:
        """DRAINING with no live lease is RETIRED; wake waiters; forget old versions."""
        if rec.state is VersionState.DRAINING and not rec.trainer_leases():
            rec.state = VersionState.RETIRED
        if rec.state in TERMINAL:
            self._prune_locked(rec.model)
        self._txn_now().notify()

    def _prune_locked(self, model: str) -> None:
        versions = self._st.models.get(model)
        if not versions:
            return
        terminal = sorted(v for v, r in versions.items() if r.state in TERMINAL)
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
                life = self._st.sources.get(source_id)
                if life is not None:
                    life.versions.discard((model, version))
            for source_id in list(rec.replicas):
                self._drop_replica_locked(rec, source_id)
        if not versions:
            del self._st.models[model]


def check_lookup(version: int | None, min_version: int) -> tuple[int | None, int]:
    """Checked ``version`` and ``min_version`` of a READY-version lookup."""
    min_version = check_int(min_version, "min_version", minimum=0)
    if version is not None:
        version = check_int(version, "version", minimum=0)
        if version < min_version:
            raise InvalidArgument(f"version: {version} is below min_version {min_version}")
    return version, min_version


def check_ids(values: Iterable[str], field: str, limit: int | None = None) -> list[str]:
    if isinstance(values, (str, bytes)):
        # A bare string would iterate as characters: almost certainly a missing [...].
        raise InvalidArgument(f"{field}: must be a sequence of ids, got the string {values!r}")
    values = list(values)
    if limit is not None and len(values) > limit:
        raise InvalidArgument(f"{field}: {len(values)} ids exceed the limit of {limit}")
    return [check_name(value, f"{field}[{i}]") for i, value in enumerate(values)]
