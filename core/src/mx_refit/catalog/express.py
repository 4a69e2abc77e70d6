"""The express lane: a steady refit's catalog calls over one persistent TCP connection.

A steady refit makes one catalog call on its critical path (``LeaseVersion``; its release is
sent afterwards, see :mod:`mx_refit._lease`). Over Python gRPC that call costs 1.5-2.3 ms
after the reader sat idle, whatever the server model (sync or ``grpc.aio``): the request and
the reply each cross several threads. Measured on the 2-core CI machine with 20 ms idle
between calls, a bare gRPC echo took 1.45 ms and the same bytes over a blocking socket
0.13 ms; the catalog's own work for the call is ~0.04 ms. On a 10-20 ms colocated pull that
difference is the whole gap between the refit and its pull.

The lane carries the same request and reply messages to the same :class:`CatalogServicer`
methods (so the same validation, errors and digests), after the same bearer token, for the
calls in :data:`EXPRESS_METHODS` only. The catalog offers it in ``LeaseVersionReply
.express_port``; a client dials it on its next call and falls back to gRPC for good on any
failure of the lane itself (every express call is idempotent, so a call cut mid-way is
simply made again over gRPC). Nothing else changes: every other call stays on gRPC.

Frames, both directions: one byte (client: the method, or 0 for the token; server: 0 for OK,
otherwise the ``grpc.StatusCode`` number), a 4-byte big-endian length, the payload (a
serialised message, the token, or a UTF-8 error message).
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from mx_refit.catalog.status import RETRYABLE
from mx_refit.catalog.v1 import catalog_pb2 as pb

__all__ = ["EXPRESS_METHODS", "ExpressClient", "ExpressRoute", "ExpressServer", "ExpressStatus", "LaneDown", "Once"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">BI")
_AUTH = 0
# method name -> (frame byte, request type, reply type)
EXPRESS_METHODS: dict[str, tuple[int, type[Any], type[Any]]] = {
    "LeaseVersion": (1, pb.LeaseVersionRequest, pb.LeaseVersionReply),
    "ReleaseLease": (2, pb.ReleaseLeaseRequest, pb.ReleaseLeaseReply),
}
_BY_BYTE = {code: (name, req) for name, (code, req, _) in EXPRESS_METHODS.items()}
_CODES = {code.value[0]: code for code in grpc.StatusCode}
MAX_REQUEST_BYTES = 1 << 20  # requests are a few hundred bytes; anything bigger is not ours
MAX_CONNECTIONS = 512
_CONNECT_TIMEOUT_S = 5.0  # dialled in the background: a slow or dropped dial costs no refit
_RETRY_AFTER_S = 60.0  # a lane that failed is not dialled again for this long
_AUTH_TIMEOUT_S = 10.0  # a connection that sends no token in this time is dropped


class LaneDown(Exception):
    """The lane itself failed (connection refused, cut, timed out, garbled): use gRPC."""


class ExpressStatus(Exception):
    """A call answered with a non-OK status: raised by the servicer's ``context.abort`` on the
    server (and sent back), and by :class:`ExpressClient` on the client (which maps it to its
    domain error)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class _LaneContext:
    """The part of ``grpc.ServicerContext`` the servicer's handlers use on these methods."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise ExpressStatus(code, details)

    def is_active(self) -> bool:
        return True


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _send(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(kind, len(payload)) + payload)


class ExpressServer:
    """Serves :data:`EXPRESS_METHODS` of ``servicer`` on ``host`` (an ephemeral port), one
    thread per connection (one per reader process), after the token when one is set."""

    def __init__(self, servicer: Any, host: str, token: str | None) -> None:
        self._servicer = servicer
        self._host = host or "0.0.0.0"
        self._token = token.encode() if token else None
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.port = 0
        self.calls = 0  # requests answered (with a reply or an error status)

    def start(self) -> int:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self._host, 0))
        listener.listen(64)
        self._listener, self.port = listener, listener.getsockname()[1]
        threading.Thread(target=self._accept, args=(listener,), name="mx-refit-express", daemon=True).start()
        return self.port

    def stop(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            connections, self._connections = self._connections, set()
        for sock in [*([listener] if listener else []), *connections]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # stopped
            with self._lock:
                if self._listener is None or len(self._connections) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._connections.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="mx-refit-express-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self._token is not None:
                conn.settimeout(_AUTH_TIMEOUT_S)  # a connection holding a slot without a token
                if not self._authenticated(conn):
                    _send(conn, grpc.StatusCode.UNAUTHENTICATED.value[0], b"wrong or missing bearer token")
                    return
                conn.settimeout(None)  # an authenticated reader may sit idle between refits
            while True:
                kind, size = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
                method = _BY_BYTE.get(kind)
                if method is None or size > MAX_REQUEST_BYTES:
                    log.warning("express lane: dropping a connection that sent frame %d of %d bytes", kind, size)
                    return
                name, request_type = method
                request = request_type.FromString(_recv_exact(conn, size))
                self.calls += 1
                try:
                    reply = getattr(self._servicer, name)(request, _LaneContext())
                except ExpressStatus as exc:
                    _send(conn, exc.code.value[0], exc.details.encode())
                    continue
                _send(conn, 0, reply.SerializeToString())
        except Exception as exc:  # gone, cut, or garbled (undecodable, unknown): drop it
            log.debug("express lane: connection ended: %s", exc)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _authenticated(self, conn: socket.socket) -> bool:
        kind, size = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
        if kind != _AUTH or size > 4096:
            return False
        assert self._token is not None
        return hmac.compare_digest(_recv_exact(conn, size), self._token)


class ExpressClient:
    """One connection to a catalog's express lane, shared by a client's threads (calls take
    well under a millisecond, so they queue on a lock rather than open more connections)."""

    def __init__(self, host: str, port: int, token: str | None) -> None:
        self._address = (host, port)
        self.port = port
        self._token = token
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def call(self, method: str, request: Any, timeout_s: float,
             while_waiting: Callable[[], None] | None = None) -> Any:
        """The reply to ``request``; a non-OK status raises :class:`ExpressStatus`; a failure of
        the lane itself raises :class:`LaneDown` (and closes the connection). ``while_waiting``
        runs once the request is sent, before the reply is read (work hidden under the round
        trip); what it raises propagates."""
        code, _, reply_type = EXPRESS_METHODS[method]
        payload = request.SerializeToString()
        with self._lock:
            sock = self._sock
            if sock is None:
                raise LaneDown("not connected")
            try:
                sock.settimeout(timeout_s)
                _send(sock, code, payload)
            except (OSError, ConnectionError) as exc:
                self._close_locked()
                raise LaneDown(f"{type(exc).__name__}: {exc}") from None
            if while_waiting is not None:
                try:
                    while_waiting()
                except BaseException:
                    self._close_locked()  # the reply is still owed: this connection is out of step
                    raise
            try:
                status, size = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
                body = _recv_exact(sock, size)
            except (OSError, ConnectionError) as exc:
                self._close_locked()
                raise LaneDown(f"{type(exc).__name__}: {exc}") from None
        if status == 0:
            try:
                return reply_type.FromString(body)
            except Exception as exc:  # a garbled reply: the lane is not to be trusted
                self.close()
                raise LaneDown(f"unreadable {method} reply: {exc}") from None
        grpc_code = _CODES.get(status)
        if grpc_code is None:
            self.close()
            raise LaneDown(f"unknown status {status} on the express lane")
        if grpc_code is grpc.StatusCode.UNAUTHENTICATED:
            self.close()
            raise LaneDown(f"the express lane refused the token: {body.decode(errors='replace')}")
        raise ExpressStatus(grpc_code, body.decode(errors="replace"))

    def connect(self, timeout_s: float = _CONNECT_TIMEOUT_S) -> None:
        """Dial the lane and send the token (raises ``OSError`` when it cannot be reached)."""
        sock = socket.create_connection(self._address, timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._token:
            _send(sock, _AUTH, self._token.encode())
        with self._lock:
            self._close_locked()
            self._sock = sock

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Once:
    """``fn`` run at most once however often called (a call may move from the lane to gRPC)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class ExpressRoute:
    """A catalog client's use of the lane: dialled in the background once offered (calls use
    gRPC until the lane is up, so a lane behind a firewall or a proxy that does not pass its
    port costs no call anything), dropped when it fails (that port is then left alone for a
    minute), never used across ``fork()``."""

    def __init__(self, address: str, token: str | None, *, enabled: bool) -> None:
        self._host = address.rpartition(":")[0].strip("[]")
        self._token = token
        self._enabled = enabled
        self._lock = threading.Lock()
        self._client: ExpressClient | None = None  # connected
        self._dialing = 0  # pid of the process dialling (a child forked meanwhile dials anew)
        self._closes = 0  # close() calls: a dial that outlives one is dropped, not installed
        self._pid = -1
        self._failed: tuple[int, float] | None = None  # (port, when) of the last failure
        self.calls = 0

    def ready(self) -> bool:
        return self._client is not None and self._pid == os.getpid()

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether the lane is up within ``timeout_s`` (for tools and tests)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready() and time.monotonic() < deadline:
            time.sleep(0.002)
        return self.ready()

    def offer(self, port: int) -> None:
        """The catalog offers its lane on ``port`` of the host the client dials."""
        if not self._enabled or not port:
            return
        failed = self._failed
        if failed is not None and failed[0] == port and time.monotonic() - failed[1] < _RETRY_AFTER_S:
            return
        with self._lock:
            if self._dialing == os.getpid() or (self._client is not None and self._pid == os.getpid()):
                return
            self._client, self._dialing = None, os.getpid()
            closes = self._closes
        threading.Thread(target=self._dial, args=(port, closes), name="mx-refit-express-dial", daemon=True).start()

    def _dial(self, port: int, closes: int) -> None:
        lane = ExpressClient(self._host, port, self._token)
        try:
            lane.connect()
        except OSError as exc:
            log.info("catalog %s: express lane on port %d unreachable (%s); calls go over gRPC", self._host, port, exc)
            with self._lock:
                self._failed, self._dialing = (port, time.monotonic()), 0
            return
        with self._lock:
            self._dialing = 0
            if closes == self._closes:
                self._client, self._pid = lane, os.getpid()
                return
        lane.close()  # the client was closed while we dialled

    def call(self, method: str, request: Any, timeout_s: float, while_waiting: Callable[[], None] | None) -> Any:
        """The reply, or None when the call must go over gRPC (no lane, the lane failed, or a
        status gRPC retries); other statuses raise :class:`ExpressStatus`."""
        lane = self._client
        if lane is None or self._pid != os.getpid():  # none, or inherited across fork()
            return None
        try:
            reply = lane.call(method, request, timeout_s, while_waiting)
        except ExpressStatus as status:
            self.calls += 1
            if status.code in RETRYABLE:
                return None  # gRPC retries with backoff
            raise
        except LaneDown as exc:
            log.info("catalog %s: express lane failed (%s); calls go over gRPC", self._host, exc)
            self._drop(lane, failed=True)
            return None
        except BaseException:  # the caller's while_waiting failed: the lane is fine but out of step
            self._drop(lane, failed=False)
            raise
        self.calls += 1
        return reply

    def _drop(self, lane: ExpressClient, *, failed: bool) -> None:
        with self._lock:
            if self._client is lane:
                self._client = None
                if failed:
                    self._failed = (lane.port, time.monotonic())
        lane.close()

    def close(self) -> None:
        with self._lock:
            lane, self._client = self._client, None
            self._closes += 1
        if lane is not None and self._pid == os.getpid():
            lane.close()
