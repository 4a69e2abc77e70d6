"""Inference side: discover a READY version, lease it, pull exactly what this worker needs."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mx_refit._backoff import Backoff
from mx_refit._lease import LeaseGuard, LeaseRenewer
from mx_refit.catalog.api import LeasingCatalog, overlaps_lease
from mx_refit.errors import (
    FailedPrecondition,
    InvalidArgument,
    MxRefitError,
    NotFound,
    SourcesBusy,
    TransferError,
)
from mx_refit.types import RefitStats, SourceInfo, TargetLayout, VersionInfo

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mx_refit._replica import ReplicaSource
    from mx_refit.catalog.api import Catalog
    from mx_refit.checksums import Verification
    from mx_refit.config import WeightSyncConfig
    from mx_refit.failover import FailoverPull
    from mx_refit.plan import ReceivePlan
    from mx_refit.plugins import Hooks
    from mx_refit.transport.base import Transport
    from mx_refit.transport.nixl import NixlTransport

__all__ = ["Receiver", "RefitResult"]

log = logging.getLogger(__name__)


@dataclass
class RefitResult:
    """One completed refit. ``tensors`` are views of the receive arena: valid until the next
    refit reuses it (engines copy them into their own parameters)."""

    version: VersionInfo
    plan: "ReceivePlan"
    tensors: list[tuple[str, "torch.Tensor"]]
    stats: RefitStats


class Receiver:
    """One inference worker's receiving endpoint.

    :param catalog: Catalog address (``host:port``) or any object satisfying the
        :class:`~mx_refit.catalog.api.Catalog` protocol (a ``CatalogClient``, an in-process
        ``CatalogService``, ...).
    :param target: The layout this worker needs; ``None`` asks the plugins (from ``engine``).
    :param engine: Optional engine object; when given, received tensors are loaded into it through
        the ``mx_refit_load_weights`` hook in batches of at most ``load_batch_bytes``.
    :param device: Where the receive arena lives (``"cpu"`` or ``"cuda:N"``).
    :param transport: The transport to pull with; ``None`` makes one for this receiver (closed
        with it). Pass :func:`mx_refit.shared_transport` to share the process's one agent
        between receivers of several models (and publishers).
    :param fanout: ``"none"`` (read every byte from the trainer sources) or ``"tree"``: read from
        the trainer sources and the ready replicas, spread by load, and after each complete
        refit offer the arena as a replica of that version (withdrawn, waiting for its readers,
        before the next refit writes the arena). With ``"tree"`` the returned tensors are
        served to other readers until then: treat them as read-only.
    :param max_readers_per_source: > 0: never read a source that already serves that many
        readers (the catalog enforces it at lease time); wait for a replica instead.
    """

    def __init__(
        self,
        catalog: "str | Catalog",
        model: str,
        *,
        target: TargetLayout | None = None,
        engine: Any = None,
        device: str = "cpu",
        reader_id: str | None = None,
        token: str | None = None,
        transport: "Transport | NixlTransport | None" = None,
        hooks: "Hooks | None" = None,
        lease_ttl_s: float = 60.0,
        transfer_timeout_s: float = 120.0,
        load_batch_bytes: int = 512 << 20,
        transport_mode: str = "auto",
        checksums: bool = False,
        fanout: str = "none",
        max_readers_per_source: int = 0,
    ) -> None:
        from mx_refit.catalog.connect import as_catalog
        from mx_refit.plugins import Hooks

        # Every argument is checked before anything is built, connected or leased.
        for name, value in (("lease_ttl_s", lease_ttl_s), ("transfer_timeout_s", transfer_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < float("inf")):
                raise InvalidArgument(f"{name}: must be a finite number of seconds > 0, got {value!r}")
        if isinstance(load_batch_bytes, bool) or not isinstance(load_batch_bytes, int) or load_batch_bytes < 1:
            raise InvalidArgument(f"load_batch_bytes: must be an integer >= 1, got {load_batch_bytes!r}")
        if not isinstance(model, str) or not model:
            raise InvalidArgument(f"model: must be a non-empty string, got {model!r}")
        if not isinstance(checksums, bool):
            raise InvalidArgument(f"checksums: must be a bool, got {checksums!r}")
        self.checksums = checksums  # verify every pulled byte against the sources' checksums
        if fanout not in ("none", "tree"):
            raise InvalidArgument(f"fanout: {fanout!r} (expected 'none' or 'tree')")
        if isinstance(max_readers_per_source, bool) or not isinstance(max_readers_per_source, int) or max_readers_per_source < 0:
            raise InvalidArgument(f"max_readers_per_source: must be an integer >= 0, got {max_readers_per_source!r}")

        self.model = model
        self.client: Catalog = as_catalog(catalog, token=token)
        self._owns_client = isinstance(catalog, str)  # made here from an address: closed here
        self._closing = False
        self.hooks = hooks or Hooks()
        self.engine = engine
        self.target = target or self.hooks.target_layout(engine)
        self.device = device
        self.reader_id = reader_id or f"reader-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.lease_ttl_s = lease_ttl_s
        self.transfer_timeout_s = transfer_timeout_s
        self.load_batch_bytes = load_batch_bytes
        from mx_refit.publisher import _routing

        self.transport = _routing(transport, transport_mode, f"mx-recv-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._owns_transport = self.transport is not transport  # ours (a given NIXL one stays open)
        self._arena: "torch.Tensor | None" = None
        self._cached_plan: "tuple[int, ReceivePlan, dict[str, list[tuple[int, int, int]]]] | None" = None
        self._cached_widening: "tuple[Any, Verification] | None" = None
        self._renewer = LeaseRenewer(f"mx-refit-lease[{self.reader_id}]")  # one thread for every refit's lease
        self.fanout = fanout
        self.max_readers_per_source = max_readers_per_source
        self.replica: ReplicaSource | None = None
        if fanout == "tree":
            from mx_refit._replica import ReplicaSource

            self.replica = ReplicaSource(
                self.client, self.transport, model, f"replica-{self.reader_id}",
                ttl_s=lease_ttl_s, withdraw_timeout_s=lease_ttl_s + transfer_timeout_s,
            )
        # Without fan-out or a reader cap the lease names no sources, so it can be taken before
        # planning, in the call that finds the version (one catalog round trip fewer per refit).
        self._lease_in_discovery = (
            isinstance(self.client, LeasingCatalog) and fanout == "none" and not max_readers_per_source
        )
        # A client that runs work while its lease call is answered readies the next read meanwhile.
        self._overlaps_lease = overlaps_lease(self.client)

    @classmethod
    def from_config(
        cls,
        cfg: "WeightSyncConfig",
        *,
        target: TargetLayout | None = None,
        engine: Any = None,
        device: str = "cpu",
        catalog: "str | Catalog | None" = None,
        **overrides: Any,
    ) -> "Receiver":
        """A receiver for ``cfg.model_name`` with the config's lease TTL, transfer timeout,
        ``full_tensors``, plugin allow-list and role overrides (``Hooks.configure`` receives the
        whole block).

        :param target: Default: the plugins' layout for ``engine`` with ``full_tensors`` from the
            config; an explicit target is used as given.
        :param catalog: Default: ``cfg.catalog.address`` with ``cfg.catalog.token``.
        :param overrides: Any other constructor argument (they win over the config).
        """
        import dataclasses

        from mx_refit.config import as_dict
        from mx_refit.publisher import _catalog_from_config

        kwargs: dict[str, Any] = {
            "token": cfg.catalog.token,
            "lease_ttl_s": cfg.lease_ttl_s,
            "transfer_timeout_s": cfg.transfer_timeout_s,
            "transport_mode": cfg.transport,
            "checksums": cfg.checksums,
            "fanout": cfg.fanout,
            "max_readers_per_source": cfg.max_readers_per_source,
        }
        kwargs.update(overrides)
        if kwargs.get("hooks") is None:
            from mx_refit.plugins import Hooks

            kwargs["hooks"] = Hooks(allow=cfg.plugins)
        hooks = kwargs["hooks"]
        hooks.configure(as_dict(cfg))
        if target is None:
            target = dataclasses.replace(hooks.target_layout(engine), full_tensors=cfg.full_tensors)
        return cls(
            _catalog_from_config(cfg, catalog), kwargs.pop("model", cfg.model_name),
            target=target, engine=engine, device=device, **kwargs,
        )

    # -- discovery ----------------------------------------------------------------------------
    def discover(self, version: int | None = None, *, min_version: int = 0, wait_s: float = 0.0) -> VersionInfo:
        """The exact READY ``version``, or the newest READY one >= ``min_version``.

        With ``wait_s`` > 0, keeps asking until one appears or the time runs out.
        """
        wait = Backoff(wait_s)
        while True:
            try:
                return self.client.get_version(model=self.model, version=version, min_version=min_version)
            except (NotFound, FailedPrecondition):
                if not wait.sleep():
                    raise

    def _find_and_lease(
        self, version: int | None, min_version: int, wait_s: float
    ) -> tuple[VersionInfo, str, float]:
        """The version to refit, found and leased in one catalog call (waiting up to ``wait_s``
        for one to turn READY); returns it, the lease id and the local time the call was sent."""
        wait = Backoff(wait_s)
        while True:
            acquired_at = time.monotonic()  # the lease's clock starts when the call is sent
            try:
                overlap = {"while_waiting": self._prime} if self._overlaps_lease else {}
                leased = self.client.lease_version(  # type: ignore[attr-defined]  # a LeasingCatalog
                    self.model, self.reader_id, version, min_version, self.lease_ttl_s, **overlap
                )
                return leased.info, leased.lease_id, acquired_at
            except (NotFound, FailedPrecondition):
                if not wait.sleep():
                    raise

    def _prime(self) -> None:
        """Ready the transport's next read into the arena (run while the catalog answers)."""
        prime = getattr(self.transport, "prime", None)
        if prime is None or self._arena is None:
            return
        try:
            prime(self._arena)
        except Exception as exc:  # an optimisation only: the read does the setup itself
            log.debug("receiver %s: priming the read failed: %s", self.reader_id, exc)

    def _guard(self, info: VersionInfo, lease_id: str, acquired_at: float) -> LeaseGuard:
        return LeaseGuard(
            self.client, lease_id, self.lease_ttl_s, acquired_at=acquired_at,
            label=f"model {self.model!r} version {info.version}", renewer=self._renewer,
        )

    # -- the refit cycle ------------------------------------------------------------------------
    def refit(
        self, version: int | None = None, *, min_version: int = 0, wait_s: float = 0.0, notify: bool = True
    ) -> RefitResult:
        """Discover, lease, pull every needed byte, release, then materialise and load.

        Nothing reaches the engine until every byte has arrived and been size-checked and the
        lease is known to have been held for the whole pull (the catalog's answer to the
        release, or the lease's own deadline when every source promised a restart fence:
        ``stats.lease_confirmed_by``), so a failed pull leaves the engine's previous weights
        untouched. A lease that was lost (its TTL ran out,
        heartbeats could not reach the catalog, the catalog restarted) raises
        :class:`~mx_refit.errors.LeaseLost` naming the lease and the cause; a renewal that
        finds the lease gone aborts the pull at once. A source that fails mid-pull (killed, its
        NIXL agent disconnected, its reads timing out) has its ranges read from another source
        holding the same bytes (``stats.failed_over``); when none does, the refit raises
        :class:`~mx_refit.errors.TransferError` naming the source and the ranges.

        :param notify: fire ``mx_refit_refit_done`` at the end. Engines that load the returned
            tensors themselves pass ``False`` and call ``hooks.refit_done(result.stats)`` once
            their load finished.

        On any error ``mx_refit_refit_failed`` fires (with the version, when one was found)
        before the error is re-raised.
        """
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not (0 <= wait_s < float("inf")):
            raise InvalidArgument(f"wait_s: must be a finite number of seconds >= 0, got {wait_s!r}")
        attempt: list[int] = []  # the version being refitted, once discovered
        try:
            return self._refit(attempt, version, min_version, wait_s, notify)
        except Exception as exc:
            error = exc
            if self._closing and not isinstance(exc, TransferError):
                # Closed under the refit: whichever part noticed first (the lease, the catalog
                # client, the transport), the caller sees one kind of error.
                error = TransferError(f"receiver {self.reader_id!r} was closed during the refit: {exc}")
                error.__cause__ = exc
            try:
                self.hooks.refit_failed(self.model, attempt[0] if attempt else version, error)
            except Exception:  # a failing observer must not hide the refit's own error
                log.exception("mx_refit_refit_failed hook raised")
            if error is exc:
                raise
            raise error from exc

    def _refit(
        self, attempt: list[int], version: int | None, min_version: int, wait_s: float, notify: bool
    ) -> RefitResult:
        began = time.perf_counter()
        lease: LeaseGuard | None = None
        if self._lease_in_discovery:
            info, lease_id, acquired_at = self._find_and_lease(version, min_version, wait_s)
            lease = self._guard(info, lease_id, acquired_at)
            lease.start()  # planning below runs under the lease
        else:
            info = self.discover(version, min_version=min_version, wait_s=wait_s)
        discovered = time.perf_counter()
        attempt.append(info.version)
        try:
            live = {s.source_id for s in info.sources}
            for gone in self.transport.known_sources() - live:  # expired or replaced: close its handles
                self.transport.forget(gone)
            planned = time.perf_counter()
            plan, requests = self._plan(info)
            widening = self._widen(info, plan, requests) if self.checksums else None
            requests = widening.requests if widening else requests
            trainer_requests = requests  # what the arena mirrors, in the trainer sources' addresses
            plan_seconds = time.perf_counter() - planned
            registrations_before = self.transport.registrations

            leasing = time.perf_counter()
            if lease is None:
                if self.replica is not None:
                    self.replica.withdraw()  # nobody reads the arena any more before it is written
                info, sources, requests, acquired_at, lease_id = self._lease(info, requests)
                lease = self._guard(info, lease_id, acquired_at)
                lease.start()
            else:
                sources = {s.source_id: s for s in info.sources}
            leased = time.perf_counter()
            arena = self._arena_for(widening.arena_bytes if widening else plan.arena_bytes)
            started = time.perf_counter()
            lease.watch_sources({*sources, *(s.source_id for s in info.sources)})  # every holder failover may read
            pulled_by = self._pull(info, sources, requests, arena, lease)
            report = pulled_by.report
            seconds = time.perf_counter() - started
            blocks = 0
            if widening is not None:
                # Every pulled block against its checksum, still under the lease: a reader whose
                # bytes fail is not a completed read (`wait_read` keeps waiting for it), and the
                # publisher's buffers are still there for a retry of the same version.
                from mx_refit.checksums import verify

                blocks = verify(arena, widening, {s.source_id: s for s in info.sources})
            verified = time.perf_counter()
        except BaseException:
            if lease is not None:
                lease.abandon()
            raise
        # Every byte is in the arena: this reader is done with the publisher's buffers. The
        # lease is confirmed held until now (by the catalog's answer, or by its own deadline
        # when every source the pull may have read promised a fence), or LeaseLost: the bytes
        # may have been mutated under the pull, and nothing may reach the engine.
        stopping = time.perf_counter()
        fences = [s.lease_fence_s for s in (*sources.values(), *info.sources)]
        confirmed_by = lease.release(completed=True, fence_s=min(fences, default=0.0))
        released = time.perf_counter()

        pulled = sum(report.nbytes.values())
        if self.replica is not None:  # complete, confirmed (and verified): offer it to the next readers
            self.replica.offer(info.version, trainer_requests, arena)
        tensors = list(plan.materialize(arena))
        materialized = time.perf_counter()
        if self.engine is not None:
            for batch in _batches(tensors, self.load_batch_bytes):
                self.hooks.load_weights(self.engine, batch)
        phases = {
            "discover": discovered - began, "plan": plan_seconds, "lease": leased - leasing,
            "heartbeat_start": started - leased, "pull": seconds, "verify": verified - started - seconds,
            "release": released - stopping, "materialize": materialized - released,
            "load": time.perf_counter() - materialized,
        }
        stats = RefitStats(
            model=self.model,
            version=info.version,
            tensors=len(tensors),
            bytes_pulled=pulled,
            bytes_needed=plan.bytes_needed,
            descriptors=report.descriptors,
            seconds=seconds,
            new_registrations=self.transport.registrations - registrations_before,
            sources=len(requests),
            plan_seconds=plan_seconds,
            transport=report.path,
            handles_opened=report.handles_opened,
            blocks_verified=blocks,
            phase_seconds=phases,
            replicas_read=len(sources.keys() - {s.source_id for s in info.sources}),
            failed_over=pulled_by.failed_over,
            bytes_reread=pulled_by.bytes_reread,
            lease_confirmed_by=confirmed_by,
        )
        if notify:
            self.hooks.refit_done(stats)
        log.info(
            "refit %s v%d: %d tensors, %.1f MB in %.3fs (%.2f GB/s) over %s",
            self.model, info.version, stats.tensors, pulled / 1e6, seconds, stats.gbps, stats.transport,
        )
        return RefitResult(version=info, plan=plan, tensors=tensors, stats=stats)

    def _arena_for(self, nbytes: int) -> "torch.Tensor":
        """The receive arena: registered once, reused every cycle, grown only when needed."""
        import torch

        if self._arena is None or self._arena.numel() < nbytes:
            if self._arena is not None:
                self.transport.deregister(self._arena)
            self._arena = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            # Pinned now; registered with NIXL only when a source is read over NIXL.
            self.transport.register_many([self._arena], nixl=False)
        return self._arena

    def _plan(self, info: VersionInfo) -> "tuple[ReceivePlan, dict[str, list[tuple[int, int, int]]]]":
        """The plan and its per-source coalesced arena-relative reads, cached by layout.

        Trainers republish the same buffers every step, so from the second cycle on the layout
        (sources, descriptors, sidecar) is unchanged and neither planning nor coalescing is redone.
        """
        from mx_refit.ranges import coalesce, split_at

        key = _layout_key(info, self.target)
        if self._cached_plan is not None and self._cached_plan[0] == key:
            return self._cached_plan[1], self._cached_plan[2]
        plan = self.hooks.plan_receive(info, self.target)
        grouped: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
        for read in plan.reads:
            grouped[read.source_id].append((read.remote_addr, read.local_offset, read.nbytes))
        sources = {s.source_id: s for s in info.sources}
        requests = {
            source_id: split_at(coalesce(ops), _region_edges(sources[source_id]))
            for source_id, ops in grouped.items()
        }
        for source in info.sources:
            kinds = {(d.mem_type.value, d.device_id) for d in source.tensors}
            if len(kinds) > 1:
                raise InvalidArgument(
                    f"source {source.source_id!r} publishes tensors in {len(kinds)} memory locations "
                    f"{sorted(kinds)}; one source must publish from one device"
                )
        self._cached_plan = (key, plan, requests)
        return plan, requests

    def _widen(
        self, info: VersionInfo, plan: "ReceivePlan", requests: dict[str, list[tuple[int, int, int]]]
    ) -> "Verification":
        """The plan's reads widened to whole checksum blocks (see :mod:`mx_refit.checksums`),
        cached like the plan: by its layout and each source's block size."""
        from mx_refit.checksums import widen

        blocks = tuple((s.source_id, s.checksums.block_bytes if s.checksums else 0) for s in info.sources)
        key = (self._cached_plan[0] if self._cached_plan else None, blocks)
        if self._cached_widening is None or self._cached_widening[0] != key:
            sources = {s.source_id: s for s in info.sources}
            self._cached_widening = (key, widen(requests, sources, plan.arena_bytes))
        return self._cached_widening[1]
    def _lease(
        self, info: VersionInfo, requests: dict[str, list[tuple[int, int, int]]]
    ) -> "tuple[VersionInfo, dict[str, SourceInfo], dict[str, list[tuple[int, int, int]]], float, str]":
        """Choose where to read (fan-out: the least read holder of each trainer source's bytes
        under the reader cap) and lease the version naming those sources. Without fan-out: the
        trainer sources, and a lease naming none (as before fan-out existed).

        Returns the version as last discovered, the chosen sources and their requests, the
        local time the lease call was sent and the lease id."""
        if self.fanout == "none" and not self.max_readers_per_source:
            acquired_at = time.monotonic()
            lease_id = self.client.acquire_lease(
                model=self.model, version=info.version, reader_id=self.reader_id, ttl_s=self.lease_ttl_s
            )
            return info, {s.source_id: s for s in info.sources}, requests, acquired_at, lease_id
        from mx_refit.fanout import choose_sources

        # Every holder busy: wait for a replica to turn ready rather than queue on the trainer.
        wait = Backoff(self.transfer_timeout_s, first_s=0.005, max_s=0.025)
        while True:
            choice = choose_sources(
                info, requests, reader_id=self.reader_id, max_readers=self.max_readers_per_source,
                exclude=() if self.fanout == "tree" else {r.source_id for r in info.replicas},
            )
            if choice is not None:
                acquired_at = time.monotonic()
                try:
                    lease_id = self.client.acquire_lease(
                        model=self.model, version=info.version, reader_id=self.reader_id,
                        ttl_s=self.lease_ttl_s, sources=sorted(choice.sources),
                        max_readers_per_source=self.max_readers_per_source,
                    )
                except SourcesBusy:
                    pass  # another reader took the last slot first: look again
                else:
                    log.debug("%s v%d: reading %s (readers %s)", self.model, info.version, choice.via, info.readers)
                    return info, choice.sources, choice.requests, acquired_at, lease_id
            if not wait.sleep():
                raise TransferError(
                    f"model {self.model!r} version {info.version}: every holder of the needed bytes "
                    f"still serves {self.max_readers_per_source} readers after {self.transfer_timeout_s:g}s"
                )
            info = self.client.get_version(model=self.model, version=info.version)

    def _pull(
        self,
        info: VersionInfo,
        sources: dict[str, SourceInfo],
        requests: dict[str, list[tuple[int, int, int]]],
        arena: "torch.Tensor",
        lease: LeaseGuard,
    ) -> "FailoverPull":
        """Every planned byte into ``arena`` from the chosen holders ``sources``; a holder that
        fails mid-pull has its ranges read from another, or the pull fails naming it and the
        ranges (``mx_refit.failover``)."""
        from mx_refit.failover import pull_with_failover

        pulled = pull_with_failover(
            self.transport, info, sources, requests, arena, timeout_s=self.transfer_timeout_s,
            abort_check=lease.check,  # a lost lease ends the pull at once
            gone=lease.gone_sources,  # a source whose heartbeats stopped fails over at once
            edges=_region_edges, label=f"refit of model {self.model!r} version {info.version}",
        )
        moved = sum(pulled.report.nbytes.values())
        expected = sum(n for ranges in requests.values() for _, _, n in ranges)
        if moved != expected:
            raise TransferError(f"pulled {moved} bytes but the plan needs {expected}")
        return pulled

    def close(self) -> None:
        """Release what this receiver made: its transport (from a given one only the arena is
        deregistered) and the catalog client it dialled. A replica it offers is withdrawn first
        (waiting, bounded, for its readers). A refit running meanwhile fails with a
        :class:`~mx_refit.errors.TransferError` saying the receiver was closed."""
        self._closing = True
        if self.replica is not None:
            try:
                self.replica.withdraw()
            except MxRefitError as exc:  # closing anyway: its readers will see a transfer error
                log.warning("closing receiver %s: %s", self.reader_id, exc)
            self.replica.stop()
        self._renewer.close()
        if self._owns_transport:
            self.transport.close()
        elif self._arena is not None:
            self.transport.deregister(self._arena)
        self._arena = None
        if self._owns_client:
            self.client.close()  # type: ignore[attr-defined]  # a CatalogClient

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _region_edges(source: SourceInfo) -> list[int]:
    """Sorted start/end addresses of the source's registered regions (each tensor's own extent
    when the source did not say), where a merged read must be cut."""
    spans = source.regions or tuple((d.addr, d.nbytes) for d in source.tensors)
    return sorted({edge for addr, nbytes in spans for edge in (addr, addr + nbytes)})


