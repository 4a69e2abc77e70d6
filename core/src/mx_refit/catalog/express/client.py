"""The express lane's client side: :class:`ExpressClient` (one connection to a catalog's lane)
and :class:`ExpressRoute` (a :class:`~mx_refit.catalog.client.CatalogClient`'s use of it: dialled
in the background once offered, dropped for gRPC when it fails)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from mx_refit.catalog.express.framing import (
    AUTH_FRAME,
    EXPRESS_METHODS,
    HEADER,
    OK,
    STATUS_BY_NUMBER,
    ExpressStatus,
    recv_exact,
    send_frame,
)
from mx_refit.catalog.status import RETRYABLE

__all__ = ["ExpressClient", "ExpressRoute", "LaneDown", "Once"]

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 5.0  # dialled in the background: a slow or dropped dial costs no refit
_RETRY_AFTER_S = 60.0  # a lane that failed is not dialled again for this long


class LaneDown(Exception):
    """The lane itself failed (connection refused, cut, timed out, garbled): use gRPC."""


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
                send_frame(sock, code, payload)
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
                status, size = HEADER.unpack(recv_exact(sock, HEADER.size))
                body = recv_exact(sock, size)
            except (OSError, ConnectionError) as exc:
                self._close_locked()
                raise LaneDown(f"{type(exc).__name__}: {exc}") from None
        if status == OK:
            try:
                return reply_type.FromString(body)
            except Exception as exc:  # a garbled reply: the lane is not to be trusted
                self.close()
                raise LaneDown(f"unreadable {method} reply: {exc}") from None
        grpc_code = STATUS_BY_NUMBER.get(status)
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
            send_frame(sock, AUTH_FRAME, self._token.encode())
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
