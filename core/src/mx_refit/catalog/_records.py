"""The catalog service's internal records and its TTL deadline heap (no locking here: the
service holds its lock around every use)."""

from __future__ import annotations

import heapq
import itertools
import json
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mx_refit.catalog.api import ReadProgress
from mx_refit.catalog.digests import sidecar_digest
from mx_refit.catalog.validation import json_text, merge_sidecar
from mx_refit.types import Role, SourceInfo, VersionInfo, VersionState

__all__ = [
    "Deadlines",
    "EndedLeases",
    "LeaseRecord",
    "Manifest",
    "SourceLife",
    "TensorIndex",
    "IMMUTABLE_VALUES",
    "TRANSIENT",
    "Timed",
    "VersionRecord",
    "index_tensors",
]

# Field metadata of state that is a cache or an index: stores do not keep it, and the class's
# ``__post_load__`` rebuilds it after a load (see mx_refit.catalog.store.codec).
TRANSIENT: dict[str, Any] = {"transient": True}
# Field metadata of a dict whose values are never mutated once inserted: a store encodes each
# value once per process and keeps a large one as a blob written once.
IMMUTABLE_VALUES: dict[str, Any] = {"immutable_values": True}


@dataclass(eq=False)
class Timed:
    """Something with a TTL. ``heap_at`` is the time of its live entry in :class:`Deadlines`."""

    ttl_s: float
    expires_at: float
    heap_at: float = field(default=float("inf"), metadata=TRANSIENT)
    dead: bool = False


@dataclass(eq=False)
class SourceLife(Timed):
    """Liveness of one source id, across every (model, version) it registered for."""

    source_id: str = ""
    incarnation: str = ""  # the process behind the id; a different one replaces it
    versions: set[tuple[str, int]] = field(default_factory=set)
    # (model, version)s it serves as a replica: its death drops the replica, not the version
    replica_of: set[tuple[str, int]] = field(default_factory=set)


@dataclass(eq=False)
class LeaseRecord(Timed):
    lease_id: str = ""
    reader_id: str = ""
    record: VersionRecord | None = None
    # The sources it reads from; empty: every trainer source (readers without fan-out).
    sources: tuple[str, ...] = ()

    def reads_trainer(self, rec: VersionRecord) -> bool:
        """Whether this lease holds the trainer's buffers (a lease reading only replicas does not
        hold up the trainer's drain)."""
        return not self.sources or any(s in rec.sources for s in self.sources)


@dataclass(frozen=True)
class Manifest:
    """A version as the catalog serves it: sources with their layout digests, and the merged
    sidecar as canonical JSON text with its digest (decoded only by whoever needs a dict, so
    the gRPC servicer sends it without a decode/encode round)."""

    model: str
    version: int
    state: VersionState
    expected_sources: int
    sources: tuple[SourceInfo, ...]
    sidecar_text: str
    sidecar_digest: str
    replicas: tuple[SourceInfo, ...] = ()
    readers: dict[str, int] = field(default_factory=dict)

    def version_info(self) -> VersionInfo:
        """The manifest as a :class:`VersionInfo` (its sidecar a fresh copy per call)."""
        return VersionInfo(
            model=self.model,
            version=self.version,
            state=self.state,
            expected_sources=self.expected_sources,
            sources=self.sources,
            sidecar=json.loads(self.sidecar_text),
            sidecar_digest=self.sidecar_digest,
            replicas=self.replicas,
            readers=dict(self.readers),
        )


# name -> (dtype, global_shape, role, source_id that registered it first)
TensorIndex = dict[str, tuple[str, tuple[int, ...], Role, str]]


@dataclass(eq=False)
class VersionRecord:
    model: str
    version: int
    expected_sources: int
    state: VersionState = VersionState.PENDING
    sources: dict[str, SourceInfo] = field(default_factory=dict)
    # per source, as sent (never mutated: merging copies)
    sidecars: dict[str, dict[str, Any]] = field(default_factory=dict, metadata=IMMUTABLE_VALUES)
    sidecar: dict[str, Any] = field(default_factory=dict, metadata=TRANSIENT)  # merged, from ``sidecars``
    sidecar_text: str | None = None  # cached JSON of ``sidecar``; None after every change
    sidecar_digest: str = ""  # digest of ``sidecar_text`` (valid while that is not None)
    tensors: TensorIndex = field(default_factory=dict, metadata=TRANSIENT)  # from ``sources``
    # Live leases: kept by the store apart from the version (the Redis store in its own keys).
    leases: dict[str, LeaseRecord] = field(default_factory=dict, metadata=TRANSIENT)
    expected_readers: int = 0  # 0: completed reads are not tracked
    completed_readers: set[str] = field(default_factory=set)  # reader ids, each counted once
    # Fan-out: replica sources by id (offered once ready, until withdrawn), and the withdrawn
    # ones (no new leases may name them; forgotten once no lease reads them).
    replicas: dict[str, SourceInfo] = field(default_factory=dict)
    withdrawn: set[str] = field(default_factory=set)
    epoch: str = ""  # the store epoch the version was created in (see CatalogCore._drain_fence_locked)

    def offered_replicas(self) -> tuple[SourceInfo, ...]:
        return tuple(
            r for sid, r in sorted(self.replicas.items()) if r.ready and sid not in self.withdrawn
        )

    def reader_counts(self) -> dict[str, int]:
        """Live leases reading each source (a lease naming no source reads every trainer one)."""
        counts: dict[str, int] = {}
        for lease in self.leases.values():
            for sid in lease.sources or self.sources:
                counts[sid] = counts.get(sid, 0) + 1
        return counts

    def trainer_leases(self) -> list[LeaseRecord]:
        return [lease for lease in self.leases.values() if lease.reads_trainer(self)]

    @property
    def label(self) -> str:
        return f"model {self.model!r} version {self.version}"

    def __post_load__(self) -> None:
        for source in self.sources.values():
            index_tensors(self.tensors, source)
        for extra in self.sidecars.values():
            merge_sidecar(self.sidecar, extra)

    def read_progress(self) -> ReadProgress:
        return ReadProgress(
            done=len(self.completed_readers) >= self.expected_readers,
            expected_readers=self.expected_readers,
            completed_readers=tuple(sorted(self.completed_readers)),
        )

    def manifest(self) -> Manifest:
        """The manifest, sources ordered by mesh position (pp, ep, tp) then id."""
        if self.sidecar_text is None:  # encoded and hashed once per change, not per reader
            self.sidecar_text = json_text(self.sidecar)
            self.sidecar_digest = sidecar_digest(self.sidecar_text)
        return Manifest(
            model=self.model,
            version=self.version,
            state=self.state,
            expected_sources=self.expected_sources,
            sources=tuple(sorted(self.sources.values(), key=_mesh_order)),
            sidecar_text=self.sidecar_text,
            sidecar_digest=self.sidecar_digest,
            replicas=self.offered_replicas() if self.replicas else (),
            readers=self.reader_counts() if self.leases else {},
        )


