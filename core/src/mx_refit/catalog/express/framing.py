"""The express lane's wire format, shared by its server and its client.

Frames, both directions: one byte (client: the method, or :data:`AUTH_FRAME` for the token;
server: 0 for OK, otherwise the ``grpc.StatusCode`` number), a 4-byte big-endian length, the
payload (a serialised message, the token, or a UTF-8 error message).
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import grpc

from mx_refit.catalog.v1 import catalog_pb2 as pb

__all__ = [
    "AUTH_FRAME",
    "EXPRESS_METHODS",
    "HEADER",
    "MAX_REQUEST_BYTES",
    "METHOD_BY_FRAME",
    "OK",
    "STATUS_BY_NUMBER",
    "ExpressStatus",
    "recv_exact",
    "send_frame",
]

HEADER = struct.Struct(">BI")  # the frame byte, the payload's length
AUTH_FRAME = 0  # client: the bearer token
OK = 0  # server: a reply follows
# method name -> (frame byte, request type, reply type)
EXPRESS_METHODS: dict[str, tuple[int, type[Any], type[Any]]] = {
    "LeaseVersion": (1, pb.LeaseVersionRequest, pb.LeaseVersionReply),
    "ReleaseLease": (2, pb.ReleaseLeaseRequest, pb.ReleaseLeaseReply),
}
METHOD_BY_FRAME = {code: (name, req) for name, (code, req, _) in EXPRESS_METHODS.items()}
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
MAX_REQUEST_BYTES = 1 << 20  # requests are a few hundred bytes; anything bigger is not ours


class ExpressStatus(Exception):
    """A call answered with a non-OK status: raised by the servicer's ``context.abort`` on the
    server (and sent back), and by :class:`~mx_refit.catalog.express.client.ExpressClient` on
    the client (which maps it to its domain error)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (``ConnectionError`` when the peer closes first)."""
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def send_frame(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.sendall(HEADER.pack(kind, len(payload)) + payload)
