"""The express lane's server: the catalog's listener, which answers the lane's calls by calling
the same :class:`~mx_refit.catalog.servicer.CatalogServicer` methods as gRPC (so the same
validation, errors and digests), after the same bearer token."""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
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
# A connection's first frame (the token, or without one the first request) must be complete this
# long after it connected, and every later frame this long after its header: a peer that
# dribbles bytes cannot hold a slot. Idle time between frames is free (readers wait for refits).
_FRAME_S = 10.0
_MAX_TOKEN_BYTES = 4096
# Without a token nobody is authenticated: each request may park this much, not MAX_REQUEST_BYTES
# (512 connections x 64 KiB = 32 MiB at most; requests are a few hundred bytes).
_MAX_UNAUTHENTICATED_REQUEST_BYTES = 64 << 10


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
            connected = time.monotonic()
            first_by: float | None = connected + _FRAME_S
            limit = MAX_REQUEST_BYTES
            if self._token is not None:
                if not self._authenticated(conn, connected + _FRAME_S):
                    send_frame(conn, grpc.StatusCode.UNAUTHENTICATED.value[0], b"wrong or missing bearer token")
                    return
                first_by = None  # an authenticated reader may sit idle between refits
            else:
                limit = _MAX_UNAUTHENTICATED_REQUEST_BYTES
            while True:
                kind, size = HEADER.unpack(_recv_by(conn, HEADER.size, first_by))
                method = METHOD_BY_FRAME.get(kind)
                if method is None or size > limit:
                    log.warning("express lane: dropping a connection that sent frame %d of %d bytes", kind, size)
                    return
                name, request_type = method
                request = request_type.FromString(_recv_by(conn, size, first_by or time.monotonic() + _FRAME_S))
                first_by = None
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

    def _authenticated(self, conn: socket.socket, by: float) -> bool:
        """The token frame, complete by ``by`` and at most ``_MAX_TOKEN_BYTES``, is the token."""
        kind, size = HEADER.unpack(_recv_by(conn, HEADER.size, by))
        if kind != AUTH_FRAME or size > _MAX_TOKEN_BYTES:
            return False
        assert self._token is not None
        return hmac.compare_digest(_recv_by(conn, size, by), self._token)


def _recv_by(conn: socket.socket, n: int, by: float | None) -> bytes:
    """Exactly ``n`` bytes, all of them by the monotonic time ``by`` (None: no limit)."""
    if by is None:
        conn.settimeout(None)
        return recv_exact(conn, n)
    chunks, left = [], n
    while left:
        rest = by - time.monotonic()
        if rest <= 0:
            raise TimeoutError(f"express lane: a frame was not complete in time ({n - left} of {n} bytes)")
        conn.settimeout(rest)
        chunk = conn.recv(min(left, 1 << 16))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
