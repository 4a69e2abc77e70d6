"""A receiver's replica source (``weight_sync.fanout: tree``): its receive arena, republished in
place after a complete, verified pull, and withdrawn (waiting for its readers) before the arena
is written again."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mx_refit._heartbeat import Heartbeat
from mx_refit.errors import FailedPrecondition, MxRefitError, NotFound
from mx_refit.receive.fanout import replica_mirrors
from mx_refit.types import MemType, MeshPosition, SourceInfo, TensorDescriptor

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mx_refit.catalog.api import Catalog
    from mx_refit.transport.base import Transport

__all__ = ["ARENA_TENSOR", "ReplicaSource"]

log = logging.getLogger(__name__)

ARENA_TENSOR = "mx_refit.receive_arena"  # the one "tensor" a replica source registers


class ReplicaSource:
    """Offers one receiver's arena as a replica of the version it last pulled.

    :param withdraw_timeout_s: longest :meth:`withdraw` waits for the replica's readers (their
        leases end by release or TTL, so the readers' lease TTL bounds it).
    """

    def __init__(
        self, catalog: "Catalog", transport: "Transport", model: str, source_id: str, *,
        ttl_s: float, withdraw_timeout_s: float,
    ) -> None:
        self.catalog = catalog
        self.transport = transport
        self.model = model
        self.source_id = source_id
        self.ttl_s = ttl_s
        self.withdraw_timeout_s = withdraw_timeout_s
        self.version: int | None = None  # the version offered now, if any
        self.info: SourceInfo | None = None
        self._heartbeat: Heartbeat | None = None

    def offer(self, version: int, requests: dict[str, list[tuple[int, int, int]]], arena: "torch.Tensor") -> bool:
        """Register ``arena`` (holding every byte of ``requests``, per trainer source) as a ready
        replica of ``version``. Only call once the pull is complete and its lease confirmed.
        False (logged) when the catalog refuses (e.g. the version was retired meanwhile)."""
        if self.version is not None:
            raise FailedPrecondition(
                f"replica {self.source_id!r} still offers version {self.version}; withdraw it first"
            )
        self.transport.register_many([arena], nixl=True)  # readable by peers over NIXL
        region = self.transport.region_of(arena)
        agent_name, metadata, export = self.transport.describe([region])
        vram = arena.device.type == "cuda"
        arena_desc = TensorDescriptor(
            name=ARENA_TENSOR, dtype="uint8", global_shape=(region[1],), local_shape=(region[1],),
            addr=region[0], nbytes=region[1], mem_type=MemType.VRAM if vram else MemType.DRAM,
            device_id=(arena.device.index or 0) if vram else 0,
        )
        info = SourceInfo(
            source_id=self.source_id, mesh=MeshPosition(), agent_name=agent_name,
            agent_metadata=metadata, tensors=(arena_desc,), ready=True, regions=(region,),
            cuda_ipc=export, mirrors=replica_mirrors(requests, arena.data_ptr()),
        )
        try:
            self.catalog.register_replica(self.model, version, info, ttl_s=self.ttl_s)
        except MxRefitError as exc:
            log.warning("%s: not offering %s v%d as a replica: %s", self.source_id, self.model, version, exc)
            return False
        self.stop()
        self.version, self.info = version, info
        self._heartbeat = Heartbeat(
            self._beat, min(self.ttl_s / 3, 2.0), name=f"mx-refit-replica[{self.source_id}]"
        )
        self._heartbeat.start()
        return True

    def _beat(self) -> None:
        if self.version is None:
            return
        try:
            self.catalog.heartbeat(source_ids=[self.source_id])
        except NotFound:
            # The catalog forgot it (its version was retired and pruned, or the TTL lapsed):
            # nobody can lease it any more, so there is nothing left to keep alive.
            log.info("%s: replica of %s v%s no longer known to the catalog", self.source_id, self.model, self.version)
            self.version, self.info = None, None

    def withdraw(self) -> None:
        """Stop offering the replica and wait until nobody reads it; after this the arena may be
        overwritten. ``FailedPrecondition`` when readers still hold it after the timeout (the
        arena must then not be touched)."""
        if self.version is None:
            self.stop()  # a heartbeat may have found it forgotten: only the thread is left
            return
        drained = self.catalog.withdraw_replica(self.model, self.version, self.source_id, self.withdraw_timeout_s)
        if not drained:
            raise FailedPrecondition(
                f"replica {self.source_id!r} of {self.model!r} version {self.version} is still read "
                f"after {self.withdraw_timeout_s:g}s; its arena is kept intact"
            )
        self.stop()

    def stop(self) -> None:
        """Forget the offer locally (the catalog forgot it, or its TTL will drop it)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        self.version, self.info = None, None
