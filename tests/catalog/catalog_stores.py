"""The stores every catalog test runs on (a plain module: imported, not a conftest)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mx_refit.catalog.store import CatalogStore, MemoryStore

STORES = ["memory", "redis"]


def build_store(kind: str, request: pytest.FixtureRequest, clock: Callable[[], float] | None) -> CatalogStore:
    if kind == "memory":
        return MemoryStore(clock) if clock is not None else MemoryStore()
    from mx_refit.catalog.store.redis_store import RedisStore

    server = request.getfixturevalue("redis_server")
    return RedisStore(server.url, clock=clock, namespace=server.namespace())
