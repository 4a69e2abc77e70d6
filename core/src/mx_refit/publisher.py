"""Trainer side: publish this rank's native tensors in place, version after version."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mx_refit._heartbeat import Heartbeat
from mx_refit.errors import InvalidArgument
from mx_refit.types import MemType, MeshPosition, PublishedTensor, SourceInfo, TensorDescriptor, VersionState

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.catalog.client import CatalogClient
    from mx_refit.plugins import Hooks
    from mx_refit.transport.nixl import NixlTransport

__all__ = ["Publisher", "describe"]

log = logging.getLogger(__name__)


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
    )


class Publisher:
    """One trainer rank's publishing endpoint.

    Typical step loop::

        pub = Publisher(address, "qwen3", mesh=MeshPosition(tp_rank=r, tp_size=4), expected_sources=4)
        pub.publish(step, model=model)      # register in place, register source, mark ready
        ...                                 # inference workers pull
        pub.wait_drained(step)              # before the optimizer mutates the published buffers

    :param catalog: Catalog address (``host:port``) or a :class:`CatalogClient`.
    :param expected_sources: How many ranks publish each version; it becomes READY when all have.
    :param ttl_s: Source TTL; a heartbeat renews it every ``ttl_s / 3`` seconds.
    :param expected_readers: How many distinct readers (by ``reader_id``) read each version;
        with it, :meth:`wait_read` replaces :meth:`wait_drained` for trainers that have no
        central driver telling them when the readers are done. 0: not tracked.
    """

    def __init__(
        self,
        catalog: "str | CatalogClient",
        model: str,
        *,
        mesh: MeshPosition | None = None,
        expected_sources: int = 1,
        source_id: str | None = None,
        token: str | None = None,
        transport: "NixlTransport | None" = None,
        hooks: "Hooks | None" = None,
        ttl_s: float = 30.0,
        expected_readers: int = 0,
    ) -> None:
        from mx_refit.catalog.client import CatalogClient
        from mx_refit.plugins import Hooks

        self.model = model
        self.mesh = mesh or MeshPosition()
        self.mesh.validate()
        self.expected_sources = expected_sources
        # Stable per mesh position, so a restarted rank replaces its own entry.
        self.source_id = source_id or (
            f"{model}/tp{self.mesh.tp_rank}-pp{self.mesh.pp_rank}-ep{self.mesh.ep_rank}"
        )
        self.client = catalog if isinstance(catalog, CatalogClient) else CatalogClient(catalog, token=token)
        self.hooks = hooks or Hooks()
        self.ttl_s = ttl_s
        self.expected_readers = expected_readers
        self._owns_transport = transport is None
        if transport is None:
            from mx_refit.transport.nixl import NixlTransport

            transport = NixlTransport(f"mx-pub-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.transport = transport
        self._heartbeat = Heartbeat(self._beat, ttl_s / 3, name=f"mx-refit-publisher[{self.source_id}]")

    def _beat(self) -> None:
        self.client.heartbeat(source_ids=[self.source_id])

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
        NIXL registration. Returns the version's state after this rank marked ready.
        """
        if (tensors is None) == (model is None):
            raise InvalidArgument("publish: pass exactly one of tensors=... or model=...")
        merged_sidecar = dict(sidecar or {})
        if model is not None:
            tensors = self.hooks.collect_tensors(model, self.mesh)
            for key, value in self.hooks.build_sidecar(model, self.mesh).items():
                merged_sidecar.setdefault(key, value)
        assert tensors is not None
        descriptors = tuple(describe(t) for t in tensors)
        self.transport.register_many([t.tensor for t in tensors])
        regions = sorted({self.transport.region_of(t.tensor) for t in tensors if t.tensor.numel()})
        source = SourceInfo(
            source_id=self.source_id,
            mesh=self.mesh,
            agent_name=self.transport.agent_name,
            agent_metadata=self.transport.metadata(),
            tensors=descriptors,
            regions=tuple(regions),
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
        self._heartbeat.start()
        self.hooks.version_published(self.model, version, self.source_id, self.mesh)
        if state == VersionState.READY:
            self.hooks.version_ready(self.model, version)
        log.info("published %s v%d from %s (%d tensors)", self.model, version, self.source_id, len(descriptors))
        return state

    def wait_drained(self, version: int, timeout_s: float = 120.0) -> None:
        """Stop new readers of ``version`` and wait until live leases end (released or expired).

        Call it before the trainer mutates the published buffers.
        """
        self.client.retire_version(model=self.model, version=version)
        if not self.client.wait_drained(model=self.model, version=version, timeout_s=timeout_s):
            raise TimeoutError(
                f"version {version} of {self.model!r} still has live reader leases after {timeout_s:.0f}s"
            )

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
        self._heartbeat.stop()
        if self._owns_transport:
            self.transport.close()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
