"""A heartbeat's ``watch_source_ids``: the reply names the watched sources the catalog no longer
holds live, so a receiver mid-pull stops waiting on a frozen source (both stores)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from catalog_factories import FakeClock, publish_ready

from mx_refit.catalog import CatalogService
from mx_refit.catalog.validation import CatalogLimits
from mx_refit.errors import InvalidArgument


def test_watched_sources_are_reported_gone_once_their_ttl_lapses(service: CatalogService, clock: FakeClock) -> None:
    publish_ready(service, "m", 1)  # tp0 and tp1, source TTL 30 s
    lease = service.acquire_lease("m", 1, "r", ttl_s=60)
    watch = ["tp0", "tp1", "ghost"]
    assert service.heartbeat(lease_ids=[lease], watch_source_ids=watch) == {"ghost"}  # never registered
    assert service.heartbeat(lease_ids=[lease]) == frozenset()  # nothing watched, nothing reported
    clock.advance(20)
    service.heartbeat(source_ids=["tp0"])  # tp1 goes silent
    assert service.heartbeat(lease_ids=[lease], watch_source_ids=watch) == {"ghost"}
    clock.advance(15)  # tp1's TTL lapsed; the reader's lease is still held
    assert service.heartbeat(lease_ids=[lease], watch_source_ids=watch) == {"tp1", "ghost"}
    assert service.list_versions("m")[0].leases == 1


def test_watching_renews_nothing_and_never_fails_the_call(service: CatalogService, clock: FakeClock) -> None:
    publish_ready(service, "m", 1)
    clock.advance(20)
    assert service.heartbeat(watch_source_ids=["tp0", "tp1"]) == frozenset()
    clock.advance(15)  # a watch is not a sign of life: both sources lapse
    assert service.heartbeat(watch_source_ids=["tp0", "tp1"]) == {"tp0", "tp1"}
    assert service.reap().sources == ()  # already reaped by the heartbeat's own transaction


def test_watch_source_ids_are_validated_naming_the_field(
    make_service: Callable[..., CatalogService], clock: FakeClock
) -> None:
    service = make_service(clock=clock, limits=CatalogLimits(max_watched_sources=2))
    with pytest.raises(InvalidArgument, match=r"watch_source_ids: 3 ids exceed the limit of 2"):
        service.heartbeat(watch_source_ids=["a", "b", "c"])
    with pytest.raises(InvalidArgument, match=r"watch_source_ids: must be a sequence of ids, got the string 'tp0'"):
        service.heartbeat(watch_source_ids="tp0")
    with pytest.raises(InvalidArgument, match=r"watch_source_ids\[1\]"):
        service.heartbeat(watch_source_ids=["tp0", ""])
