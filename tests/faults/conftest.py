"""Fault-injection rigs: a real catalog process, a TCP relay, publisher and reader processes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _harness import CatalogProc, RelayProc, publisher, reader  # noqa: E402


class LeaseRig:
    """catalog <- publisher (direct); catalog <- relay <- gated reader (short lease)."""

    LEASE_TTL_S = 2.0

    def __init__(self, log_dir: Path, model: str) -> None:
        self.log_dir = log_dir
        self.model = model
        self.catalog = CatalogProc(log_dir)
        self.relay = RelayProc(self.catalog.port, log_dir)
        self.pub = publisher(self.catalog.address, model, log_dir, ttl=10.0)
        self.reader = reader(self.relay.address, model, log_dir, lease_ttl=self.LEASE_TTL_S, gate=True)
        self.version = 0
        self._warm_up()

    def _warm_up(self) -> None:
        """One plain refit first: connecting to the source and registering the arena are slow
        once, and must not eat the first case's lease."""
        self.reader.call(cmd="gate", on=False)
        self.version += 1
        assert self.pub.call(cmd="publish", version=self.version)["state"] == "READY"
        result = self.reader.call(cmd="refit", version=self.version, timeout=120)
        assert result["ok"] and result["wrong"] == [], result
        assert self.pub.call(cmd="drain", version=self.version, then=self.version + 1) == {"drained": True}
        self.reader.call(cmd="gate", on=True)

    def close(self) -> None:
        for proc in (self.reader, self.pub):
            proc.kill()
        self.relay.stop()
        self.catalog.stop()


@pytest.fixture(scope="module")
def lease_rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LeaseRig]:
    rig = LeaseRig(tmp_path_factory.mktemp("lease-faults"), "lease-faults")
    try:
        yield rig
    finally:
        rig.close()


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fault-logs")


@pytest.fixture(scope="module")
def catalog_proc(log_dir: Path) -> Iterator[CatalogProc]:
    proc = CatalogProc(log_dir)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def catalog_client(catalog_proc: CatalogProc):
    from mx_refit.catalog.client import CatalogClient

    with CatalogClient(catalog_proc.address, timeout_s=5.0) as client:
        yield client
