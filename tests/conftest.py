"""Fixtures shared across the test tree."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real ``redis-server`` for the catalog's Redis store (started on first use)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()
