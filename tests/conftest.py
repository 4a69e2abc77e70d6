"""Fixtures shared across the test tree: a Redis server, tiny HF checkpoints and the Bridge
import (the layout, megatron and verify tests all build models from them)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_server import RedisServer

_REPO = Path(__file__).resolve().parents[1]
# Spawned rank processes inherit sys.path: make `tests.fixtures` and `mx_refit` importable there
# whether pytest was started as `python -m pytest` (cwd on the path) or as `pytest`.
for _path in (str(_REPO), str(_REPO / "core" / "src")):
    if _path not in sys.path:
        sys.path.insert(0, _path)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real ``redis-server`` for the catalog's Redis store (started on first use)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_hf(kind) -> Path``: build (once per session) a tiny seeded HF checkpoint."""
    from tests.fixtures.tiny_hf import build_tiny_hf

    root = tmp_path_factory.mktemp("tiny_hf")
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = build_tiny_hf(kind, root / kind)
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def bridge():
    """The ``megatron.bridge`` module (imported with the TE stub); skips when not installed."""
    from mx_refit.megatron._bridge_import import bridge_import_error, import_bridge

    try:
        return import_bridge()
    except ImportError:
        pytest.skip(f"megatron-bridge not importable: {bridge_import_error()}")
