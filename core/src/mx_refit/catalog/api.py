"""The catalog's public surface shared by the embedded service and the remote client.

``Catalog`` is the protocol the publisher and the receiver program against
(:func:`mx_refit.catalog.connect.as_catalog` turns what a caller hands them into one): both
:class:`~mx_refit.catalog.service.CatalogService` (in-process) and
:class:`~mx_refit.catalog.client.CatalogClient` (over gRPC) satisfy it, with the same
arguments, return types and :mod:`mx_refit.errors` exceptions. No grpc import here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from mx_refit.types import SourceInfo, VersionInfo, VersionState

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES", "DEFAULT_TTL_S", "Catalog", "LeasedVersion", "LeasingCatalog", "ReadProgress",
    "VersionSummary",
]

# Default TTL of sources and leases; heartbeat at a third of it or more often.
DEFAULT_TTL_S = 30.0
# gRPC message bound of server and client: a 1M-descriptor manifest plus 16 MiB of agent
# metadata and a 64 MiB sidecar must fit.
DEFAULT_MAX_MESSAGE_BYTES = 512 * (1 << 20)


@dataclass(frozen=True)
class VersionSummary:
    """One version as :meth:`Catalog.list_versions` reports it (no descriptors)."""

    model: str
    version: int
    state: VersionState
    expected_sources: int
    registered_sources: int
    ready_sources: int
    leases: int
    expected_readers: int = 0  # 0: completed reads are not tracked
    completed_reads: int = 0  # distinct readers that completed a read


@dataclass(frozen=True)
class ReadProgress:
    """How far the expected readers of a version got (:meth:`Catalog.wait_read`)."""

    done: bool
    expected_readers: int
    completed_readers: tuple[str, ...]  # sorted reader ids

    def describe(self) -> str:
        """``"1 of 2 expected readers completed (reader-a)"``, for error messages."""
        who = ", ".join(self.completed_readers) or "none"
        return (
            f"{len(self.completed_readers)} of {self.expected_readers} expected readers "
            f"completed ({who})"
        )


@dataclass(frozen=True)
class LeasedVersion:
    """A READY version found and leased in one step (:meth:`LeasingCatalog.lease_version`)."""

    info: VersionInfo
    lease_id: str


@runtime_checkable
class Catalog(Protocol):
    """What publishers and receivers need from the catalog (embedded or remote).

    Every method raises :mod:`mx_refit.errors`: ``InvalidArgument`` (malformed or conflicting
    request; the message names the field and the value), ``NotFound`` (unknown model, version,
    source, or an unknown/expired lease), ``FailedPrecondition`` (the version's state forbids
    the call; the message names the state); remote clients add ``Unauthenticated`` and
    ``Unavailable``.
    """

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
        """Register (or replace, while PENDING) one source; return the version's state."""
        ...

    def mark_ready(self, model: str, version: int, source_id: str) -> VersionState:
        """Mark a registered source ready; return the version's state."""
        ...

    def heartbeat(
        self,
        source_ids: Sequence[str] = (),
        lease_ids: Sequence[str] = (),
        incarnations: Mapping[str, str] | None = None,
        watch_source_ids: Sequence[str] = (),
    ) -> frozenset[str]:
        """Renew the TTLs of the given sources and leases (all or nothing); ``incarnations``
        (source id -> incarnation) makes a replaced caller fail with ``FailedPrecondition``.
        Returns the ``watch_source_ids`` the catalog does not hold live (their heartbeats
        stopped, or they were never registered or were withdrawn)."""
        ...

    def get_version(
        self, model: str, version: int | None = None, min_version: int = 0
    ) -> VersionInfo:
        """The newest READY version >= ``min_version``, or exactly ``version`` (if READY)."""
        ...

    def list_versions(self, model: str) -> list[VersionSummary]:
        """Every remembered version of ``model``, oldest first."""
        ...

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
        """Lease a READY version; return the lease id. ``sources``: what the reader reads from
        (empty: every trainer source); ``max_readers_per_source`` > 0: ``SourcesBusy`` when a
        named source already serves that many readers."""
        ...

    def register_replica(
        self, model: str, version: int, source: SourceInfo, ttl_s: float = DEFAULT_TTL_S
    ) -> None:
        """Offer a replica source (``source.mirrors``) of a READY version (fan-out)."""
        ...

    def withdraw_replica(self, model: str, version: int, source_id: str, timeout_s: float) -> bool:
        """Stop offering a replica; wait (bounded) until no lease reads it; True once drained."""
        ...

    def release_lease(self, lease_id: str, completed: bool = False) -> None:
        """Release a live lease (again: a no-op); ``completed`` counts its reader as having read
        the version. ``NotFound`` when the lease expired or was lost (a catalog restart)."""
        ...

    def retire_version(self, model: str, version: int) -> VersionState:
        """Stop offering a version; return its state (DRAINING or RETIRED)."""
        ...

    def wait_drained(self, model: str, version: int, timeout_s: float, registered_epoch: str = "") -> bool:
        """Wait until a retired version has no live lease (and, when the catalog's epoch changed
        since the version or ``registered_epoch``, its lease fence passed); False on timeout."""
        ...

    def wait_read(self, model: str, version: int, timeout_s: float) -> ReadProgress:
        """Wait until every expected reader completed a read of ``version`` (bounded)."""
        ...


@runtime_checkable
class LeasingCatalog(Catalog, Protocol):
    """A catalog that also finds and leases a version in one call (one round trip fewer per
    refit). Receivers use it when the catalog they were given offers it."""

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
        """:meth:`get_version` and :meth:`acquire_lease` atomically: the exact READY ``version``,
        or the newest READY one >= ``min_version``, leased for ``reader_id``. A retry with the
        same ``lease_id`` renews that lease and answers its version again.

        ``while_waiting``: work of the caller's, run once per call while the reply is on its way
        (a remote client) or first (an in-process catalog); its error is the caller's."""
        ...