def _layout_key(info: VersionInfo, target: TargetLayout) -> int:
    """A fingerprint of everything a plan depends on (not the version number or NIXL metadata).

    The catalog stamps every source with a digest of its descriptors and regions, and the
    version with one of its sidecar: when all are there, the key is built from them, without
    walking every descriptor or re-encoding the sidecar. Otherwise (a VersionInfo built by
    hand, or an older catalog) every descriptor is walked.
    """
    import json

    if info.sidecar_digest and all(s.layout_digest for s in info.sources):
        digests = tuple((s.source_id, s.layout_digest) for s in info.sources)
        return hash((info.model, target, "digests", digests, info.sidecar_digest))
    sources = tuple(
        (s.source_id, s.regions, tuple(
            (d.name, d.dtype, d.global_shape, d.local_shape, d.addr, d.nbytes, d.role, d.shard_axis,
             d.shard_offset, d.mem_type, d.device_id, repr(d.extras) if d.extras else "")
            for d in s.tensors
        ))
        for s in info.sources
    )
    return hash((info.model, target, sources, json.dumps(info.sidecar, sort_keys=True, default=str)))


def _batches(
    tensors: list[tuple[str, "torch.Tensor"]], max_bytes: int
) -> Iterator[list[tuple[str, "torch.Tensor"]]]:
    batch: list[tuple[str, "torch.Tensor"]] = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if batch and size + nbytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append((name, tensor))
        size += nbytes
    if batch:
        yield batch
