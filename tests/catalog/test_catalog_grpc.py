"""End to end through a real gRPC server on 127.0.0.1 and the typed client (no mocks)."""

from __future__ import annotations

import inspect
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from catalog_factories import FakeClock, desc, publish_ready, source, tp_source
from catalog_stores import STORES, build_store

from mx_refit.catalog import (
    Catalog,
    CatalogClient,
    CatalogServer,
    CatalogService,
    VersionSummary,
    start_embedded,
)
from mx_refit.catalog.v1 import catalog_pb2 as pb
from mx_refit.catalog.v1 import catalog_pb2_grpc
from mx_refit.errors import (
    FailedPrecondition,
    InvalidArgument,
    MxRefitError,
    NotFound,
    Unauthenticated,
    Unavailable,
)
from mx_refit.testing.procs import refused_address
from mx_refit.types import Role, VersionState

REPO = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="module", params=STORES)
def server(clock: FakeClock, request: pytest.FixtureRequest) -> Iterator[CatalogServer]:
    """One token-protected server per store for the module; tests use distinct model names."""
    service = CatalogService(store=build_store(request.param, request, clock))
    with CatalogServer(token=TOKEN, service=service) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: CatalogServer) -> Iterator[CatalogClient]:
    with CatalogClient(server.address, token=TOKEN, timeout_s=10) as cl:
        yield cl


@pytest.fixture
def model(request: pytest.FixtureRequest) -> str:
    return re.sub(r"\W", "_", request.node.name)


def test_server_binds_loopback_on_an_ephemeral_port(server: CatalogServer) -> None:
    host, port = server.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0


def test_client_satisfies_the_catalog_protocol_with_the_services_signatures(
    client: CatalogClient,
) -> None:
    assert isinstance(client, Catalog)
    for name, member in inspect.getmembers(Catalog, inspect.isfunction):
        if name.startswith("_"):
            continue
        expected = inspect.signature(member)
        assert inspect.signature(getattr(CatalogService, name)) == expected, name
        assert inspect.signature(getattr(CatalogClient, name)) == expected, name


def test_full_cycle_matches_the_embedded_service(
    server: CatalogServer, client: CatalogClient, model: str
) -> None:
    sidecar = {"hf_name_map": {"q": "model.layers.0.q_proj.weight"}, "scale": 0.125}
    assert client.register_source(model, 1, 2, tp_source(0, 2), sidecar) is VersionState.PENDING
    assert client.register_source(model, 1, 2, tp_source(1, 2), sidecar) is VersionState.PENDING
    assert client.mark_ready(model, 1, "tp0") is VersionState.PENDING
    assert client.mark_ready(model, 1, "tp1") is VersionState.READY
    client.heartbeat(source_ids=["tp0", "tp1"])

    remote = client.get_version(model)
    assert remote == server.service.get_version(model)
    assert remote.sidecar == sidecar
    assert client.get_version(model, 1, min_version=1) == remote
    assert client.list_versions(model) == [VersionSummary(model, 1, VersionState.READY, 2, 2, 2, 0)]

    lease = client.acquire_lease(model, 1, "reader-0", ttl_s=30)
    client.heartbeat(lease_ids=[lease])
    assert client.retire_version(model, 1) is VersionState.DRAINING
    assert client.wait_drained(model, 1, timeout_s=0) is False
    client.release_lease(lease)
    assert client.wait_drained(model, 1, timeout_s=5) is True
    assert client.list_versions(model)[0].state is VersionState.RETIRED


def test_embedded_and_remote_normalise_json_data_alike(make_service,
    server: CatalogServer, client: CatalogClient, model: str
) -> None:
    extras = {"groups": (8, 128), "role": Role.COLUMN, "nested": {"t": (1.5, None)}}
    normalised = {"groups": [8, 128], "role": "column", "nested": {"t": [1.5, None]}}
    client.register_source(model, 1, 1, source(tensors=(desc(extras=extras),), ready=True))
    embedded = make_service()
    embedded.register_source(model, 1, 1, source(tensors=(desc(extras=extras),), ready=True))
    for info in (client.get_version(model), embedded.get_version(model)):
        assert info.sources[0].tensors[0].extras == normalised
        assert type(info.sources[0].tensors[0].extras["role"]) is str


