"""Trainer side: publish this rank's native tensors in place, version after version."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mx_refit._backoff import Backoff
from mx_refit._heartbeat import Heartbeat
from mx_refit.catalog.epoch import PublisherEpochs
from mx_refit.checks import AUTO, check_count, check_flag, check_seconds
from mx_refit.checksums import start_source_checksums
from mx_refit.config import DEFAULT_CHECKSUM_BLOCK_BYTES, DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_LEASE_TTL_S, DEFAULT_SOURCE_TTL_S
from mx_refit.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from mx_refit.types import BlockChecksums, MemType, MeshPosition, PublishedTensor, SourceInfo, TensorDescriptor, VersionState

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mx_refit.catalog.api import Catalog, VersionSummary
    from mx_refit.config import WeightSyncConfig
    from mx_refit.plugins import Hooks
    from mx_refit.transport.base import Transport
    from mx_refit.transport.nixl import NixlTransport

__all__ = ["Publisher", "describe", "mesh_source_id", "process_incarnation"]

log = logging.getLogger(__name__)

# Sources heartbeat at a third of their TTL, but at least this often, so a publisher notices a
# restarted catalog (and re-registers) within a few seconds.
_MAX_BEAT_INTERVAL_S = 2.0
_incarnation: tuple[int, str] | None = None


def process_incarnation() -> str:
    """This process's incarnation: unique per process start (a forked child gets its own)."""
    global _incarnation
    if _incarnation is None or _incarnation[0] != os.getpid():
        _incarnation = (os.getpid(), f"{os.getpid()}-{time.time_ns():x}-{uuid.uuid4().hex[:8]}")
    return _incarnation[1]


@dataclass(frozen=True)
class _Live:
    """A published version whose buffers are still intact (not yet drained): what it takes to
    register it again with a catalog that lost it."""

    source: SourceInfo
    sidecar: dict[str, Any]


def describe(published: PublishedTensor) -> TensorDescriptor:
    """The catalog descriptor of a live tensor: its address, size and shard geometry."""
    tensor = published.tensor
    if not tensor.is_contiguous():
        raise InvalidArgument(f"tensors[{published.name!r}]: not contiguous; mx-refit publishes in place, never copies")
    local_shape = tuple(int(d) for d in tensor.shape)
    return TensorDescriptor(
        name=published.name,
        dtype=str(tensor.dtype).removeprefix("torch."),
        global_shape=tuple(published.global_shape) if published.global_shape is not None else local_shape,
        local_shape=local_shape,
        addr=int(tensor.data_ptr()),
        nbytes=int(tensor.numel() * tensor.element_size()),
        role=published.role,
        shard_axis=published.shard_axis,
        shard_offset=published.shard_offset,
        mem_type=MemType.VRAM if tensor.is_cuda else MemType.DRAM,
        device_id=int(tensor.device.index or 0) if tensor.is_cuda else 0,
        extras=dict(published.extras),
        compile_target=published.compile_target,
        compile_metadata=dict(published.compile_metadata),
    )


def _revision(checksums: "BlockChecksums | None") -> str:
    """Content-addressed from the block checksums when they are on (equal sums of the same
    source: equal bytes, up to the checksum's strength); not stated otherwise."""
    if checksums is None:
        return ""
    import hashlib

    from mx_refit.types import PackedSums

    # the sums as packed on the wire ("b2:" hashed their decimal text, one str per block)
    data = f"{checksums.block_bytes}:".encode() + PackedSums.of(checksums.sums).packed
    return "b2p:" + hashlib.blake2b(data, digest_size=16).hexdigest()


def mesh_source_id(model: str, mesh: MeshPosition) -> str:
    """``model/tp0-pp0-ep0``: a source's id from its mesh position. The expert-TP rank is added
    (``-etp1``) when expert TP differs from TP: then two publishing ranks may share (tp, pp, ep)
    and differ only there (a rank that publishes only its expert shards)."""
    etp = f"-etp{mesh.etp_rank}" if mesh.etp_size and mesh.etp_size != mesh.tp_size else ""
    return f"{model}/tp{mesh.tp_rank}-pp{mesh.pp_rank}-ep{mesh.ep_rank}{etp}"


