"""A lease its own deadline proves held: the refit loads without waiting for the release's
answer, and publishers keep the promise that makes this safe (``lease_fence_s``: after the
catalog lost their registration, and with it every lease, they mutate nothing for the fence).

Real catalog service on real time; the publishers use real NIXL agents (DRAM)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from mx_refit.catalog import CatalogService
from mx_refit.catalog.api import Catalog
from mx_refit.errors import LeaseLost, NotFound
from mx_refit.publisher import Publisher
from mx_refit.receive.lease import LeaseGuard, LeaseRenewer
from mx_refit.receive.receiver import Receiver
from mx_refit.types import MeshPosition, PublishedTensor, SourceInfo, TensorDescriptor

pytestmark = pytest.mark.timeout(120)

TTL_S = 1.5


class RestartableCatalog:
    """An in-process catalog that can lose everything, like a restarted memory-store server."""

    def __init__(self) -> None:
        self.service = CatalogService()

    def restart(self) -> None:
        self.service = CatalogService()


def _forward(name: str) -> Any:
    return lambda self, *args, **kwargs: getattr(self.service, name)(*args, **kwargs)


for _name in dir(Catalog):  # every Catalog method, defined on the class (Protocol checks look there)
    if not _name.startswith("_"):
        setattr(RestartableCatalog, _name, _forward(_name))


def _ready(service: CatalogService, version: int = 1) -> None:
    tensor = TensorDescriptor(name="w", dtype="float32", global_shape=(4,), local_shape=(4,), addr=0x1000, nbytes=16)
    source = SourceInfo(
        source_id="s", mesh=MeshPosition(), agent_name="a", agent_metadata=b"", tensors=(tensor,),
        lease_fence_s=TTL_S,
    )
    service.register_source("m", version, 1, source, ttl_s=60)
    service.mark_ready("m", version, "s")


def _guard(catalog: Any, renewer: LeaseRenewer | None, reader: str, lease_id: str | None = None) -> LeaseGuard:
    sent = time.monotonic()
    lease_id = lease_id or catalog.acquire_lease("m", 1, reader, ttl_s=TTL_S)
    return LeaseGuard(catalog, lease_id, TTL_S, acquired_at=sent, label="model 'm' version 1", renewer=renewer)


def _live(service: CatalogService, lease_id: str) -> bool:
    try:
        service.heartbeat(lease_ids=[lease_id])
    except NotFound:
        return False
    return True


def _wait_released(service: CatalogService, lease_id: str) -> None:
    deadline = time.monotonic() + 5
    while _live(service, lease_id):
        assert time.monotonic() < deadline, f"lease {lease_id} was never released"
        time.sleep(0.005)


def test_a_lease_inside_its_deadline_under_a_covering_fence_is_released_in_the_background() -> None:
    service = CatalogService()
    _ready(service)
    renewer = LeaseRenewer("deadline")
    guard = _guard(service, renewer, "reader")
    guard.start()
    assert guard.release(completed=True, fence_s=TTL_S) == "deadline"
    # The release still arrives: it ends the drain and counts the completed read.
    _wait_released(service, guard.lease_id)
    service.retire_version("m", 1)
    assert service.wait_drained("m", 1, timeout_s=5)
    assert service.list_versions("m")[0].completed_reads == 1
    renewer.close()


def test_the_catalog_answers_when_the_fence_is_short_the_bound_passed_or_the_renewer_closed() -> None:
    service = CatalogService()
    _ready(service)
    renewer = LeaseRenewer("answers")
    for fence in (0.0, TTL_S - 0.1):  # no promise, or one shorter than the lease
        guard = _guard(service, renewer, f"fence-{fence}")
        guard.start()
        assert guard.release(fence_s=fence) == "catalog"
        assert not _live(service, guard.lease_id)  # released before returning
    # Never renewed and past its TTL: the deadline proves nothing, and the catalog says it is gone.
    lapsed = _guard(service, renewer, "lapsed")
    time.sleep(TTL_S + 0.2)
    with pytest.raises(LeaseLost, match="ran out"):
        lapsed.release(fence_s=600.0)
    renewer.close()
    closed = _guard(service, renewer, "after-close")
    closed.start()  # renewed by a thread of its own: nobody would send a later release
    assert closed.release(fence_s=TTL_S) == "catalog"


def test_a_lease_the_catalog_said_is_gone_is_never_confirmed_by_its_deadline() -> None:
    catalog = RestartableCatalog()
    _ready(catalog.service)
    lease_id = catalog.acquire_lease("m", 1, "reader", ttl_s=TTL_S)
    catalog.restart()  # the lease is lost; locally it is still inside its deadline
    guard = _guard(catalog, LeaseRenewer("gone"), "reader", lease_id)
    guard.renew()  # the restarted catalog: NotFound
    with pytest.raises(LeaseLost, match="catalog restarted and lost the lease"):
        guard.release(fence_s=TTL_S)


def test_closing_the_renewer_sends_every_release_it_still_holds() -> None:
    service = CatalogService()
    _ready(service)
    renewer = LeaseRenewer("flush")
    guards = [_guard(service, renewer, f"r{i}") for i in range(20)]
    for guard in guards:
        guard.start()
        assert guard.release(completed=True, fence_s=TTL_S) == "deadline"
    renewer.close()
    assert [g.lease_id for g in guards if _live(service, g.lease_id)] == []
    assert service.list_versions("m")[0].completed_reads == 20


def _tensors(n: int = 2) -> list[PublishedTensor]:
    return [PublishedTensor(f"layers.{i}.weight", torch.full((8, 8), float(i))) for i in range(n)]


def test_a_publisher_whose_catalog_lost_it_leaves_its_buffers_alone_for_the_fence() -> None:
    catalog = RestartableCatalog()
    with Publisher(catalog, "m", lease_fence_s=1.0) as pub:
        published = _tensors()
        pub.publish(1, published)
        started = time.monotonic()
        pub.wait_drained(1)
        assert time.monotonic() - started < 0.5  # the catalog that granted the leases said so
        pub.publish(2, published)
        catalog.restart()  # readers may still trust leases on version 2 for up to their TTL
        started = time.monotonic()
        pub.wait_drained(2)
        assert time.monotonic() - started >= 1.0
        pub.publish(3, published)  # registered with the new catalog: its word is final again
        started = time.monotonic()
        pub.wait_drained(3)
        assert time.monotonic() - started < 0.5


def test_a_rank_whose_peer_re_registered_the_version_still_holds_the_fence() -> None:
    catalog = RestartableCatalog()
    mesh = [MeshPosition(tp_rank=r, tp_size=2) for r in range(2)]
    with Publisher(catalog, "m", mesh=mesh[0], expected_sources=2, lease_fence_s=1.0) as first, \
            Publisher(catalog, "m", mesh=mesh[1], expected_sources=2, lease_fence_s=1.0) as second:
        first.publish(1, _tensors())
        second.publish(1, _tensors())
        catalog.restart()
        first._beat()  # re-registers version 1 with the restarted catalog; `second` has not noticed
        started = time.monotonic()
        second.wait_drained(1)  # the catalog knows version 1 again, not the leases it lost
        assert time.monotonic() - started >= 1.0


def test_no_fence_drains_at_once_and_a_fence_past_the_timeout_says_so() -> None:
    catalog = RestartableCatalog()
    with Publisher(catalog, "m", lease_fence_s=0.0) as pub:
        pub.publish(1, _tensors())
        catalog.restart()
        started = time.monotonic()
        pub.wait_drained(1)
        assert time.monotonic() - started < 0.5
    with Publisher(catalog, "m2", lease_fence_s=30.0) as pub:
        pub.publish(1, _tensors())
        catalog.restart()
        with pytest.raises(TimeoutError, match=r"lease_fence_s=30"):
            pub.wait_drained(1, timeout_s=0.5)
    with pytest.raises(Exception, match=r"lease_fence_s: must be a finite number"):
        Publisher(catalog, "m3", lease_fence_s=-1.0)


def test_steady_refits_confirm_by_deadline_and_the_drain_still_waits_for_the_release(mx_catalog, mx_model_name):
    published = _tensors(3)
    with Publisher(mx_catalog, mx_model_name, lease_fence_s=60.0) as pub:
        with Receiver(mx_catalog, mx_model_name, lease_ttl_s=60.0) as rec:
            for version in (1, 2, 3):
                for t in published:
                    t.tensor.add_(1.0)
                pub.publish(version, published)
                result = rec.refit(version)
                assert result.stats.lease_confirmed_by == "deadline"
                got = dict(result.tensors)
                assert all(torch.equal(got[t.name], t.tensor) for t in published)
                pub.wait_drained(version, timeout_s=10)  # ended by the release sent afterwards
        # A lease longer than the publisher's fence is not covered by it: the catalog answers.
        with Receiver(mx_catalog, mx_model_name, lease_ttl_s=61.0) as rec:
            pub.publish(4, published)
            assert rec.refit(4).stats.lease_confirmed_by == "catalog"
            pub.wait_drained(4, timeout_s=10)
