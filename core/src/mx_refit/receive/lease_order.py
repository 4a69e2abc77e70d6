"""When a refit takes its lease: in the call that finds the version, or after planning.

Without fan-out or a reader cap a lease names no sources, so a catalog that finds and leases in
one call (:class:`~mx_refit.catalog.api.LeasingCatalog`) saves a round trip per refit, and
planning runs under the lease (:class:`LeaseInDiscovery`). A lease that names its sources
(fan-out: the least read holder of each trainer source's bytes, under the reader cap) can only
be taken once the plan says which bytes are needed (:class:`LeaseAfterPlanning`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from mx_refit._backoff import Backoff
from mx_refit.catalog.api import LeasingCatalog
from mx_refit.catalog.epoch import answer_epoch
from mx_refit.checks import TREE
from mx_refit.errors import FailedPrecondition, NotFound, SourcesBusy, TransferError
from mx_refit.receive.lease import LeaseGuard, LeaseRenewer
from mx_refit.types import SourceInfo, VersionInfo

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.catalog.api import Catalog
    from mx_refit.receive.options import ReceiveOptions

__all__ = ["LeaseAfterPlanning", "LeaseInDiscovery", "LeaseOrder", "Leased", "discover", "lease_order"]

log = logging.getLogger(__name__)

# per source id: (source address, arena offset, nbytes)
Requests = dict[str, list[tuple[int, int, int]]]


@dataclass(frozen=True)
class Leased:
    """Where one refit reads, under which lease."""

    info: VersionInfo  # the version as last discovered
    sources: dict[str, SourceInfo]  # the holders read from (trainer sources or replicas)
    requests: Requests  # per holder, in the holder's addresses
    lease: LeaseGuard


def discover(catalog: "Catalog", model: str, version: int | None, min_version: int, wait_s: float) -> VersionInfo:
    """The exact READY ``version``, or the newest READY one >= ``min_version``; with ``wait_s``
    > 0, asked again until one appears or the time runs out."""
    wait = Backoff(wait_s)
    while True:
        try:
            return catalog.get_version(model=model, version=version, min_version=min_version)
        except (NotFound, FailedPrecondition):
            if not wait.sleep():
                raise


class LeaseOrder:
    """A refit's two lease steps: :meth:`find` the version (leased or not) and :meth:`lease` it
    for the planned reads. Both read the receiver's options when called."""

    def __init__(self, options: "ReceiveOptions", renewer: LeaseRenewer) -> None:
        self.options = options
        self._renewer = renewer  # one thread for every refit's lease

    def find(
        self, catalog: "Catalog", version: int | None, min_version: int, wait_s: float
    ) -> tuple[VersionInfo, LeaseGuard | None]:
        """The version to refit, and its started lease if this order takes it now."""
        raise NotImplementedError

    def lease(self, catalog: "Catalog", info: VersionInfo, requests: Requests, held: LeaseGuard | None) -> Leased:
        """The lease (``held``, or taken now) and where to read ``requests`` (the trainer
        sources' reads) from."""
        raise NotImplementedError

    def _guard(self, catalog: "Catalog", info: VersionInfo, lease_id: str, acquired_at: float) -> LeaseGuard:
        return LeaseGuard(
            catalog, lease_id, self.options.lease_ttl_s, acquired_at=acquired_at,
            label=f"model {self.options.model!r} version {info.version}", renewer=self._renewer,
            epoch=answer_epoch(catalog),  # called right after the acquiring answer, on its thread
        )


