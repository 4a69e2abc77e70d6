"""The express lane (``mx_refit.catalog.express``): LeaseVersion and ReleaseLease over one TCP
connection, with the same answers, errors and token as gRPC, and gRPC whenever the lane fails.
Real servers on 127.0.0.1."""

from __future__ import annotations

import socket
import struct

import pytest
from catalog_factories import publish_ready

from mx_refit.catalog import CatalogService
from mx_refit.catalog.client import CatalogClient
from mx_refit.catalog.server import CatalogServer
from mx_refit.errors import InvalidArgument, NotFound, Unauthenticated

pytestmark = pytest.mark.timeout(60)


def _served() -> CatalogServer:
    service = CatalogService()
    publish_ready(service, "m", 1)
    return CatalogServer(service=service, token="s3cret").start()


def test_after_the_first_lease_both_hot_calls_take_the_lane_with_grpcs_answers_and_errors() -> None:
    with _served() as srv, CatalogClient(srv.address, token="s3cret") as client:
        assert srv.express is not None
        first = client.lease_version("m", "r")  # over gRPC: the reply offers the lane
        assert client.express_calls == 0
        assert client._lane.wait_ready(5)  # dialled in the background
        client.release_lease(first.lease_id)
        again = client.lease_version("m", "r")
        assert again.info.version == 1 and again.info == first.info  # the same manifest
        client.release_lease(again.lease_id, completed=True)
        assert client.express_calls == 3 == srv.express.calls  # all but the first call
        # Errors come back as the same domain errors, naming the same fields.
        with pytest.raises(NotFound, match="lease_id: unknown or expired lease 'nope'"):
            client.release_lease("nope")
        with pytest.raises(InvalidArgument, match="reader_id"):
            client.lease_version("m", "")
        with pytest.raises(NotFound):
            client.lease_version("m", "r", version=7)
        assert srv.express.calls == 6  # each went over the lane
        assert client.list_versions("m")[0].completed_reads == 1  # other calls: gRPC


def test_a_lane_that_fails_hands_the_call_to_grpc_and_is_not_dialled_again() -> None:
    with _served() as srv, CatalogClient(srv.address, token="s3cret") as client:
        client.release_lease(client.lease_version("m", "r").lease_id)
        assert srv.express is not None and client._lane.wait_ready(5)
        lane = srv.express
        lane.stop()  # the lane goes away; gRPC stays
        leased = client.lease_version("m", "r")  # the lane fails mid-call: gRPC answers
        client.release_lease(leased.lease_id)
        assert leased.info.version == 1
        calls = client.express_calls
        client.release_lease(client.lease_version("m", "r").lease_id)
        assert client.express_calls == calls  # the failed port is not tried again at once


def test_the_lane_wants_the_token_and_drops_garbage() -> None:
    with _served() as srv:
        assert srv.express is not None
        port = srv.express.port
        # A wrong token: the lane refuses it, the client falls back, and gRPC refuses it too.
        with CatalogClient(srv.address, token="wrong") as client:
            client._lane.offer(port)
            assert client._lane.wait_ready(5)  # the dial succeeds; the lane reads the token later
            with pytest.raises(Unauthenticated):
                client.lease_version("m", "r")
            assert not client._lane.ready()  # refused: dropped
        # A raw connection with the wrong token is told so and closed.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(struct.pack(">BI", 0, 5) + b"wrong")
            status, size = struct.unpack(">BI", raw.recv(5))
            assert status == 16 and b"token" in raw.recv(size)  # UNAUTHENTICATED
            assert raw.recv(1) == b""
        # The right token, then an unknown method and an oversized frame: dropped.
        for frame in (struct.pack(">BI", 9, 0), struct.pack(">BI", 1, 1 << 30)):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                raw.sendall(struct.pack(">BI", 0, 6) + b"s3cret" + frame)
                assert raw.recv(1) == b""
        # ...and the lane still serves everyone else.
        with CatalogClient(srv.address, token="s3cret") as client:
            leased = client.lease_version("m", "r")
            assert client._lane.wait_ready(5)
            client.release_lease(leased.lease_id)
            client.release_lease(client.lease_version("m", "r").lease_id)
            assert client.express_calls == 3


def test_the_lane_is_optional_on_both_ends() -> None:
    service = CatalogService()
    publish_ready(service, "m", 1)
    with CatalogServer(service=service, express=False).start() as srv, CatalogClient(srv.address) as client:
        assert srv.express is None
        for _ in range(2):
            client.release_lease(client.lease_version("m", "r").lease_id)
        assert client.express_calls == 0
    with _served() as srv, CatalogClient(srv.address, token="s3cret", express=False) as client:
        for _ in range(2):
            client.release_lease(client.lease_version("m", "r").lease_id)
        assert client.express_calls == 0 and srv.express is not None and srv.express.calls == 0


