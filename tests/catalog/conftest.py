"""Fixtures of the catalog tests: every test that builds a catalog runs on both stores, the
in-memory one and Redis (a real ``redis-server``, one per session, flushed per test)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from catalog_factories import FakeClock
from catalog_stores import STORES, build_store

from mx_refit.catalog import CatalogService


@pytest.fixture(params=STORES)
def store_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "redis":
        request.getfixturevalue("redis_server").flush()
    yield request.param


@pytest.fixture
def make_service(store_kind: str, request: pytest.FixtureRequest) -> Iterator[Callable[..., CatalogService]]:
    """``make_service(clock=None, **kwargs)``: a fresh, independent catalog on this test's store."""
    made: list[CatalogService] = []

    def make(*, clock: Callable[[], float] | None = None, **kwargs: Any) -> CatalogService:
        service = CatalogService(store=build_store(store_kind, request, clock), **kwargs)
        made.append(service)
        return service

    yield make
    for service in made:
        service.store.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def service(clock: FakeClock, make_service: Callable[..., CatalogService]) -> CatalogService:
    return make_service(clock=clock)