class LeaseInDiscovery(LeaseOrder):
    """Find and lease in one catalog call; ``while_waiting`` runs while the answer is on its way
    (the receiver readies its next read meanwhile)."""

    def __init__(self, options: "ReceiveOptions", renewer: LeaseRenewer, while_waiting: Callable[[], None]) -> None:
        super().__init__(options, renewer)
        self._while_waiting = while_waiting

    def find(
        self, catalog: "Catalog", version: int | None, min_version: int, wait_s: float
    ) -> tuple[VersionInfo, LeaseGuard | None]:
        options = self.options
        leasing = cast(LeasingCatalog, catalog)  # this order is chosen for a LeasingCatalog only
        wait = Backoff(wait_s)
        while True:
            acquired_at = time.monotonic()  # the lease's clock starts when the call is sent
            try:
                leased = leasing.lease_version(
                    options.model, options.reader_id, version, min_version, options.lease_ttl_s,
                    while_waiting=self._while_waiting,
                )
                break
            except (NotFound, FailedPrecondition):
                if not wait.sleep():
                    raise
        lease = self._guard(catalog, leased.info, leased.lease_id, acquired_at)
        lease.start()  # planning runs under the lease
        return leased.info, lease

    def lease(self, catalog: "Catalog", info: VersionInfo, requests: Requests, held: LeaseGuard | None) -> Leased:
        assert held is not None, "find() took the lease"
        return Leased(info, {s.source_id: s for s in info.sources}, requests, held)


class LeaseAfterPlanning(LeaseOrder):
    """Find the version, plan, then choose where to read and lease naming those sources."""

    def find(
        self, catalog: "Catalog", version: int | None, min_version: int, wait_s: float
    ) -> tuple[VersionInfo, LeaseGuard | None]:
        return discover(catalog, self.options.model, version, min_version, wait_s), None

    def lease(self, catalog: "Catalog", info: VersionInfo, requests: Requests, held: LeaseGuard | None) -> Leased:
        info, sources, requests, acquired_at, lease_id = self._choose_and_lease(catalog, info, requests)
        lease = self._guard(catalog, info, lease_id, acquired_at)
        lease.start()
        return Leased(info, sources, requests, lease)

    def _choose_and_lease(
        self, catalog: "Catalog", info: VersionInfo, requests: Requests
    ) -> tuple[VersionInfo, dict[str, SourceInfo], Requests, float, str]:
        """Choose where to read (fan-out: the least read holder of each trainer source's bytes
        under the reader cap) and lease the version naming those sources. Without fan-out: the
        trainer sources, and a lease naming none (as before fan-out existed).

        Returns the version as last discovered, the chosen sources and their requests, the
        local time the lease call was sent and the lease id."""
        o = self.options
        if not o.names_sources:
            acquired_at = time.monotonic()
            lease_id = catalog.acquire_lease(model=o.model, version=info.version, reader_id=o.reader_id, ttl_s=o.lease_ttl_s)
            return info, {s.source_id: s for s in info.sources}, requests, acquired_at, lease_id
        from mx_refit.receive.fanout import choose_sources

        # Every holder busy: wait for a replica to turn ready rather than queue on the trainer.
        wait = Backoff(o.transfer_timeout_s, first_s=0.005, max_s=0.025)
        while True:
            choice = choose_sources(
                info, requests, reader_id=o.reader_id, max_readers=o.max_readers_per_source,
                exclude=() if o.fanout == TREE else {r.source_id for r in info.replicas},
            )
            if choice is not None:
                acquired_at = time.monotonic()
                try:
                    lease_id = catalog.acquire_lease(
                        model=o.model, version=info.version, reader_id=o.reader_id, ttl_s=o.lease_ttl_s,
                        sources=sorted(choice.sources), max_readers_per_source=o.max_readers_per_source,
                    )
                except SourcesBusy:
                    pass  # another reader took the last slot first: look again
                else:
                    log.debug("%s v%d: reading %s (readers %s)", o.model, info.version, choice.via, info.readers)
                    return info, choice.sources, choice.requests, acquired_at, lease_id
            if not wait.sleep():
                raise TransferError(
                    f"model {o.model!r} version {info.version}: every holder of the needed bytes "
                    f"still serves {o.max_readers_per_source} readers after {o.transfer_timeout_s:g}s"
                )
            info = catalog.get_version(model=o.model, version=info.version)


def lease_order(
    catalog: "Catalog", options: "ReceiveOptions", renewer: LeaseRenewer, while_waiting: Callable[[], None]
) -> LeaseOrder:
    """In discovery when the catalog can and the lease names no sources, else after planning."""
    if isinstance(catalog, LeasingCatalog) and not options.names_sources:
        return LeaseInDiscovery(options, renewer, while_waiting)
    return LeaseAfterPlanning(options, renewer)