def test_wrongly_typed_arguments_fail_client_side_as_invalid_argument(
    client: CatalogClient,
) -> None:
    with pytest.raises(InvalidArgument, match="MarkReadyRequest"):
        client.mark_ready("m", "one", "tp0")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="lease_id: must be a non-empty string"):
        client.acquire_lease("m", 1, "r", lease_id="")


def test_lease_retry_with_the_same_id_is_idempotent(client: CatalogClient, model: str) -> None:
    publish_ready(client, model, 1)
    assert client.acquire_lease(model, 1, "r", lease_id="fixed") == "fixed"
    assert client.acquire_lease(model, 1, "r", lease_id="fixed") == "fixed"
    assert client.list_versions(model)[0].leases == 1


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda c, m: c.register_source(m, 1, 1, source(tensors=(desc(nbytes=7),))),
            InvalidArgument,
            "source.tensors[0].nbytes: 7 does not match local_shape (4, 8) x float32 = 128 bytes",
        ),
        (
            lambda c, m: c.register_source(m, 1, 1, source(tensors=(desc(dtype="float13"),))),
            InvalidArgument,
            "source.tensors[0].dtype: unknown dtype 'float13'",
        ),
        (
            lambda c, m: c.register_source(m, 1, 1, source(), {"x": float("inf")}),
            InvalidArgument,
            'sidecar["x"]: inf is not a finite number',
        ),
        (lambda c, m: c.get_version(m), NotFound, "unknown model"),
        (lambda c, m: c.release_lease("no-such-lease"), NotFound, "unknown or expired lease"),
        (lambda c, m: c.heartbeat(["ghost"]), NotFound, "unknown or expired source_ids ['ghost']"),
        (
            lambda c, m: (
                c.register_source(m, 1, 2, tp_source(0, 2)),
                c.acquire_lease(m, 1, "r"),
            ),
            FailedPrecondition,
            "version 1 is PENDING; only READY versions can be leased",
        ),
        (
            lambda c, m: (c.register_source(m, 1, 1, source()), c.wait_drained(m, 1, 1)),
            FailedPrecondition,
            "is PENDING; retire it before waiting",
        ),
        (
            lambda c, m: c.wait_drained(m, 1, float("nan")),
            InvalidArgument,
            "timeout_s: nan must be >= 0",
        ),
    ],
)
def test_errors_cross_the_wire_as_the_same_class_and_message(
    client: CatalogClient,
    model: str,
    call: Callable[[CatalogClient, str], Any],
    error: type[MxRefitError],
    message: str,
) -> None:
    with pytest.raises(MxRefitError) as caught:
        call(client, model)
    assert type(caught.value) is error
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("method", "request_", "code", "details"),
    [
        ("GetVersion", pb.GetVersionRequest(model="nope"), "NOT_FOUND", "unknown model 'nope'"),
        ("GetVersion", pb.GetVersionRequest(model=""), "INVALID_ARGUMENT", "model: must be"),
        ("ReleaseLease", pb.ReleaseLeaseRequest(lease_id="x"), "NOT_FOUND", "expired lease 'x'"),
        (
            "RegisterSource",
            pb.RegisterSourceRequest(model="m", version=1, expected_sources=1, ttl_s=1),
            "INVALID_ARGUMENT",
            "source: missing",
        ),
        (
            "AcquireLease",
            pb.AcquireLeaseRequest(model="raw", version=1, reader_id="r", ttl_s=1),
            "FAILED_PRECONDITION",
            "is PENDING; only READY",
        ),
    ],
)
def test_raw_status_codes_on_the_wire(
    server: CatalogServer,
    client: CatalogClient,
    method: str,
    request_: Any,
    code: str,
    details: str,
) -> None:
    """The servicer's codes themselves, seen by a plain generated stub (no client mapping)."""
    if method == "AcquireLease" and not client.list_versions("raw"):
        client.register_source("raw", 1, 2, tp_source(0, 2))
    with grpc.insecure_channel(server.address) as channel:
        call = getattr(catalog_pb2_grpc.CatalogServiceStub(channel), method)
        with pytest.raises(grpc.RpcError) as caught:
            call(request_, timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert caught.value.code().name == code
        assert details in caught.value.details()
        with pytest.raises(grpc.RpcError) as unauthenticated:
            call(request_, timeout=5)
        assert unauthenticated.value.code() is grpc.StatusCode.UNAUTHENTICATED


class _BrokenService(CatalogService):
    def list_versions(self, model: str) -> list[VersionSummary]:
        raise RuntimeError("bug in the catalog")


def test_unexpected_server_errors_are_internal_and_do_not_leak_details() -> None:
    with (
        CatalogServer(service=_BrokenService()) as srv,
        CatalogClient(srv.address) as cl,
        pytest.raises(MxRefitError) as caught,
    ):
        cl.list_versions("m")
    assert type(caught.value) is MxRefitError
    assert "INTERNAL" in str(caught.value) and "ListVersions" in str(caught.value)
    assert "bug in the catalog" not in str(caught.value)


@pytest.mark.parametrize(
    ("token", "message"), [(None, "missing 'authorization"), ("wrong", "wrong bearer token")]
)
def test_bad_token_is_unauthenticated_without_retries(
    server: CatalogServer, token: str | None, message: str
) -> None:
    intruder = CatalogClient(server.address, token=token, retries=5, backoff_s=5.0)
    start = time.monotonic()
    with pytest.raises(Unauthenticated, match=message):
        intruder.list_versions("m")
    assert time.monotonic() - start < 2.5  # final, not retried: one retry would sleep >= 2.5 s
    intruder.close()


def test_server_without_token_accepts_plain_calls() -> None:
    with start_embedded() as srv, CatalogClient(srv.address) as cl:
        assert cl.list_versions("m") == []


def test_wait_drained_across_threads_and_clients(
    server: CatalogServer, client: CatalogClient, model: str
) -> None:
    publish_ready(client, model, 1)
    reader = CatalogClient(server.address, token=TOKEN)
    lease = reader.acquire_lease(model, 1, "reader")
    assert client.retire_version(model, 1) is VersionState.DRAINING
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(client.wait_drained(model, 1, 30)))
    waiter.start()
    time.sleep(0.1)
    assert result == [] and waiter.is_alive()
    reader.release_lease(lease)
    waiter.join(timeout=10)
    assert result == [True]
    reader.close()


