"""Expected readers and completed reads per version: trainers without a central driver.

The catalog counts, per version, the distinct readers that released a lease with
``completed=True``; ``wait_read`` waits for ``expected_readers`` of them without retiring the
version. Tested on the service, through a real gRPC server on 127.0.0.1, and end to end with a
real ``Publisher`` and real ``Receiver``s (NIXL, UCX loopback).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from catalog_factories import FakeClock, snapshot, tp_source

from mx_refit.catalog import CatalogClient, CatalogServer, CatalogService, ReadProgress
from mx_refit.errors import FailedPrecondition, InvalidArgument
from mx_refit.types import VersionState

pytestmark = pytest.mark.timeout(120)


def register(catalog, model: str, version: int, readers: int, size: int = 2) -> None:
    for rank in range(size):
        catalog.register_source(
            model, version, size, tp_source(rank, size, ready=True), ttl_s=30, expected_readers=readers
        )


def read(catalog, model: str, version: int, reader: str, *, completed: bool = True) -> None:
    lease = catalog.acquire_lease(model, version, reader, ttl_s=30)
    catalog.release_lease(lease, completed=completed)


@pytest.fixture
def grpc_catalog(make_service) -> Iterator[tuple[CatalogServer, CatalogClient]]:
    with CatalogServer(service=make_service()) as srv, CatalogClient(srv.address, timeout_s=10) as cl:
        yield srv, cl


@pytest.mark.parametrize(
    "value, message",
    [
        (-1, "expected_readers: -1 is below the minimum of 0"),
        (True, "expected_readers: must be an integer, got True"),
        (1 << 21, "expected_readers: 2097152 exceeds the limit of 1048576"),
    ],
)
def test_bad_expected_readers_are_refused_by_name_and_change_nothing(
    service: CatalogService, value: object, message: str
) -> None:
    register(service, "m", 1, readers=2)
    before = snapshot(service)
    with pytest.raises(InvalidArgument, match=message):
        service.register_source("m", 2, 1, tp_source(0, 1), ttl_s=30, expected_readers=value)  # type: ignore[arg-type]
    assert snapshot(service) == before


def test_sources_must_agree_on_expected_readers(service: CatalogService) -> None:
    service.register_source("m", 1, 2, tp_source(0, 2), ttl_s=30, expected_readers=2)
    before = snapshot(service)
    with pytest.raises(InvalidArgument, match="expected_readers: 3 does not match 2 registered earlier"):
        service.register_source("m", 1, 2, tp_source(1, 2), ttl_s=30, expected_readers=3)
    assert snapshot(service) == before


def test_each_reader_counts_once_and_only_when_completed(service: CatalogService) -> None:
    register(service, "m", 1, readers=2)
    read(service, "m", 1, "a")
    read(service, "m", 1, "a")  # a second read by the same reader is not a second reader
    read(service, "m", 1, "b", completed=False)  # a failed pull is not a completed read
    progress = service.wait_read("m", 1, timeout_s=0)
    assert progress == ReadProgress(done=False, expected_readers=2, completed_readers=("a",))
    assert progress.describe() == "1 of 2 expected readers completed (a)"
    summary = service.list_versions("m")[0]
    assert (summary.expected_readers, summary.completed_reads, summary.leases) == (2, 1, 0)
    read(service, "m", 1, "b")
    assert service.wait_read("m", 1, timeout_s=0).done
    assert service.list_versions("m")[0].state is VersionState.READY  # waiting never retires


def test_wait_read_refuses_untracked_versions_and_expired_ones(
    service: CatalogService, clock: FakeClock
) -> None:
    register(service, "m", 1, readers=0)
    with pytest.raises(FailedPrecondition, match="registered without expected_readers"):
        service.wait_read("m", 1, timeout_s=0)
    with pytest.raises(InvalidArgument, match="timeout_s: -1 must be >= 0"):
        service.wait_read("m", 1, timeout_s=-1)
    register(service, "m", 2, readers=2)
    read(service, "m", 2, "a")
    clock.advance(31)  # the sources stop heart-beating: version 2 expires
    with pytest.raises(FailedPrecondition, match=r"EXPIRED with 1 of 2 expected readers completed \(a\)"):
        service.wait_read("m", 2, timeout_s=5)


def test_wait_read_over_grpc_never_locks_out_a_late_reader(
    grpc_catalog: tuple[CatalogServer, CatalogClient],
) -> None:
    """The race ``wait_drained`` cannot avoid: the publisher starts waiting before any reader
    has leased. Retiring first would refuse the late reader; ``wait_read`` lets it in."""
    server, client = grpc_catalog
    register(client, "m", 1, readers=2)
    result: list[ReadProgress] = []
    waiter = threading.Thread(target=lambda: result.append(client.wait_read("m", 1, 60)))
    waiter.start()
    time.sleep(0.3)
    read(client, "m", 1, "early")
    time.sleep(0.3)
    assert result == [] and waiter.is_alive()
    with CatalogClient(server.address) as late:  # a second process's client
        read(late, "m", 1, "late")
    waiter.join(timeout=30)
    assert result == [ReadProgress(done=True, expected_readers=2, completed_readers=("early", "late"))]
    summary = client.list_versions("m")[0]
    assert (summary.state, summary.expected_readers, summary.completed_reads) == (VersionState.READY, 2, 2)


def test_wait_read_over_grpc_times_out_with_progress_and_validates(
    grpc_catalog: tuple[CatalogServer, CatalogClient],
) -> None:
    _, client = grpc_catalog
    register(client, "m", 1, readers=3)
    read(client, "m", 1, "a")
    started = time.monotonic()
    progress = client.wait_read("m", 1, timeout_s=0.5)
    assert progress == ReadProgress(done=False, expected_readers=3, completed_readers=("a",))
    assert time.monotonic() - started >= 0.5
    with pytest.raises(InvalidArgument, match="timeout_s: nan must be >= 0"):
        client.wait_read("m", 1, float("nan"))
    with pytest.raises(InvalidArgument, match="completed: must be a bool, got 1"):
        client.release_lease("x", completed=1)  # type: ignore[arg-type]
    register(client, "m", 2, readers=0)
    with pytest.raises(FailedPrecondition, match="registered without expected_readers"):
        client.wait_read("m", 2, timeout_s=1)


def test_publisher_wait_read_with_real_receivers(mx_catalog: str, mx_model_name: str) -> None:
    """A driverless cycle: the publisher waits for both readers, then retires and drains."""
    from mx_refit.publisher import Publisher
    from mx_refit.receive.receiver import Receiver
    from mx_refit.types import PublishedTensor

    tensors = {f"t{i}": torch.full((64,), float(i)) for i in range(3)}
    with (
        Publisher(mx_catalog, mx_model_name, expected_readers=2) as pub,
        Receiver(mx_catalog, mx_model_name, reader_id="worker-0") as first,
        Receiver(mx_catalog, mx_model_name, reader_id="worker-1") as second,
    ):
        pub.publish(1, [PublishedTensor(n, t) for n, t in tensors.items()])
        first.refit(1)
        with pytest.raises(TimeoutError, match=r"version 1 of .*1 of 2 expected readers completed \(worker-0\)"):
            pub.wait_read(1, timeout_s=0.5)
        outcome: list[object] = []
        waiter = threading.Thread(target=lambda: outcome.append(pub.wait_read(1, 60)))
        waiter.start()
        result = second.refit(1)
        waiter.join(timeout=60)
        assert outcome == [None]  # returned, did not raise
        assert all(torch.equal(t, tensors[n]) for n, t in result.tensors)
        summary = CatalogClient(mx_catalog).list_versions(mx_model_name)[0]
        assert (summary.state, summary.completed_reads) == (VersionState.RETIRED, 2)