def _mesh_order(source: SourceInfo) -> tuple[int, int, int, int, str]:
    mesh = source.mesh
    return (mesh.pp_rank, mesh.ep_rank, mesh.tp_rank, mesh.etp_rank, source.source_id)


def index_tensors(index: TensorIndex, source: SourceInfo) -> None:
    """Record the dtype/global_shape/role of every tensor name ``source`` introduces."""
    for desc in source.tensors:
        index.setdefault(desc.name, (desc.dtype, desc.global_shape, desc.role, source.source_id))


@dataclass(eq=False)
class EndedLeases:
    """Recently ended leases (id -> how and when it ended, its TTL), bounded: a reader learns why
    its lease is gone, and a retried release of a released lease is a no-op rather than an
    ambiguous NotFound. A lease unknown here was never acquired, or the catalog restarted."""

    keep: int = 65536
    ended: OrderedDict[str, tuple[str, float, float]] = field(default_factory=OrderedDict)
    # None: not noted (the memory store). A dict (the Redis store): id -> its new entry, or None
    # when it was dropped, since the last take_changes(), so a commit writes only those.
    changes: dict[str, tuple[str, float, float] | None] | None = field(default=None, metadata=TRANSIENT)

    def add(self, lease: LeaseRecord, how: str, at: float) -> None:
        entry = self.ended[lease.lease_id] = (how, at, lease.ttl_s)
        if self.changes is not None:
            self.changes[lease.lease_id] = entry
        if len(self.ended) > self.keep:
            dropped, _ = self.ended.popitem(last=False)
            if self.changes is not None:
                self.changes[dropped] = None

    def take_changes(self) -> dict[str, tuple[str, float, float] | None]:
        changes = self.changes or {}
        if self.changes is not None:
            self.changes = {}
        return changes

    def released(self, lease_id: str) -> bool:
        ended = self.ended.get(lease_id)
        return ended is not None and ended[0] == "released"

    def why_gone(self, lease_id: str, now: float) -> str:
        ended = self.ended.get(lease_id)
        if ended is None:
            return (
                f"{lease_id} is not known to this catalog: never acquired here, or the catalog "
                "restarted and lost it"
            )
        how, at, ttl = ended
        if how == "expired":
            return f"{lease_id} expired {now - at:.3g} s ago: its TTL of {ttl:g} s ran out without a renewal"
        return f"{lease_id} was released {now - at:.3g} s ago"


class Deadlines:
    """Min-heap of TTL deadlines with lazy renewal: one live entry per record.

    Renewals only move a deadline later, so they do not touch the heap: an entry that pops
    before its record's (renewed) ``expires_at`` is pushed again at that time. Only a deadline
    moved earlier (a shorter TTL) needs a new entry, which supersedes the old one via
    ``heap_at``. Heap size therefore tracks the number of records, not of heartbeats.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timed]] = []
        self._seq = itertools.count()  # tie-breaker: records themselves are not ordered
        # With tracking on (the Redis store), the leases renewed, created or ended since the last
        # take_touched(): what a commit writes, instead of every lease.
        self.track_leases = False
        self._touched: set[LeaseRecord] = set()

    def touch(self, timed: Timed) -> None:
        """Note that ``timed`` changed (a lease's deadline, creation or end) for the store."""
        if self.track_leases and isinstance(timed, LeaseRecord):
            self._touched.add(timed)

    def take_touched(self) -> set[LeaseRecord]:
        touched, self._touched = self._touched, set()
        return touched

    def __len__(self) -> int:
        return len(self._heap)

    def set(self, timed: Timed, expires_at: float, *, new: bool = False) -> None:
        timed.expires_at = expires_at
        self.touch(timed)
        if new or expires_at < timed.heap_at:
            self._push(timed, expires_at)

    def _push(self, timed: Timed, at: float) -> None:
        timed.heap_at = at
        heapq.heappush(self._heap, (at, next(self._seq), timed))

    def expired(self, now: float) -> Iterator[Timed]:
        """Pop and yield every live record whose deadline is ``<= now``."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, _, timed = heapq.heappop(heap)
            if timed.dead or timed.heap_at != at:
                continue  # superseded entry
            if timed.expires_at > now:
                self._push(timed, timed.expires_at)  # renewed since: follow it
            else:
                yield timed