def test_wait_drained_times_out(client: CatalogClient, model: str) -> None:
    publish_ready(client, model, 1)
    client.acquire_lease(model, 1, "r")
    client.retire_version(model, 1)
    start = time.monotonic()
    assert client.wait_drained(model, 1, timeout_s=0.2) is False
    assert 0.15 < time.monotonic() - start < 3


def test_reaper_thread_expires_leases_and_wakes_waiters(make_service) -> None:
    clock = FakeClock()  # not the module's: advancing it must not age the shared server
    service = make_service(clock=clock)
    with (
        CatalogServer(service=service, reap_interval_s=0.02) as srv,
        CatalogClient(srv.address) as cl,
    ):
        publish_ready(cl, "m", 1)
        cl.acquire_lease("m", 1, "r", ttl_s=5)
        cl.retire_version("m", 1)
        result: list[bool] = []
        waiter = threading.Thread(target=lambda: result.append(cl.wait_drained("m", 1, 30)))
        waiter.start()
        time.sleep(0.05)
        clock.advance(6)  # the lease lapses; only the reaper thread can notice
        waiter.join(timeout=10)
        assert result == [True]


def test_stop_does_not_wait_for_pending_drain_waits() -> None:
    srv = start_embedded()
    cl = CatalogClient(srv.address, retries=0)
    publish_ready(cl, "m", 1)
    cl.acquire_lease("m", 1, "r")
    cl.retire_version("m", 1)
    outcome: list[BaseException | bool] = []

    def wait() -> None:
        try:
            outcome.append(cl.wait_drained("m", 1, 60))
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    start = time.monotonic()
    srv.stop(grace=10)
    assert time.monotonic() - start < 3
    waiter.join(timeout=10)
    assert len(outcome) == 1 and isinstance(outcome[0], Unavailable)
    cl.close()


