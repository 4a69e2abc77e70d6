"""Thin gRPC servicer: convert messages, call :class:`CatalogService`, map errors to statuses.

No catalog logic lives here. Every RPC goes through :func:`_rpc`, the single place where
:mod:`mx_refit.errors` become gRPC status codes (via :mod:`mx_refit.catalog.status`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

import grpc

from mx_refit.catalog import convert
from mx_refit.catalog.service import CatalogService
from mx_refit.catalog.status import fit_details, status_for
from mx_refit.catalog.v1 import catalog_pb2 as pb
from mx_refit.catalog.v1 import catalog_pb2_grpc
from mx_refit.errors import InvalidArgument, MxRefitError

__all__ = ["CatalogServicer"]

logger = logging.getLogger(__name__)

# WaitDrained blocks in steps this long, checking between steps whether the client went away
# or the server is stopping, so neither leaves a thread blocked for a whole wait.
_WAIT_STEP_S = 0.5


def _rpc[Req, Rep](
    handler: Callable[[CatalogServicer, Req, grpc.ServicerContext], Rep],
) -> Callable[[CatalogServicer, Req, grpc.ServicerContext], Rep]:
    """Run ``handler``; turn domain errors into their status code, anything else into INTERNAL."""

    @functools.wraps(handler)
    def wrapper(self: CatalogServicer, request: Req, context: grpc.ServicerContext) -> Rep:
        try:
            return handler(self, request, context)
        except MxRefitError as exc:
            context.abort(status_for(exc), fit_details(str(exc)))
        except Exception:
            # A bug, not a client error: keep the traceback on the server, not in the reply.
            logger.exception("catalog %s failed", handler.__name__)
            context.abort(
                grpc.StatusCode.INTERNAL,
                f"internal catalog error in {handler.__name__} (see the catalog server log)",
            )
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    return wrapper


class CatalogServicer(catalog_pb2_grpc.CatalogServiceServicer):
    """Serves a :class:`CatalogService` over gRPC.

    :param max_wait_slice_s: longest a single WaitDrained call lasts; longer requests return
        ``drained=false`` after it and the client calls again.
    :param stopping: set by the server when it shuts down; pending WaitDrained calls then
        return ``drained=false`` promptly instead of holding up the shutdown.
    """

    def __init__(
        self,
        service: CatalogService,
        *,
        max_wait_slice_s: float = 30.0,
        stopping: threading.Event | None = None,
    ) -> None:
        self.service = service
        self.express_port = 0  # set by the server once its express lane listens
        self._max_wait_slice_s = max_wait_slice_s
        self._stopping = stopping if stopping is not None else threading.Event()

    def _epoch(self) -> str:
        """The store epoch of this thread's last service call: the answer's."""
        return self.service.answer_epoch()

    @_rpc
    def RegisterSource(
        self, request: pb.RegisterSourceRequest, context: grpc.ServicerContext
    ) -> pb.RegisterSourceReply:
        if not request.HasField("source"):
            raise InvalidArgument("source: missing")
        state = self.service.register_source(
            request.model,
            request.version,
            request.expected_sources,
            convert.source_from_proto(request.source),
            convert.json_from_text(request.sidecar_json, "sidecar"),
            request.ttl_s,
            request.expected_readers,
        )
        return pb.RegisterSourceReply(state=convert.state_to_proto(state), catalog_epoch=self._epoch())

    @_rpc
    def MarkReady(
        self, request: pb.MarkReadyRequest, context: grpc.ServicerContext
    ) -> pb.MarkReadyReply:
        state = self.service.mark_ready(request.model, request.version, request.source_id)
        return pb.MarkReadyReply(state=convert.state_to_proto(state), catalog_epoch=self._epoch())

    @_rpc
    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatReply:
        gone = self.service.heartbeat(
            list(request.source_ids), list(request.lease_ids), dict(request.source_incarnations),
            list(request.watch_source_ids),
        )
        return pb.HeartbeatReply(gone_source_ids=sorted(gone), catalog_epoch=self._epoch())

    @_rpc
    def GetVersion(
        self, request: pb.GetVersionRequest, context: grpc.ServicerContext
    ) -> pb.GetVersionReply:
        version = request.version if request.HasField("version") else None
        manifest = self.service.get_manifest(request.model, version, request.min_version)
        reply = pb.GetVersionReply(catalog_epoch=self._epoch())
        convert.manifest_to_proto(
            manifest,
            request.known_layout_digests,
            request.known_sidecar_digest,
            reply.version_info,  # filled in place: no copy of a large manifest
            request.known_agent_metadata_digests,
        )
        return reply

    @_rpc
    def ListVersions(
        self, request: pb.ListVersionsRequest, context: grpc.ServicerContext
    ) -> pb.ListVersionsReply:
        summaries = self.service.list_versions(request.model)
        return pb.ListVersionsReply(versions=[convert.summary_to_proto(s) for s in summaries])

    @_rpc
    def AcquireLease(
        self, request: pb.AcquireLeaseRequest, context: grpc.ServicerContext
    ) -> pb.AcquireLeaseReply:
        lease_id = self.service.acquire_lease(
            request.model,
            request.version,
            request.reader_id,
            request.ttl_s,
            request.lease_id or None,
            list(request.sources),
            request.max_readers_per_source,
        )
        return pb.AcquireLeaseReply(lease_id=lease_id, catalog_epoch=self._epoch())

    @_rpc
    def RegisterReplica(
        self, request: pb.RegisterReplicaRequest, context: grpc.ServicerContext
    ) -> pb.RegisterReplicaReply:
        if not request.HasField("source"):
            raise InvalidArgument("source: missing")
        self.service.register_replica(
            request.model, request.version, convert.source_from_proto(request.source), request.ttl_s
        )
        return pb.RegisterReplicaReply()

    @_rpc
    def WithdrawReplica(
        self, request: pb.WithdrawReplicaRequest, context: grpc.ServicerContext
    ) -> pb.WithdrawReplicaReply:
        timeout = min(request.timeout_s, self._max_wait_slice_s)
        if not timeout >= 0:  # NaN or negative: let the service reject it with its message
            self.service.withdraw_replica(request.model, request.version, request.source_id, request.timeout_s)
        deadline = time.monotonic() + timeout
        while True:  # in steps, like WaitDrained
            step = min(max(deadline - time.monotonic(), 0.0), _WAIT_STEP_S)
            if self.service.withdraw_replica(request.model, request.version, request.source_id, step):
                return pb.WithdrawReplicaReply(drained=True)
            if time.monotonic() >= deadline or self._stopping.is_set() or not context.is_active():
                return pb.WithdrawReplicaReply(drained=False)

    @_rpc
    def LeaseVersion(
        self, request: pb.LeaseVersionRequest, context: grpc.ServicerContext
    ) -> pb.LeaseVersionReply:
        find = request.find
        manifest, lease_id = self.service.lease_manifest(
            find.model,
            request.reader_id,
            find.version if find.HasField("version") else None,
            find.min_version,
            request.ttl_s,
            request.lease_id or None,
        )
        reply = pb.LeaseVersionReply(lease_id=lease_id, express_port=self.express_port, catalog_epoch=self._epoch())
        convert.manifest_to_proto(
            manifest, find.known_layout_digests, find.known_sidecar_digest, reply.version_info,
            find.known_agent_metadata_digests,
        )
        return reply

    @_rpc
    def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseLeaseReply:
        self.service.release_lease(request.lease_id, request.completed)
        return pb.ReleaseLeaseReply(catalog_epoch=self._epoch())

    @_rpc
    def RetireVersion(
        self, request: pb.RetireVersionRequest, context: grpc.ServicerContext
    ) -> pb.RetireVersionReply:
        state = self.service.retire_version(request.model, request.version)
        return pb.RetireVersionReply(state=convert.state_to_proto(state), catalog_epoch=self._epoch())

    @_rpc
    def WaitDrained(
        self, request: pb.WaitDrainedRequest, context: grpc.ServicerContext
    ) -> pb.WaitDrainedReply:
        timeout = min(request.timeout_s, self._max_wait_slice_s)
        if not timeout >= 0:  # NaN or negative: let the service reject it with its message
            self.service.wait_drained(request.model, request.version, request.timeout_s)
        deadline = time.monotonic() + timeout
        while True:
            step = min(max(deadline - time.monotonic(), 0.0), _WAIT_STEP_S)
            if self.service.wait_drained(request.model, request.version, step, request.registered_epoch):
                return pb.WaitDrainedReply(drained=True, catalog_epoch=self._epoch())
            if time.monotonic() >= deadline or self._stopping.is_set() or not context.is_active():
                return pb.WaitDrainedReply(drained=False, catalog_epoch=self._epoch())

    @_rpc
    def WaitRead(self, request: pb.WaitReadRequest, context: grpc.ServicerContext) -> pb.WaitReadReply:
        timeout = min(request.timeout_s, self._max_wait_slice_s)
        if not timeout >= 0:  # NaN or negative: let the service reject it with its message
            self.service.wait_read(request.model, request.version, request.timeout_s)
        deadline = time.monotonic() + timeout
        while True:  # in steps, like WaitDrained
            step = min(max(deadline - time.monotonic(), 0.0), _WAIT_STEP_S)
            progress = self.service.wait_read(request.model, request.version, step)
            if (
                progress.done
                or time.monotonic() >= deadline
                or self._stopping.is_set()
                or not context.is_active()
            ):
                return pb.WaitReadReply(
                    done=progress.done,
                    expected_readers=progress.expected_readers,
                    completed_readers=progress.completed_readers,
                )
