"""Fixtures of the catalog tests."""

from __future__ import annotations

import pytest
from catalog_factories import FakeClock

from mx_refit.catalog import CatalogService


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def service(clock: FakeClock) -> CatalogService:
    return CatalogService(clock=clock)