def test_manifest_of_20000_descriptors_round_trips(client: CatalogClient, model: str) -> None:
    tensors = tuple(
        desc(
            f"decoder.layers.{i // 8}.mlp.experts.{i % 8}.weight",
            dtype="bfloat16",
            global_shape=(256, 64),
            local_shape=(128, 64),
            shard_axis=0,
            shard_offset=128,
            role=Role.EXPERT_COLUMN,
            addr=0x7F00_0000_0000 + i * 16384,
            extras={"expert": i % 8, "scale": i / 7},
        )
        for i in range(20_000)
    )
    big = source("big", tensors=tensors, metadata=os.urandom(1 << 20), ready=True)
    # Size, not speed, is under test here (timings live in benchmarks/bench_get_version.py).
    assert client.register_source(model, 1, 1, big, {"n": 20_000}) is VersionState.READY
    info = client.get_version(model)
    assert info.sources == (big,)


def test_unreachable_catalog_raises_unavailable_after_the_retry_budget() -> None:
    with refused_address() as address:
        lost = CatalogClient(address, retries=2, backoff_s=0.01, timeout_s=2)
        start = time.monotonic()
        with pytest.raises(Unavailable, match=rf"catalog at {address} is unreachable: connection refused .*; "
                                              r"3 attempt\(s\) of ListVersions"):
            lost.list_versions("m")
        assert time.monotonic() - start < 5
        lost.close()


def test_oversized_request_is_invalid_argument() -> None:
    with (
        CatalogServer(max_message_bytes=64 * 1024) as srv,
        CatalogClient(srv.address) as cl,
        pytest.raises(InvalidArgument, match="RegisterSource: message too large"),
    ):
        cl.register_source("m", 1, 1, source(metadata=b"x" * (128 * 1024)))


def test_client_is_picklable_and_shareable_across_threads(
    server: CatalogServer, client: CatalogClient, model: str
) -> None:
    clone = pickle.loads(pickle.dumps(client))
    assert clone.address == client.address and clone.timeout_s == client.timeout_s
    publish_ready(clone, model, 1)
    errors: list[BaseException] = []

    def hammer(i: int) -> None:
        try:
            for _ in range(5):
                lease = clone.acquire_lease(model, 1, f"r{i}")
                assert clone.get_version(model).version == 1
                clone.release_lease(lease)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert errors == []
    assert clone.list_versions(model)[0].leases == 0


def test_server_refuses_a_port_that_is_already_taken(server: CatalogServer) -> None:
    with pytest.raises(OSError, match="cannot bind the catalog server"):
        CatalogServer(port=server.port).start()


def test_serve_forever_handles_sigterm_before_anyone_can_see_it_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """A supervisor may stop the catalog the moment it answers a call or logs its address: the
    SIGINT/SIGTERM handlers are in place before the server starts, and restored afterwards."""
    from mx_refit.catalog import server as server_module

    handlers_at_start = []
    real_start = server_module.CatalogServer.start

    def observed_start(self):  # the real start; records which handlers it ran under
        handlers_at_start.append((signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)))
        return real_start(self)

    monkeypatch.setattr(server_module.CatalogServer, "start", observed_start)
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    stop = threading.Event()
    stop.set()  # serve, then return at once
    server_module.serve_forever("127.0.0.1", 0, stop_event=stop, grace_s=0)
    assert len(handlers_at_start) == 1
    assert all(h not in before for h in handlers_at_start[0]), (handlers_at_start, before)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_serve_forever_logs_its_address_and_stops_on_sigterm(tmp_path: Path) -> None:
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr);"
        "from mx_refit.catalog import serve_forever; serve_forever('127.0.0.1', 0, 'tok')"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO / "core" / "src"))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stderr is not None
        line = ""
        deadline = time.monotonic() + 30
        while "serving on" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
        match = re.search(r"serving on (127\.0\.0\.1:\d+)", line)
        assert match, f"no address logged: {line!r}"
        with CatalogClient(match.group(1), token="tok") as cl:
            assert cl.list_versions("m") == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_heartbeat_over_grpc_answers_which_watched_sources_are_gone(client: CatalogClient, model: str) -> None:
    publish_ready(client, model, 1)
    lease = client.acquire_lease(model, 1, "reader-watch", ttl_s=30)
    assert client.heartbeat(lease_ids=[lease], watch_source_ids=["tp0", f"{model}-ghost"]) == {f"{model}-ghost"}
    assert client.heartbeat(lease_ids=[lease]) == frozenset()
    with pytest.raises(InvalidArgument, match="watch_source_ids: must be a sequence of ids"):
        client.heartbeat(watch_source_ids="tp0")
    client.release_lease(lease)
