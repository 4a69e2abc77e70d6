"""Pytest fixtures for mx-refit and its plugin authors (loaded through the ``pytest11`` entry point).

- ``mx_catalog``: a real embedded catalog server on 127.0.0.1 (session-scoped); its address.
- ``mx_hooks``: a fresh :class:`~mx_refit.plugins.Hooks` with the built-in plugins and the
  installed entry points loaded; register inline plugins on it in a test.
- ``mx_model_name``: a model name unique to the test, so tests sharing a catalog never collide.

Helpers for tests that drive real processes (imported explicitly, never loaded by the plugin):

- :mod:`mx_refit.testing.procs`: child processes commanded over authenticated local sockets
  (trainer ranks, inference workers), both ends of the protocol, and the cached venvs' interpreters.
- :mod:`mx_refit.testing.checkpoints`: tiny seeded HF Qwen2 checkpoints, one directory a version.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.plugins import Hooks

__all__ = ["mx_catalog", "mx_hooks", "mx_model_name"]


@pytest.fixture(scope="session")
def mx_catalog() -> Iterator[str]:
    from mx_refit.catalog.server import start_embedded

    server = start_embedded()
    try:
        yield server.address
    finally:
        server.stop(0)


@pytest.fixture
def mx_hooks() -> "Hooks":
    from mx_refit.plugins import Hooks

    return Hooks()


@pytest.fixture
def mx_model_name(request: pytest.FixtureRequest) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:80]