class Publisher:
    """One trainer rank's publishing endpoint.

    Typical step loop::

        pub = Publisher(address, "qwen3", mesh=MeshPosition(tp_rank=r, tp_size=4), expected_sources=4)
        pub.publish(step, model=model)      # register in place, register source, mark ready
        pub.wait_ready(step, timeout_s=60)  # every rank has published: tell the engines
        ...                                 # inference workers pull
        pub.wait_drained(step)              # before the optimizer mutates the published buffers

    :param catalog: Catalog address (``host:port``) or any object satisfying the
        :class:`~mx_refit.catalog.api.Catalog` protocol (a ``CatalogClient``, an in-process
        ``CatalogService``, ...).
    :param expected_sources: How many ranks publish each version; it becomes READY when all have.
    :param transport: The transport to register and serve from; ``None`` makes one for this
        publisher (closed with it). Pass :func:`mx_refit.shared_transport` to share the process's.
    :param ttl_s: Source TTL; a heartbeat renews it every ``ttl_s / 3`` seconds.
    :param expected_readers: How many distinct readers (by ``reader_id``) read each version;
        with it, :meth:`wait_read` replaces :meth:`wait_drained` for trainers that have no
        central driver telling them when the readers are done. 0: not tracked.
    :param drain_timeout_s: Default wait of :meth:`wait_drained` and :meth:`wait_retired`.
    :param lease_fence_s: Once this publisher learns that the catalog lost its registration (a
        restart of a store that keeps nothing, and with it every reader's lease), its drains
        keep the buffers untouched this long. Published with each version: readers whose lease
        TTL is at most this trust their lease's deadline instead of waiting for the release's
        answer (one catalog round trip less per refit). 0: no promise.
    """

    def __init__(
        self,
        catalog: "str | Catalog",
        model: str,
        *,
        mesh: MeshPosition | None = None,
        expected_sources: int = 1,
        source_id: str | None = None,
        token: str | None = None,
        transport: "Transport | NixlTransport | None" = None,
        hooks: "Hooks | None" = None,
        ttl_s: float = DEFAULT_SOURCE_TTL_S,
        expected_readers: int = 0,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        lease_fence_s: float = DEFAULT_LEASE_TTL_S,  # covers readers' leases of the default TTL
        transport_mode: str = AUTO,
        checksums: bool = False,
        checksum_block_bytes: int = DEFAULT_CHECKSUM_BLOCK_BYTES,
        publish_format: str = "bf16",
        delta: str = "off",
        delta_anchor_every: int = 10,
    ) -> None:
        from mx_refit.catalog.connect import as_catalog
        from mx_refit.checks import PUBLISH_FORMATS, check_mode
        from mx_refit.checksums import check_block_bytes
        from mx_refit.plugins import Hooks

        self.publish_format = check_mode(publish_format, "publish_format", PUBLISH_FORMATS)
        self._fp8: Any = None  # mx_refit.fp8.Fp8Publishing once publish_format is fp8_block
        self.checksums = check_flag(checksums, "checksums")
        self._delta: Any = None  # mx_refit.delta.tracker.DeltaTracker unless delta is "off"
        if check_mode(delta, "delta", ("off", "auto", "on")) != "off":
            from mx_refit.delta.tracker import DeltaTracker

            self._delta = DeltaTracker(delta_anchor_every)
            self.checksums = True  # readers prove the base they hold by its checksums
        self.checksum_block_bytes = check_block_bytes(checksum_block_bytes, "checksum_block_bytes")
        self.model = model
        self.mesh = mesh or MeshPosition()
        self.mesh.validate()
        check_count(expected_sources, "expected_sources", minimum=1)
        check_seconds(ttl_s, "ttl_s")
        self.lease_fence_s = check_seconds(lease_fence_s, "lease_fence_s", allow_zero=True)
        self._fenced_until = 0.0  # monotonic: no mutation before (the catalog lost our leases)
        self.expected_sources = expected_sources
        # Stable per mesh position, so a restarted rank replaces its own entry.
        self.source_id = source_id or mesh_source_id(model, self.mesh)
        self.client: Catalog = as_catalog(catalog, token=token)
        self._epochs = PublisherEpochs(self.client, self.source_id)  # see mx_refit.catalog.epoch
        self._owns_client = isinstance(catalog, str)  # made here from an address: closed here
        self.hooks = hooks or Hooks()
        self.ttl_s = ttl_s
        self.expected_readers = expected_readers
        self.drain_timeout_s = drain_timeout_s
        self._published: list[torch.Tensor] = []  # deregistered on close from a shared transport
        from mx_refit.transport.routing import RoutingTransport

        self.transport: Transport = RoutingTransport.wrap(
            transport, transport_mode, name=f"mx-pub-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self._owns_transport = self.transport is not transport  # ours (a given one stays open)
        self._last_published: int | None = None
        self._last_drained: int | None = None
        self.incarnation = process_incarnation()
        self._live: dict[int, _Live] = {}
        self._live_lock = threading.Lock()  # held while re-registering: drains wait for it
        self.reregistrations = 0  # versions registered again with a catalog that lost them
        self.superseded: str | None = None  # set when a restarted rank took this source_id over
        self._heartbeat = Heartbeat(
            self._beat, min(ttl_s / 3, _MAX_BEAT_INTERVAL_S), name=f"mx-refit-publisher[{self.source_id}]"
        )

    @property
    def quantize_seconds(self) -> float:
        """Wall seconds the last publish spent quantising (publish_format fp8_block), else 0."""
        return self._fp8.seconds if self._fp8 is not None else 0.0

    @classmethod
    def from_config(
        cls,
        cfg: "WeightSyncConfig",
        *,
        mesh: MeshPosition | None,
        expected_sources: int,
        catalog: "str | Catalog | None" = None,
        **overrides: Any,
    ) -> "Publisher":
        """A publisher for ``cfg.model_name`` with the config's TTL, drain timeout, plugin
        allow-list and role overrides (``Hooks.configure`` receives the whole block).

        :param catalog: Default: ``cfg.catalog.address`` (standalone, or an embedded catalog
            started with ``start_catalog(config=cfg)``) with ``cfg.catalog.token``.
        :param overrides: Any other constructor argument (they win over the config).
        """
        from mx_refit.config import as_dict, catalog_argument

        kwargs: dict[str, Any] = {
            "mesh": mesh,
            "expected_sources": expected_sources,
            "token": cfg.catalog.token,
            "ttl_s": cfg.source_ttl_s,
            "drain_timeout_s": cfg.drain_timeout_s,
            "lease_fence_s": cfg.lease_ttl_s,  # covers the readers' leases of the same recipe
            "transport_mode": cfg.transport,
            "checksums": cfg.checksums,
            "checksum_block_bytes": cfg.checksum_block_bytes,
            "publish_format": cfg.publish_format,
            "delta": cfg.delta,
            "delta_anchor_every": cfg.delta_anchor_every,
        }
        kwargs.update(overrides)
        if kwargs.get("hooks") is None:
            from mx_refit.plugins import Hooks

            kwargs["hooks"] = Hooks(allow=cfg.plugins)
        kwargs["hooks"].configure(as_dict(cfg))
        return cls(catalog_argument(cfg, catalog), kwargs.pop("model", cfg.model_name), **kwargs)

    def _beat(self) -> None:
        try:
            self.client.heartbeat(
                source_ids=[self.source_id], incarnations={self.source_id: self.incarnation}
            )
            if self._epochs.beat_moved():  # it kept our registration but may have lost later writes
                self._reregister()  # the catalog's drain holds the fence for what it had
        except NotFound:
            # The catalog lost this source (it restarted, or our TTL lapsed): register every
            # version whose buffers are still intact again, so readers resume.
            self._catalog_lost()
            self._reregister()
        except FailedPrecondition as exc:
            if self.superseded is None:
                log.error("%s: replaced by a restarted rank; this publisher is stale: %s", self.source_id, exc)
            self.superseded = str(exc)
            raise

    def _reregister(self) -> None:
        with self._live_lock:
            for version, live in sorted(self._live.items()):
                try:
                    self.client.register_source(
                        model=self.model, version=version, expected_sources=self.expected_sources,
                        source=live.source, sidecar=live.sidecar, ttl_s=self.ttl_s,
                        expected_readers=self.expected_readers,
                    )
                except (FailedPrecondition, InvalidArgument) as exc:
                    # The catalog holds that number in a state we cannot join (e.g. retired):
                    # it is no longer ours to offer.
                    log.warning("%s: not re-registering %s v%d: %s", self.source_id, self.model, version, exc)
                    del self._live[version]
                    continue
                self.reregistrations += 1
                log.info("%s: re-registered %s v%d with the catalog", self.source_id, self.model, version)

    def publish(
        self,
        version: int,
        tensors: Sequence[PublishedTensor] | None = None,
        *,
        model: Any = None,
        sidecar: dict[str, Any] | None = None,
    ) -> VersionState:
        """Publish ``version``: from explicit ``tensors``, or collected from ``model`` by plugins.

        Registration is cached by the transport, so republishing the same buffers costs no new
        NIXL registration and exports no new CUDA IPC handle. The buffers stay pinned (never
        freed) until :meth:`release_buffers`. The tensors' bytes must be final: on CUDA,
        synchronise the stream that wrote them first. Returns the version's state after this
        rank marked ready.
        """
        if (tensors is None) == (model is None):
            raise InvalidArgument("publish: pass exactly one of tensors=... or model=...")
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**63:
            raise InvalidArgument(f"version: must be an integer in [0, 2**63), got {version!r}")
        merged_sidecar = dict(sidecar or {})
        if model is not None:
            tensors = self.hooks.collect_tensors(model, self.mesh)
            for key, value in self.hooks.build_sidecar(model, self.mesh).items():
                merged_sidecar.setdefault(key, value)
        assert tensors is not None
        compat = None
        if self.publish_format != "bf16":  # quantised into persistent buffers before mark_ready
            from mx_refit.fp8 import Fp8Publishing

            self._fp8 = self._fp8 or Fp8Publishing()
            tensors = self._fp8.convert(tensors)
            self._fp8.extend_sidecar(merged_sidecar)
            compat = self._fp8.compat()
        descriptors = tuple(describe(t) for t in tensors)
        buffers = [t.tensor for t in tensors]
        # The source sums start on the tensors' devices (a GPU's side stream) while we register.
        pending = start_source_checksums(buffers, self.checksum_block_bytes) if self.checksums else None
        records = [self._delta.buffer_for(buffers)] if self._delta is not None else []  # a region of its own
        self.transport.register_many(buffers + records)
        if not self._owns_transport:
            self._published = buffers + records
        regions = sorted({self.transport.region_of(t) for t in buffers + records if t.numel()})
        agent_name, metadata, cuda_ipc = self.transport.describe(regions)
        checksums = pending.result() if pending is not None else None  # only the sums reach the host
        delta = self._delta.publish(version, buffers, checksums) if self._delta is not None else None
        source = SourceInfo(
            source_id=self.source_id,
            mesh=self.mesh,
            agent_name=agent_name,
            agent_metadata=metadata,
            tensors=descriptors,
            regions=tuple(regions),
            cuda_ipc=cuda_ipc,
            incarnation=self.incarnation,
            checksums=checksums,
            lease_fence_s=self.lease_fence_s,
            revision=_revision(checksums),
            compat=compat,
            delta=delta,
        )
        self.client.register_source(
            model=self.model,
            version=version,
            expected_sources=self.expected_sources,
            source=source,
            sidecar=merged_sidecar,
            ttl_s=self.ttl_s,
            expected_readers=self.expected_readers,
        )
        state = self.client.mark_ready(model=self.model, version=version, source_id=self.source_id)
        self._epochs.registered(version)
        self._last_published = version
        with self._live_lock:
            # Older versions published from the same buffers were overwritten by this one.
            spans = set(source.regions)
            for older in [v for v, live in self._live.items() if v != version and spans & set(live.source.regions)]:
                del self._live[older]
            self._live[version] = _Live(replace(source, ready=True), merged_sidecar)
        self._heartbeat.start()
        self.hooks.version_published(self.model, version, self.source_id, self.mesh)
        if state == VersionState.READY:
            self.hooks.version_ready(self.model, version)
        log.info("published %s v%d from %s (%d tensors%s)", self.model, version, self.source_id, len(descriptors),
                 f", {self.publish_format} quantised in {self._fp8.seconds:.3f}s" if self._fp8 else "")
        return state

    def wait_ready(self, version: int, timeout_s: float = 120.0) -> None:
        """Wait until ``version`` is READY: every expected source has published it.

        :raises TimeoutError: naming the model, the version and what the catalog last said.
        :raises FailedPrecondition: when the version will never be READY again (a source died,
            or it was retired).
        """
        wait = Backoff(timeout_s)
        while True:
            summary = self._summary(version)
            state = summary.state if summary is not None else None
            if state == VersionState.READY:
                return
            if state in (VersionState.EXPIRED, VersionState.DRAINING, VersionState.RETIRED):
                raise FailedPrecondition(
                    f"version {version} of {self.model!r} is {state.value}; it will not become READY"
                )
            if not wait.sleep():
                seen = (
                    f"{summary.state.value}, {summary.ready_sources}/{summary.expected_sources} sources ready"
                    if summary is not None else "not registered"
                )
                if summary is not None and summary.registered_sources == summary.expected_sources:
                    # Every rank registered, some never became ready: a publish failed after
                    # registering, e.g. the catalog refused sources that leave bytes unpublished.
                    seen += ("; every source registered: a rank's publish failed after registering (the catalog "
                             "refuses a version whose sources leave bytes unpublished; that rank's error names them)")
                raise TimeoutError(
                    f"version {version} of {self.model!r} not READY after {timeout_s:g}s ({seen})"
                )

    def wait_drained(self, version: int, timeout_s: float | None = None) -> None:
        """Stop new readers of ``version`` and wait until live leases end (released or expired).

        Call it before the trainer mutates the published buffers. Fires
        ``mx_refit_version_retired`` once the catalog retired it and ``mx_refit_version_drained``
        once it is drained. Every argument is checked before anything changes. A catalog that
        lost the version with this publisher's registration (it restarted) holds no lease on it,
        so the version counts as drained there once the lease fence is waited out; an
        unreachable catalog is retried until ``timeout_s``, then ``TimeoutError``.

        :param timeout_s: Default: ``drain_timeout_s``.
        :raises NotFound: the catalog does not know ``version`` but still holds this publisher's
            registration (a typo, a pruned version): nothing to drain, and no fence armed.
        """
        timeout_s = self.drain_timeout_s if timeout_s is None else timeout_s
        check_count(version, "version", minimum=0)
        check_seconds(timeout_s, "timeout_s", allow_zero=True)
        with self._live_lock:  # from now on never re-registered
            self._live.pop(version, None)
        deadline = time.monotonic() + timeout_s
        delay, retired = 0.1, False
        while True:
            try:
                self.client.retire_version(model=self.model, version=version)
                if not retired:
                    retired = True
                    self.hooks.version_retired(self.model, version)
                remaining = max(deadline - time.monotonic(), 0.0)
                if self.client.wait_drained(model=self.model, version=version, timeout_s=remaining,
                                            registered_epoch=self._epochs.of(version)):
                    break
            except NotFound:
                if not self._catalog_forgot_us(version):
                    raise NotFound(
                        f"wait_drained: version {version} of {self.model!r} is unknown to the catalog (never "
                        "published, or pruned), which still holds this publisher's registration: nothing to drain"
                    ) from None
                self._catalog_lost()  # forgotten: its leases too, which readers may still hold
                break
            except (Unavailable, FailedPrecondition) as exc:
                # Unreachable, or re-registered as READY by a concurrent beat: retire again.
                log.info("%s: draining %s v%d: %s; retrying", self.source_id, self.model, version, exc)
                time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
                delay = min(delay * 2, 1.0)
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"version {version} of {self.model!r} still has live reader leases after {timeout_s:g}s"
                )
        self._hold_fence(version, deadline)
        self._last_drained = version
        self.hooks.version_drained(self.model, version)

    def _catalog_forgot_us(self, version: int) -> bool:
        """After a NotFound for a version: whether the catalog lost this publisher's registration
        (a restart: it lost the leases too) rather than not knowing that one version."""
        if self._fenced_until > time.monotonic():
            return True  # already learned it lost us (the heartbeat did)
        if self._last_published is None:
            return False  # never registered anything: nothing to lose
        try:
            self.client.heartbeat(source_ids=[self.source_id], incarnations={self.source_id: self.incarnation})
        except (NotFound, Unavailable):  # lost us, or cannot tell: assume the worst
            return True
        except FailedPrecondition:
            return False  # a restarted rank took this source over: the catalog kept its state
        return self._epochs.moved_since(version)  # a rollback may keep us and lose the version

    def _catalog_lost(self) -> None:
        """The catalog no longer knows this source, so it lost any lease on our versions; a
        reader may trust such a lease until its deadline: mutate nothing for the fence."""
        self._fenced_until = max(self._fenced_until, time.monotonic() + self.lease_fence_s)

    def _hold_fence(self, version: int, deadline: float) -> None:
        """Before a drain lets the buffers be mutated: make sure the catalog that said
        "drained" is the one that granted the version's leases (it still knows this source:
        another rank may have re-registered the version with a restarted catalog), and wait
        out the fence if it lost them."""
        if self.lease_fence_s <= 0:
            return
        try:
            self.client.heartbeat(source_ids=[self.source_id], incarnations={self.source_id: self.incarnation})
        except (NotFound, Unavailable):  # lost us, or cannot tell: assume it lost our leases
            self._catalog_lost()
        except FailedPrecondition:
            pass  # a restarted rank took this source over; its own drains decide
        wait = self._fenced_until - time.monotonic()
        if wait <= 0:
            return
        if time.monotonic() + wait > deadline:
            raise TimeoutError(
                f"version {version} of {self.model!r}: the catalog lost its leases, and readers may "
                f"hold them for another {wait:.3g} s (lease_fence_s={self.lease_fence_s:g}) after the timeout"
            )
        log.warning(
            "%s: the catalog lost its leases on %s v%d; leaving the buffers untouched %.3g s more "
            "(lease_fence_s)", self.source_id, self.model, version, wait,
        )
        time.sleep(wait)

    def release_buffers(self) -> int:
        """Unpin every published buffer (NIXL registrations and CUDA IPC exports), so the trainer
        may offload, free or reallocate them; the next :meth:`publish` registers and exports the
        buffers it is given then, and readers notice the new handles.

        Only after the last published version drained (:meth:`wait_drained` or
        :meth:`wait_read`): while a lease is live a reader may be copying from these bytes.
        Returns the number of regions released.

        :raises FailedPrecondition: the last published version has not drained.
        """
        if self._last_published is not None and self._last_drained != self._last_published:
            raise FailedPrecondition(
                f"release_buffers: version {self._last_published} of {self.model!r} has not drained; "
                "call wait_drained(version) first"
            )
        if not self._owns_transport:  # a shared transport: only what this publisher registered
            released = sum(self.transport.deregister(t) for t in self._published)
            self._published = []
            return released
        return self.transport.deregister_all()

    def wait_retired(self, version: int, timeout_s: float | None = None) -> None:
        """Wait, without retiring it, until another process (another rank's
        :meth:`wait_drained`, a controller, ``mx-refit`` tooling) has retired ``version`` and it
        is drained, so this rank may mutate its published buffers too.

        :param timeout_s: Default: ``drain_timeout_s``.
        :raises TimeoutError: naming the model, the version and its last state.
        """
        timeout_s = self.drain_timeout_s if timeout_s is None else timeout_s
        wait = Backoff(timeout_s)
        while True:
            summary = self._summary(version)
            if summary is not None and summary.state in (VersionState.RETIRED, VersionState.EXPIRED):
                break
            if summary is not None and summary.state == VersionState.DRAINING:
                # Retired: the catalog's own wait is exact (it wakes on the last release).
                remaining = max(0.0, wait.deadline - time.monotonic())
                if self.client.wait_drained(model=self.model, version=version, timeout_s=remaining,
                                            registered_epoch=self._epochs.of(version)):
                    break
            if not wait.sleep():
                state = summary.state.value if summary is not None else "forgotten or never registered"
                raise TimeoutError(f"version {version} of {self.model!r} not retired after {timeout_s:g}s ({state})")
        self._hold_fence(version, wait.deadline)
        self.hooks.version_drained(self.model, version)

    def _summary(self, version: int) -> "VersionSummary | None":
        try:
            versions = self.client.list_versions(model=self.model)
        except NotFound:
            return None
        return next((v for v in versions if v.version == version), None)

    def wait_read(self, version: int, timeout_s: float = 120.0) -> None:
        """Wait until every expected reader completed a read of ``version``, then retire it and
        wait for the last leases to end; afterwards its buffers may be mutated.

        Race-free without a central driver: the catalog counts completed reads per version
        (each ``reader_id`` once) from the moment it exists, and nothing is retired until they
        are all in, so a reader that has not leased yet is never locked out. Needs
        ``expected_readers`` > 0. ``timeout_s`` bounds the whole call.
        """
        deadline = time.monotonic() + timeout_s
        progress = self.client.wait_read(model=self.model, version=version, timeout_s=timeout_s)
        if not progress.done:
            raise TimeoutError(
                f"version {version} of {self.model!r}: {progress.describe()} after {timeout_s:g}s"
            )
        self.wait_drained(version, timeout_s=max(deadline - time.monotonic(), 0.0))

    def close(self) -> None:
        """Stop heartbeating (the catalog expires this source after its TTL) and release what
        this publisher made: its transport (from a given one only its tensors are deregistered)
        and the catalog client it dialled."""
        self._heartbeat.stop()
        if self._owns_transport:
            self.transport.close()
        else:
            for tensor in self._published:
                self.transport.deregister(tensor)
            self._published = []
        if self._owns_client:
            self.client.close()  # type: ignore[attr-defined]  # a CatalogClient

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

