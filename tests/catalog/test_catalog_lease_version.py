"""``lease_version``: find a READY version and lease it in one atomic call (one round trip fewer
per refit). Tested on the service, through a real gRPC server on 127.0.0.1 (and one that predates
the call), and end to end with a real ``Publisher`` and ``Receiver`` (NIXL, UCX loopback).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from catalog_factories import publish_ready, snapshot

from mx_refit.catalog import CatalogClient, CatalogServer, CatalogService, LeasedVersion, LeasingCatalog
from mx_refit.catalog.servicer import CatalogServicer
from mx_refit.catalog.v1 import catalog_pb2_grpc
from mx_refit.errors import FailedPrecondition, InvalidArgument, NotFound
from mx_refit.types import VersionState

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def grpc_catalog() -> Iterator[tuple[CatalogService, CatalogClient]]:
    service = CatalogService()
    with CatalogServer(service=service) as srv, CatalogClient(srv.address, timeout_s=10) as client:
        yield service, client


def test_finds_the_newest_ready_version_and_leases_it(service: CatalogService) -> None:
    publish_ready(service, "m", 1)
    publish_ready(service, "m", 2)
    service.register_source("m", 3, 2, publish_source(0), ttl_s=30)  # 3 stays PENDING
    leased = service.lease_version("m", "reader-a", ttl_s=30)
    assert isinstance(leased, LeasedVersion) and isinstance(service, LeasingCatalog)
    assert leased.info == service.get_version("m")
    assert leased.info.version == 2
    assert [s.leases for s in service.list_versions("m")] == [0, 1, 0]
    # The lease is an ordinary one: it holds the drain until it is released.
    assert service.retire_version("m", 2) is VersionState.DRAINING
    assert not service.wait_drained("m", 2, timeout_s=0)
    service.release_lease(leased.lease_id, completed=True)
    assert service.wait_drained("m", 2, timeout_s=0)
    assert service.lease_version("m", "reader-a", version=1, ttl_s=30).info.version == 1


def test_a_retry_renews_the_same_lease_on_the_same_version(service: CatalogService, clock: Any) -> None:
    publish_ready(service, "m", 1)
    first = service.lease_version("m", "r", ttl_s=30, lease_id="lease-1")
    publish_ready(service, "m", 2)  # a newer version turned READY before the retry arrived
    with pytest.raises(InvalidArgument, match="lease_id: 'lease-1' is already held by reader 'r'"):
        service.lease_version("m", "other-reader", ttl_s=30, lease_id="lease-1")
    with pytest.raises(InvalidArgument, match="lease_id: 'lease-1' is already held"):
        service.lease_version("m", "r", version=2, ttl_s=30, lease_id="lease-1")
    clock.advance(20)
    again = service.lease_version("m", "r", ttl_s=30, lease_id="lease-1")
    assert (again.info.version, again.lease_id) == (1, "lease-1") and again.info == first.info
    clock.advance(20)  # 40 s after the first call, 20 s after the renewal: still held
    service.heartbeat(lease_ids=["lease-1"])
    assert [s.leases for s in service.list_versions("m")][0] == 1


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"model": "nope"}, NotFound, "unknown model 'nope'"),
        ({"min_version": 3}, NotFound, r"has no READY version >= 3 \(known: 1 READY, 2 PENDING\)"),
        ({"version": 2}, FailedPrecondition, "version 2 is PENDING, not READY"),
        ({"version": 1, "min_version": 2}, InvalidArgument, "version: 1 is below min_version 2"),
        ({"reader_id": ""}, InvalidArgument, "reader_id: must be"),
        ({"ttl_s": -1.0}, InvalidArgument, "ttl_s: "),
        ({"lease_id": ""}, InvalidArgument, "lease_id: must be"),
    ],
)
def test_bad_or_impossible_requests_lease_nothing(
    service: CatalogService, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    publish_ready(service, "m", 1)
    service.register_source("m", 2, 2, publish_source(0), ttl_s=30)
    before = snapshot(service)
    call: dict[str, Any] = {"model": "m", "reader_id": "r", "ttl_s": 30.0, **kwargs}
    with pytest.raises(error, match=message):
        service.lease_version(**call)
    assert snapshot(service) == before


def test_over_grpc_the_manifest_is_answered_by_digest(grpc_catalog: tuple[CatalogService, CatalogClient]) -> None:
    service, client = grpc_catalog
    publish_ready(client, "m", 1, sidecar={"layers": 2})
    first = client.lease_version("m", "r", ttl_s=30)
    assert first.info == service.get_version("m")
    assert first.info.sidecar == {"layers": 2}
    publish_ready(client, "m", 2, sidecar={"layers": 2})  # same layouts and sidecar
    stats_before = client.manifest_stats
    second = client.lease_version("m", "r", ttl_s=30)
    stats = client.manifest_stats
    assert second.info == service.get_version("m", 2)
    assert stats.sources_omitted - stats_before.sources_omitted == 2  # both layouts left out
    assert stats.sidecars_omitted - stats_before.sidecars_omitted == 1
    assert [s.leases for s in client.list_versions("m")] == [1, 1]
    for leased in (first, second):
        client.release_lease(leased.lease_id, completed=True)
    assert client.register_source("m", 3, 2, publish_source(0), ttl_s=30) is VersionState.PENDING
    with pytest.raises(FailedPrecondition, match="version 3 is PENDING"):
        client.lease_version("m", "r", version=3, ttl_s=30)
    with pytest.raises(InvalidArgument, match="ttl_s"):
        client.lease_version("m", "r", ttl_s=float("nan"))


class _ServicerBeforeLeaseVersion(CatalogServicer):
    """The servicer as it was before LeaseVersion: the generated base answers UNIMPLEMENTED."""

    LeaseVersion = catalog_pb2_grpc.CatalogServiceServicer.LeaseVersion  # type: ignore[assignment]


def test_a_catalog_without_the_call_is_asked_in_two_steps() -> None:
    service = CatalogService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    catalog_pb2_grpc.add_CatalogServiceServicer_to_server(  # type: ignore[no-untyped-call]
        _ServicerBeforeLeaseVersion(service), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        publish_ready(service, "m", 1)
        with CatalogClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            for _ in range(2):  # the second call goes straight to the two steps
                leased = client.lease_version("m", "r", ttl_s=30)
                assert leased.info == service.get_version("m")
                assert service.list_versions("m")[0].leases == 1
                client.release_lease(leased.lease_id, completed=True)
            assert client._lease_version_unsupported
    finally:
        server.stop(0)


class _CountingService(CatalogService):
    """The real service, counting the reader-side calls that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def get_manifest(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["get_manifest"] += 1
        return super().get_manifest(*args, **kwargs)

    def lease_manifest(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["lease_manifest"] += 1
        return super().lease_manifest(*args, **kwargs)

    def acquire_lease(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["acquire_lease"] += 1
        return super().acquire_lease(*args, **kwargs)

    def release_lease(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["release_lease"] += 1
        return super().release_lease(*args, **kwargs)

    def heartbeat(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("lease_ids") or (len(args) > 1 and args[1]):
            self.calls["lease_heartbeat"] += 1
        return super().heartbeat(*args, **kwargs)


def test_a_refit_waits_for_one_catalog_round_trip_and_releases_after(mx_model_name: str) -> None:
    from mx_refit.publisher import Publisher
    from mx_refit.receive.receiver import Receiver
    from mx_refit.types import PublishedTensor

    service = _CountingService()
    weight = torch.arange(64, dtype=torch.float32)
    with (
        CatalogServer(service=service) as srv,
        Publisher(srv.address, mx_model_name) as pub,
        Receiver(srv.address, mx_model_name) as rec,
    ):
        for version in (1, 2, 3):
            if version > 1:
                pub.wait_drained(version - 1, timeout_s=30)
                weight.add_(1)
            pub.publish(version, [PublishedTensor("w", weight)])
            service.calls.clear()
            express_before = srv.express.calls if srv.express else 0
            result = rec.refit(min_version=version)
            assert result.version.version == version
            assert torch.equal(dict(result.tensors)["w"], weight)
            # The lease's deadline confirmed it (the publisher's fence covers the reader's TTL):
            # the release is sent after the refit returned, on the renewal thread.
            assert result.stats.lease_confirmed_by == "deadline"
            deadline = time.monotonic() + 10
            while service.calls["release_lease"] < 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert service.calls == Counter(lease_manifest=1, release_lease=1), service.calls
            # From the second refit on, both calls take the express lane the first reply offered.
            if version > 1:
                assert srv.express is not None and srv.express.calls == express_before + 2
            else:
                assert rec.client._lane.wait_ready(5)  # dialled in the background


def test_a_catalog_that_only_offers_the_two_steps_still_refits(mx_model_name: str) -> None:
    from mx_refit.publisher import Publisher
    from mx_refit.receive.receiver import Receiver
    from mx_refit.types import PublishedTensor

    service = _CountingService()

    # A framework's own Catalog adapter that predates lease_version: the real service's other calls.
    adapter = SimpleNamespace(**{
        name: getattr(service, name)
        for name in ("register_source", "mark_ready", "heartbeat", "get_version", "list_versions",
                     "acquire_lease", "release_lease", "retire_version", "wait_drained", "wait_read",
                     "register_replica", "withdraw_replica")
    })
    assert not isinstance(adapter, LeasingCatalog)
    with Publisher(service, mx_model_name) as pub, Receiver(adapter, mx_model_name) as rec:  # type: ignore[arg-type]
        pub.publish(1, [PublishedTensor("w", torch.ones(8))])
        service.calls.clear()
        assert torch.equal(dict(rec.refit(1).tensors)["w"], torch.ones(8))
        deadline = time.monotonic() + 10  # the release may follow the refit (its deadline held)
        while service.calls["release_lease"] < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert service.calls == Counter(get_manifest=1, acquire_lease=1, release_lease=1), service.calls


def publish_source(rank: int) -> Any:
    from catalog_factories import tp_source

    return tp_source(rank, 2)
