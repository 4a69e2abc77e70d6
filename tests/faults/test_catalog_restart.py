"""After the catalog restarts (SIGKILL, SIGTERM) or stalls (SIGSTOP), every live publisher
registers its live versions again, without duplicates, and readers resume within seconds."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest
from _harness import CatalogProc, publisher, reader

pytestmark = pytest.mark.timeout(900)
RECOVERY_BOUND_S = 90.0  # generous for a loaded 2-core box; typical recovery is 1-3 s


class RestartRig:
    """Model "two" published by 2 rank processes, model "one" by 1; a reader of "two"."""

    def __init__(self, log_dir) -> None:
        from mx_refit.catalog.client import CatalogClient

        self.catalog = CatalogProc(log_dir)
        self.client = CatalogClient(self.catalog.address, timeout_s=5.0)
        addr = self.catalog.address
        self.pubs = {
            ("two", 0): publisher(addr, "two", log_dir, rank=0, ranks=2, ttl=6.0),
            ("two", 1): publisher(addr, "two", log_dir, rank=1, ranks=2, ttl=6.0),
            ("one", 0): publisher(addr, "one", log_dir, rank=0, ranks=1, ttl=6.0),
        }
        self.reader = reader(addr, "two", log_dir, lease_ttl=10.0)
        self.live = {"two": 0, "one": 0}
        self.recoveries: list[float] = []

    def publish_next(self, model: str) -> None:
        old, new = self.live[model], self.live[model] + 1
        for (m, _), pub in self.pubs.items():
            if m == model and old:
                assert pub.call(cmd="drain", version=old, then=new) == {"drained": True}
        for (m, _), pub in self.pubs.items():
            if m == model:
                assert "state" in pub.call(cmd="publish", version=new)
        self.live[model] = new

    def registered(self) -> bool:
        """Every live version READY with all its sources, and nothing registered twice."""
        try:
            for model, version in self.live.items():
                summaries = [s for s in self.client.list_versions(model) if s.version == version]
                if len(summaries) != 1:
                    return False
                s = summaries[0]
                if s.state.value != "READY" or s.registered_sources != s.expected_sources:
                    return False
            return True
        except Exception:  # still restarting
            return False

    def wait_registered(self) -> float:
        started = time.monotonic()
        while not self.registered():
            assert time.monotonic() - started < RECOVERY_BOUND_S, "publishers did not re-register"
            time.sleep(0.05)
        return time.monotonic() - started

    def check_reader(self) -> None:
        result = self.reader.call(cmd="refit", version=self.live["two"], wait_s=RECOVERY_BOUND_S, timeout=120)
        assert result["ok"] and result["wrong"] == [] and result["tensors"] == 4, result

    def close(self) -> None:
        for proc in (self.reader, *self.pubs.values()):
            proc.kill()
        self.client.close()
        self.catalog.stop()


@pytest.fixture(scope="module")
def rig(log_dir) -> Iterator[RestartRig]:
    r = RestartRig(log_dir)
    try:
        r.publish_next("two")
        r.publish_next("one")
        r.wait_registered()
        yield r
    finally:
        r.close()


def test_publishers_re_register_and_readers_resume_after_a_catalog_restart(rig) -> None:
    rig.catalog.restart(signal.SIGKILL)
    started = time.monotonic()
    rig.wait_registered()
    rig.check_reader()
    print(f"publishers re-registered and the reader refit {time.monotonic() - started:.2f} s after the restart")


def test_a_stalled_catalog_loses_nothing(rig) -> None:
    assert rig.catalog.proc is not None
    rig.catalog.proc.signal(signal.SIGSTOP)
    time.sleep(2.0)  # shorter than the sources' TTL: nothing may expire
    rig.catalog.proc.signal(signal.SIGCONT)
    rig.wait_registered()
    rig.check_reader()


@pytest.mark.slow
def test_20_catalog_restarts_every_live_publisher_re_registers(rig) -> None:
    recoveries = []
    for i in range(20):
        if i % 3 == 1:
            rig.publish_next("two")  # live versions move on between restarts
        if i % 5 == 2:
            rig.publish_next("one")
        rig.catalog.restart(signal.SIGTERM if i % 4 == 3 else signal.SIGKILL)
        started = time.monotonic()
        rig.wait_registered()
        rig.check_reader()
        recoveries.append(time.monotonic() - started)
    print(f"20 catalog restarts: all 3 publishers re-registered every time; "
          f"recovery s (re-registered + reader refit): max {max(recoveries):.2f}, "
          f"mean {sum(recoveries) / len(recoveries):.2f}")
