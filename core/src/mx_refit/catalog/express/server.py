"""The express lane's server: the catalog's listener, which answers the lane's calls by calling
the same :class:`~mx_refit.catalog.servicer.CatalogServicer` methods as gRPC (so the same
validation, errors and digests), after the same bearer token."""

from __future__ import annotations

import hmac
import logging
import socket
import threading
from typing import Any

import grpc

from mx_refit.catalog.express.framing import (
    AUTH_FRAME,
    HEADER,
    MAX_REQUEST_BYTES,
    METHOD_BY_FRAME,
    OK,
    ExpressStatus,
    recv_exact,
    send_frame,
)

__all__ = ["MAX_CONNECTIONS", "ExpressServer"]

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 512
_AUTH_TIMEOUT_S = 10.0  # a connection that sends no token in this time is dropped


class _LaneContext:
    """The part of ``grpc.ServicerContext`` the servicer's handlers use on these methods."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise ExpressStatus(code, details)

    def is_active(self) -> bool:
        return True


class ExpressServer:
    """Serves :data:`~mx_refit.catalog.express.framing.EXPRESS_METHODS` of ``servicer`` on
    ``host`` (an ephemeral port), one thread per connection (one per reader process), after the
    token when one is set."""

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
                    send_frame(conn, grpc.StatusCode.UNAUTHENTICATED.value[0], b"wrong or missing bearer token")
                    return
                conn.settimeout(None)  # an authenticated reader may sit idle between refits
            while True:
                kind, size = HEADER.unpack(recv_exact(conn, HEADER.size))
                method = METHOD_BY_FRAME.get(kind)
                if method is None or size > MAX_REQUEST_BYTES:
                    log.warning("express lane: dropping a connection that sent frame %d of %d bytes", kind, size)
                    return
                name, request_type = method
                request = request_type.FromString(recv_exact(conn, size))
                self.calls += 1
                try:
                    reply = getattr(self._servicer, name)(request, _LaneContext())
                except ExpressStatus as exc:
                    send_frame(conn, exc.code.value[0], exc.details.encode())
                    continue
                send_frame(conn, OK, reply.SerializeToString())
        except Exception as exc:  # gone, cut, or garbled (undecodable, unknown): drop it
            log.debug("express lane: connection ended: %s", exc)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _authenticated(self, conn: socket.socket) -> bool:
        kind, size = HEADER.unpack(recv_exact(conn, HEADER.size))
        if kind != AUTH_FRAME or size > 4096:
            return False
        assert self._token is not None
        return hmac.compare_digest(recv_exact(conn, size), self._token)