def test_work_given_to_the_lease_call_runs_once_on_every_path() -> None:
    with _served() as srv, CatalogClient(srv.address, token="s3cret") as client:
        runs: list[int] = []
        # gRPC (the lane is not offered yet): before the call.
        first = client.lease_version("m", "r", while_waiting=lambda: runs.append(1))
        assert client._lane.wait_ready(5)
        client.release_lease(first.lease_id)
        # the lane: after sending, before reading the reply
        client.release_lease(client.lease_version("m", "r", while_waiting=lambda: runs.append(2)).lease_id)
        assert client.express_calls == 3
        # the lane fails after the request went out: the call moves to gRPC, the work does not rerun
        assert srv.express is not None
        srv.express.stop()
        client.release_lease(client.lease_version("m", "r", while_waiting=lambda: runs.append(3)).lease_id)
        assert runs == [1, 2, 3]
    with _served() as srv, CatalogClient(srv.address, token="s3cret") as client:
        client.release_lease(client.lease_version("m", "r").lease_id)
        assert client._lane.wait_ready(5)

        def fail() -> None:
            raise RuntimeError("work failed")

        with pytest.raises(RuntimeError, match="work failed"):  # its error is the caller's
            client.lease_version("m", "r", while_waiting=fail)
        client.release_lease(client.lease_version("m", "r").lease_id)  # gRPC; the lane redials
        assert client._lane.wait_ready(5)


def test_a_receiver_readies_its_read_while_the_catalog_answers() -> None:
    from mx_refit.receive.receiver import Receiver

    service = CatalogService()
    publish_ready(service, "m", 1)
    runs: list[int] = []
    # The in-process service has no reply to wait for: it runs the work first, once per call.
    service.release_lease(service.lease_version("m", "r", while_waiting=lambda: runs.append(1)).lease_id)
    assert runs == [1]
    with CatalogServer(service=service).start() as srv:
        with Receiver(srv.address, "m") as over_grpc:
            over_grpc._cycle.prime()  # no arena yet: nothing to ready, nothing raised


def test_a_connection_that_never_sends_its_token_is_dropped(monkeypatch) -> None:
    from mx_refit.catalog.express import server

    monkeypatch.setattr(server, "_FRAME_S", 0.2)
    with _served() as srv:
        assert srv.express is not None
        with socket.create_connection(("127.0.0.1", srv.express.port), timeout=5) as raw:
            assert raw.recv(1) == b""  # closed by the lane, not by this test's 5 s timeout


def _dribble(port: int, data: bytes, seconds: float) -> float:
    """Send ``data`` a byte at a time, spread over ``seconds``; returns when the lane closed the
    connection (seconds after connecting), or raises after twice ``seconds``."""
    import time

    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=seconds * 2) as raw:
        try:
            for byte in data:
                raw.sendall(bytes([byte]))
                time.sleep(seconds / len(data))
            while raw.recv(4096):  # an error frame, then the close
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass
    return time.monotonic() - started


@pytest.mark.parametrize("token", ["s3cret", None])
def test_a_dribbled_first_frame_is_cut_at_an_absolute_deadline(monkeypatch, token) -> None:
    """Each byte arrives well within the old per-read timeout, the frame never completes in time:
    the connection is dropped at the first frame's deadline, with or without a token."""
    from mx_refit.catalog.express import server
    from mx_refit.catalog.express.framing import AUTH_FRAME, EXPRESS_METHODS

    monkeypatch.setattr(server, "_FRAME_S", 0.5)
    service = CatalogService()
    publish_ready(service, "m", 1)
    with CatalogServer(service=service, token=token).start() as srv:
        assert srv.express is not None
        kind = AUTH_FRAME if token else EXPRESS_METHODS["LeaseVersion"][0]
        frame = struct.pack(">BI", kind, 6) + b"s3cret"
        assert _dribble(srv.express.port, frame, seconds=4.0) < 2.0


@pytest.mark.parametrize("token, size, dropped", [
    ("s3cret", 4097, True),  # a token frame over 4 KiB
    (None, (64 << 10) + 1, True),  # an unauthenticated request over 64 KiB
    (None, 1000, False),  # a plausible request: the lane waits for it
])
def test_unauthenticated_frames_are_capped(monkeypatch, token, size, dropped) -> None:
    from mx_refit.catalog.express import server
    from mx_refit.catalog.express.framing import AUTH_FRAME, EXPRESS_METHODS

    monkeypatch.setattr(server, "_FRAME_S", 2.0)
    with CatalogServer(token=token).start() as srv:
        assert srv.express is not None
        kind = AUTH_FRAME if token else EXPRESS_METHODS["LeaseVersion"][0]
        with socket.create_connection(("127.0.0.1", srv.express.port), timeout=5) as raw:
            raw.sendall(struct.pack(">BI", kind, size))
            raw.settimeout(1.0)
            try:
                closed = raw.recv(4096) is not None  # an error frame or the close: at once
            except TimeoutError:
                closed = False  # still waiting for the announced bytes
            assert closed is dropped
