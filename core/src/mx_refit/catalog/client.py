"""``CatalogClient``: the typed gRPC client of the catalog.

It mirrors :class:`~mx_refit.catalog.service.CatalogService` method for method (both satisfy
:class:`~mx_refit.catalog.api.Catalog`) and raises the same :mod:`mx_refit.errors`, plus
``Unauthenticated`` (bad token) and ``Unavailable`` (catalog unreachable after the retry
budget). It is thread-safe, and pickles as its configuration only: each process (and each
forked child) opens its own channel on first use.

``get_version`` keeps the layouts and sidecars it received (a bounded
:class:`~mx_refit.catalog.digests.ManifestCache`) and announces their digests, so the catalog
sends an unchanged layout or sidecar only once; results equal a full fetch.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc

from mx_refit.catalog import convert
from mx_refit.catalog.address import check_address
from mx_refit.catalog.api import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TTL_S,
    LeasedVersion,
    ReadProgress,
    VersionSummary,
)
from mx_refit.catalog.convert import read_progress_from_proto as _read_progress
from mx_refit.catalog.convert import request_message as _request
from mx_refit.catalog.digests import (
    NOTHING_KNOWN,
    Known,
    ManifestCache,
    ManifestStats,
    UnknownDigest,
)
from mx_refit.catalog.epoch import AnswerEpochs
from mx_refit.catalog.express.client import ExpressRoute, Once
from mx_refit.catalog.express.framing import EXPRESS_METHODS, ExpressStatus
from mx_refit.catalog.status import RETRYABLE, error_for, is_store_outage, unreachable
from mx_refit.catalog.v1 import catalog_pb2 as pb
from mx_refit.catalog.v1 import catalog_pb2_grpc
from mx_refit.catalog.validation import check_name, check_token
from mx_refit.checks import check_flag, check_seconds
from mx_refit.errors import InvalidArgument, MxRefitError, Unavailable
from mx_refit.types import SourceInfo, VersionInfo, VersionState

__all__ = ["CatalogClient"]


# Longest slice of a wait_drained call on the wire; below the servicer's 30 s cap so a slice
# ends by the client's choice, and short enough to ride out a catalog restart.
_WAIT_SLICE_S = 20.0
_MAX_BACKOFF_S = 2.0
# gRPC's default reconnect backoff grows to 120 s (a client needed 11-18 s to reach a restarted
# catalog): cap it at 1 s. Keepalive pings detect a catalog that stopped answering (SIGSTOP, a
# cut link) during long calls; the server permits them (see server.KEEPALIVE_SERVER_OPTIONS).
CHANNEL_RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
)


class CatalogClient(AnswerEpochs):
    """Typed catalog client.

    :param address: ``host:port`` of a :class:`~mx_refit.catalog.server.CatalogServer`.
    :param token: bearer token, when the server requires one.
    :param timeout_s: deadline of each call (``wait_drained`` adds its own wait to it).
    :param retries: extra attempts after UNAVAILABLE or DEADLINE_EXCEEDED (never after any
        other status), with exponential backoff from ``backoff_s``; then ``Unavailable``.
    :param max_message_bytes: largest request/reply the channel accepts.
    :param manifest_cache_versions: per model, how many recent ``get_version`` results' layouts
        and sidecars are kept to be left out of later replies (0: always fetch everything).
    """

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout_s: float = 10.0,
        retries: int = 3,
        *,
        backoff_s: float = 0.1,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        manifest_cache_versions: int = 2,
        express: bool = True,
    ) -> None:
        check_address(address)
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s: {timeout_s} must be > 0")
        if retries < 0:
            raise InvalidArgument(f"retries: {retries} must be >= 0")
        if manifest_cache_versions < 0:
            raise InvalidArgument(
                f"manifest_cache_versions: {manifest_cache_versions} must be >= 0"
            )
        self.address = address
        self._token = check_token(token)
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.max_message_bytes = int(max_message_bytes)
        self.manifest_cache_versions = int(manifest_cache_versions)
        self._manifests = ManifestCache(versions=self.manifest_cache_versions)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: catalog_pb2_grpc.CatalogServiceStub | None = None
        self._pid = -1
        self._reached = False  # this process's channel reached the catalog once (see _call)
        self._watching: grpc.Channel | None = None
        self._lease_version_unsupported = False  # the catalog answered UNIMPLEMENTED once
        # The catalog's express lane (mx_refit.catalog.express), once it offered one.
        self.express = bool(express)
        self._lane = ExpressRoute(address, self._token, enabled=self.express)
        self._init_epochs()

    # --- pickling: configuration only ---------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "token": self._token,
            "timeout_s": self.timeout_s,
            "retries": self.retries,
            "backoff_s": self.backoff_s,
            "max_message_bytes": self.max_message_bytes,
            "manifest_cache_versions": self.manifest_cache_versions,
            "express": self.express,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["address"],
            state["token"],
            state["timeout_s"],
            state["retries"],
            backoff_s=state["backoff_s"],
            max_message_bytes=state["max_message_bytes"],
            manifest_cache_versions=state.get("manifest_cache_versions", 2),
            express=state.get("express", True),
        )

    def __repr__(self) -> str:
        return f"CatalogClient({self.address!r}, token={'set' if self._token else 'none'})"

    # --- channel lifecycle -------------------------------------------------------------

    def _get_stub(self) -> catalog_pb2_grpc.CatalogServiceStub:
        with self._lock:
            # A channel inherited across fork() is unusable in the child: open a fresh one.
            if self._stub is None or self._pid != os.getpid():
                self._channel = grpc.insecure_channel(
                    self.address,
                    options=[
                        ("grpc.max_send_message_length", self.max_message_bytes),
                        ("grpc.max_receive_message_length", self.max_message_bytes),
                        ("grpc.enable_http_proxy", 0),  # the catalog is never behind a proxy
                        *CHANNEL_RECONNECT_OPTIONS,
                    ],
                )
                # The generated stub module is untyped (grpc_tools emits no .pyi for it).
                self._stub = catalog_pb2_grpc.CatalogServiceStub(  # type: ignore[no-untyped-call]
                    self._channel
                )
                self._pid = os.getpid()
                self._reached = False
                self._watching = self._channel
                self._channel.subscribe(self._on_connectivity)
            return self._stub

    def _on_connectivity(self, state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.READY:
            self._reached = True

    def _stop_watching(self) -> None:  # once reached: gRPC polls for a subscription
        with self._lock:
            channel, self._watching = self._watching, None
        if channel is not None:
            channel.unsubscribe(self._on_connectivity)

    def close(self) -> None:
        """Close the channel and the express lane (a later call reopens them)."""
        with self._lock:
            channel, self._channel, self._stub = self._channel, None, None
            owned = self._pid == os.getpid()
            self._watching = None
        if channel is not None and owned:
            channel.close()
        self._lane.close()

    @property
    def express_calls(self) -> int:
        """Calls the express lane answered (with a reply or a domain error)."""
        return self._lane.calls

    def __enter__(self) -> CatalogClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _call(
        self, method: str, request: Any, *, timeout_s: float | None = None, wait_for_ready: bool = False,
        while_waiting: Callable[[], None] | None = None,
    ) -> Any:
        """One unary call with bounded retries on transient failures (every RPC is idempotent:
        the catalog treats a repeated release or registration as a no-op). ``wait_for_ready``:
        wait, within the call's deadline, for a connection the channel is re-establishing
        instead of failing at once while it backs off between reconnects. The calls in
        ``EXPRESS_METHODS`` take the express lane while it is up (gRPC otherwise);
        ``while_waiting`` runs once, between sending and reading on the lane, else first."""
        if method in EXPRESS_METHODS and self._lane.ready():
            once = Once(while_waiting) if while_waiting is not None else None
            try:
                reply = self._lane.call(method, request, timeout_s if timeout_s is not None else self.timeout_s, once)
            except ExpressStatus as status:
                if status.code not in RETRYABLE:
                    raise error_for(status.code, status.details, method) from None
                reply = None  # the catalog's store is down: retried over gRPC, below
            if reply is not None:
                self._note_answer(reply)
                return reply
            while_waiting = once
        if while_waiting is not None:
            while_waiting()  # gRPC offers no point between sending and waiting: before the call
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        started = time.monotonic()
        attempts, made = self.retries + 1, 0
        last: grpc.RpcError | None = None
        for attempt in itertools.count():
            # A catalog that answers its store is down is retried until the call's timeout, past
            # the retry count: a blip of the store must not fail the call.
            if attempt >= attempts and not (last is not None and is_store_outage(last.code(), last.details() or "")
                                            and time.monotonic() - started < timeout):
                break
            # Until the catalog was reached once, a catalog that is down or a wrong address fails
            # within one timeout and says so: no waiting for a connection, the attempts share it.
            stub = self._get_stub()  # a fresh channel after a fork or close(): not reached yet
            first_contact = not self._reached
            left = started + timeout - time.monotonic() if first_contact else timeout
            if attempt:
                delay = min(self.backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S) * (0.5 + random.random())
                if first_contact and delay >= left:
                    break
                if attempt >= attempts:
                    delay = min(delay, max(started + timeout - time.monotonic(), 0.0))
                time.sleep(delay)  # jitter: ranks retry out of step
                left -= delay if first_contact else 0.0
            made += 1
            try:
                reply = getattr(stub, method)(request, timeout=left, metadata=self._metadata,
                                              wait_for_ready=(wait_for_ready and not first_contact) or None)
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
                if code in RETRYABLE:
                    last = exc
                    continue
                self._reached = True
                if code is grpc.StatusCode.UNIMPLEMENTED:
                    raise _Unimplemented(f"{method}: the catalog at {self.address} does not offer it: {details}") from None
                raise error_for(code, details, method) from None
            self._reached = True
            if self._watching is not None:
                self._stop_watching()
            self._note_answer(reply)
            return reply
        assert last is not None
        if not self._reached:
            raise unreachable(self.address, method, last, made, time.monotonic() - started)
        code, details = last.code(), last.details() or ""
        raise Unavailable(
            f"catalog at {self.address} is unavailable after {made} attempt(s) of {method}: "
            f"{code.name}: {details}"
        ) from None

    # --- publisher side ------------------------------------------------------------------

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
        """See :meth:`CatalogService.register_source`."""
        request = _request(
            pb.RegisterSourceRequest,
            model=model,
            version=version,
            expected_sources=expected_sources,
            sidecar_json=convert.json_to_text(sidecar, "sidecar"),
            ttl_s=ttl_s,
            expected_readers=expected_readers,
        )
        convert.source_to_proto(source, request.source)
        reply = self._call("RegisterSource", request)
        self._note_registration(model, version)
        return convert.state_from_proto(reply.state)

    def mark_ready(self, model: str, version: int, source_id: str) -> VersionState:
        """See :meth:`CatalogService.mark_ready`."""
        request = _request(pb.MarkReadyRequest, model=model, version=version, source_id=source_id)
        return convert.state_from_proto(self._call("MarkReady", request).state)

    def heartbeat(
        self,
        source_ids: Sequence[str] = (),
        lease_ids: Sequence[str] = (),
        incarnations: Mapping[str, str] | None = None,
        watch_source_ids: Sequence[str] = (),
    ) -> frozenset[str]:
        """See :meth:`CatalogService.heartbeat` (a catalog that predates ``watch_source_ids``
        answers nothing gone)."""
        for name, ids in (("source_ids", source_ids), ("lease_ids", lease_ids), ("watch_source_ids", watch_source_ids)):
            if isinstance(ids, (str, bytes)):
                raise InvalidArgument(f"{name}: must be a sequence of ids, got the string {ids!r}")
        if incarnations is not None and not isinstance(incarnations, Mapping):
            raise InvalidArgument(
                f"incarnations: must be a mapping of source id to incarnation, got {type(incarnations).__name__}"
            )
        request = _request(
            pb.HeartbeatRequest,
            source_ids=list(source_ids),
            lease_ids=list(lease_ids),
            source_incarnations=dict(incarnations or {}),
            watch_source_ids=list(watch_source_ids),
        )
        return frozenset(self._call("Heartbeat", request).gone_source_ids)

    def retire_version(self, model: str, version: int) -> VersionState:
        """See :meth:`CatalogService.retire_version`."""
        request = _request(pb.RetireVersionRequest, model=model, version=version)
        return convert.state_from_proto(self._call("RetireVersion", request).state)

    def wait_drained(self, model: str, version: int, timeout_s: float, registered_epoch: str = "") -> bool:
        """See :meth:`CatalogService.wait_drained`.

        Long waits go over the wire in slices of at most 20 s, so a catalog restart or a lost
        connection costs one retry, not the whole wait. Each slice names ``registered_epoch`` or
        else the epoch in which this client first registered the version, so the catalog holds the lease fence when it lost
        state since (see :mod:`mx_refit.catalog.epoch`).
        """
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not (math.isfinite(timeout_s) and timeout_s >= 0)
        ):
            # Let the catalog reject it, with the same InvalidArgument the service raises.
            request = _request(
                pb.WaitDrainedRequest, model=model, version=version, timeout_s=timeout_s
            )
            return bool(self._call("WaitDrained", request).drained)
        deadline = time.monotonic() + timeout_s
        while True:
            wait = min(max(deadline - time.monotonic(), 0.0), _WAIT_SLICE_S)
            request = _request(pb.WaitDrainedRequest, model=model, version=version, timeout_s=wait,
                               registered_epoch=registered_epoch or self.registered_epoch(model, version))
            reply = self._call("WaitDrained", request, timeout_s=wait + self.timeout_s)
            if reply.drained:
                return True
            if deadline - time.monotonic() <= 0:
                return False

    def wait_read(self, model: str, version: int, timeout_s: float) -> ReadProgress:
        """See :meth:`CatalogService.wait_read`; long waits go in slices, like
        :meth:`wait_drained`."""
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not (math.isfinite(timeout_s) and timeout_s >= 0)
        ):
            # Let the catalog reject it, with the same InvalidArgument the service raises.
            request = _request(pb.WaitReadRequest, model=model, version=version, timeout_s=timeout_s)
            return _read_progress(self._call("WaitRead", request))
        deadline = time.monotonic() + timeout_s
        while True:
            wait = min(max(deadline - time.monotonic(), 0.0), _WAIT_SLICE_S)
            request = _request(pb.WaitReadRequest, model=model, version=version, timeout_s=wait)
            progress = _read_progress(
                self._call("WaitRead", request, timeout_s=wait + self.timeout_s)
            )
            if progress.done or deadline - time.monotonic() <= 0:
                return progress

    # --- reader side -----------------------------------------------------------------

    def get_version(
        self, model: str, version: int | None = None, min_version: int = 0
    ) -> VersionInfo:
        """See :meth:`CatalogService.get_version`.

        Layouts and sidecars this client received for ``model`` in recent calls are announced
        by digest; the catalog leaves those out and they are filled in from the cache, so the
        result equals a full fetch. Results share the cached descriptor tuples and sidecar
        dict with earlier results: treat them as read-only (as with the in-process service).
        """
        return self._with_manifests(model, lambda known: self._fetch_version(model, version, min_version, known))

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
        """See :meth:`CatalogService.lease_version`: one round trip where
        :meth:`get_version` then :meth:`acquire_lease` take two. The manifest is answered by
        digest as in :meth:`get_version`; the lease id is picked up front (unless given), so a
        retried call never leaves an orphan lease. ``while_waiting`` runs once, while the reply
        is on its way when the express lane carries the call (else before the call).

        A catalog too old to know the call is asked in two steps instead (and not again)."""
        chosen = uuid.uuid4().hex if lease_id is None else check_name(lease_id, "lease_id")
        once = Once(while_waiting) if while_waiting is not None else None
        if not self._lease_version_unsupported:
            leased: list[str] = []

            def fetch(known: Known) -> VersionInfo:
                request = _request(
                    pb.LeaseVersionRequest,
                    find=self._find_request(model, version, min_version, known),
                    reader_id=reader_id,
                    ttl_s=ttl_s,
                    lease_id=chosen,
                )
                try:
                    # A refit starts here: after a cut link or a catalog restart the channel may
                    # still be backing off between reconnects (up to 1 s), longer than the
                    # retries last; wait for it within the deadline rather than fail the refit.
                    reply = self._call("LeaseVersion", request, wait_for_ready=True, while_waiting=once)
                except _Unimplemented:
                    self._lease_version_unsupported = True
                    raise
                leased.append(reply.lease_id)
                self._lane.offer(reply.express_port)
                return self._version_from_reply(reply.version_info, known)

            try:
                info = self._with_manifests(model, fetch)
            except _Unimplemented:
                pass
            else:
                return LeasedVersion(info, leased[-1])
        if once is not None:
            once()
        info = self.get_version(model, version, min_version)
        return LeasedVersion(info, self.acquire_lease(model, info.version, reader_id, ttl_s, chosen))

    def _with_manifests(self, model: str, fetch: Callable[[Known], VersionInfo]) -> VersionInfo:
        """``fetch`` announcing the manifests this client holds for ``model``; asked again
        announcing nothing if the catalog left out something this client does not hold."""
        known = self._manifests.known(model) if isinstance(model, str) else NOTHING_KNOWN
        try:
            info = fetch(known)
        except UnknownDigest:
            if known is NOTHING_KNOWN:
                raise  # the catalog left out what nobody announced: never return partial data
            # The catalog left out something this client does not hold (a catalog answering
            # for another reader's digests, or a bug): ask again, announcing nothing.
            self._manifests.count(refetches=1)
            info = fetch(NOTHING_KNOWN)
        self._manifests.remember(model, info)
        return info

    @property
    def manifest_stats(self) -> ManifestStats:
        """Counters of what ``get_version`` replies carried and left out (tests, diagnostics)."""
        return self._manifests.stats

    def _fetch_version(
        self, model: str, version: int | None, min_version: int, known: Known
    ) -> VersionInfo:
        request = self._find_request(model, version, min_version, known)
        return self._version_from_reply(self._call("GetVersion", request).version_info, known)

    @staticmethod
    def _find_request(model: str, version: int | None, min_version: int, known: Known) -> Any:
        exact = {} if version is None else {"version": version}
        return _request(
            pb.GetVersionRequest,
            model=model,
            min_version=min_version,
            known_layout_digests=known.layout_digests,
            known_sidecar_digest=known.sidecar_digest,
            known_agent_metadata_digests=known.metadata_digests,
            **exact,
        )

    def _version_from_reply(self, msg: pb.VersionInfo, known: Known) -> VersionInfo:
        sent = [len(source.tensors) for source in msg.sources if not source.tensors_omitted]
        metadata_omitted = sum(source.agent_metadata_omitted for source in msg.sources)
        self._manifests.count(
            replies=1,
            sources_sent=len(sent),
            sources_omitted=len(msg.sources) - len(sent),
            descriptors_sent=sum(sent),
            sidecars_sent=0 if msg.sidecar_omitted else 1,
            sidecars_omitted=1 if msg.sidecar_omitted else 0,
            metadata_sent=len(msg.sources) - metadata_omitted,
            metadata_omitted=metadata_omitted,
        )
        return convert.version_info_from_proto(msg, known)

    def list_versions(self, model: str) -> list[VersionSummary]:
        """See :meth:`CatalogService.list_versions`."""
        reply = self._call("ListVersions", _request(pb.ListVersionsRequest, model=model))
        return [convert.summary_from_proto(msg) for msg in reply.versions]

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
        """See :meth:`CatalogService.acquire_lease`.

        The client picks the lease id up front (unless given), so a retried call can never
        leave an orphan lease that would stall the publisher's drain until its TTL.
        """
        request = _request(
            pb.AcquireLeaseRequest,
            model=model,
            version=version,
            reader_id=reader_id,
            ttl_s=ttl_s,
            lease_id=uuid.uuid4().hex if lease_id is None else check_name(lease_id, "lease_id"),
            max_readers_per_source=max_readers_per_source,
        )
        if isinstance(sources, (str, bytes)):
            raise InvalidArgument(f"sources: must be a sequence of source ids, got the string {sources!r}")
        request.sources.extend(sources)
        return str(self._call("AcquireLease", request).lease_id)

    def register_replica(
        self, model: str, version: int, source: SourceInfo, ttl_s: float = DEFAULT_TTL_S
    ) -> None:
        """See :meth:`CatalogService.register_replica`."""
        request = _request(pb.RegisterReplicaRequest, model=model, version=version, ttl_s=ttl_s)
        convert.source_to_proto(source, request.source)
        self._call("RegisterReplica", request)

    def withdraw_replica(self, model: str, version: int, source_id: str, timeout_s: float) -> bool:
        """See :meth:`CatalogService.withdraw_replica`; long waits go in slices, like
        :meth:`wait_drained`."""
        check_seconds(timeout_s, "timeout_s", allow_zero=True)
        deadline = time.monotonic() + timeout_s
        while True:
            wait = min(max(deadline - time.monotonic(), 0.0), _WAIT_SLICE_S)
            request = _request(
                pb.WithdrawReplicaRequest, model=model, version=version, source_id=source_id, timeout_s=wait
            )
            if self._call("WithdrawReplica", request, timeout_s=wait + self.timeout_s).drained:
                return True
            if deadline - time.monotonic() <= 0:
                return False

    def release_lease(self, lease_id: str, completed: bool = False) -> None:
        """See :meth:`CatalogService.release_lease`. A retry after a lost reply is a no-op on
        the catalog, so NotFound always means the lease was not held until now."""
        check_flag(completed, "completed")  # protobuf would coerce 0/1 silently
        self._call(
            "ReleaseLease", _request(pb.ReleaseLeaseRequest, lease_id=lease_id, completed=completed)
        )


class _Unimplemented(MxRefitError):
    """The catalog is older than the call (gRPC UNIMPLEMENTED)."""
