"""Liveness follows the process: a restarted rank replaces its predecessor at once, dead
versions are never offered, a dead version's number can be published again, and a long-lived
receiver frees what it held of every dead source (flat fd count).

Publisher processes are forked from a warm zygote (real new processes: own pid, incarnation and
NIXL agent) and SIGKILLed; the receiver is one long-lived reader process.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from _harness import kill_and_wait, reader, spawn_source, zygote

pytestmark = pytest.mark.timeout(900)
MODEL = "source-faults"


class SourceRig:
    def __init__(self, catalog_proc, catalog_client, log_dir) -> None:
        self.catalog = catalog_client
        self.zygote = zygote(catalog_proc.address, log_dir)
        self.reader = reader(catalog_proc.address, MODEL, log_dir, lease_ttl=10.0, transfer_timeout=5.0)
        self.live: dict | None = None  # the current rank process (published event)
        self.version = 0

    def restart_rank(self, version: int, *, kill_first: bool = True) -> dict:
        """The rank's process dies (SIGKILL) and a new process takes its mesh position."""
        if kill_first and self.live is not None:
            kill_and_wait(self.live["pid"])
        event = spawn_source(self.zygote, model=MODEL, version=version, ttl=60.0)
        assert event["state"] == "READY", event
        if not kill_first and self.live is not None:
            kill_and_wait(self.live["pid"])
        self.live = event
        return event

    def ready_versions(self) -> list[int]:
        return [s.version for s in self.catalog.list_versions(MODEL) if s.state.value == "READY"]

    def refit(self, version: int | None = None) -> dict:
        return self.reader.call(cmd="refit", version=version, wait_s=10, timeout=120)

    def fds(self) -> int:
        return self.reader.call(cmd="fds")["fds"]

    def close(self) -> None:
        if self.live is not None:
            try:
                os.kill(self.live["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.reader.kill()
        self.zygote.kill()


@pytest.fixture(scope="module")
def rig(catalog_proc, catalog_client, log_dir) -> Iterator[SourceRig]:
    r = SourceRig(catalog_proc, catalog_client, log_dir)
    try:
        yield r
    finally:
        r.close()


def test_a_restarted_rank_replaces_its_predecessor_at_once(rig) -> None:
    first = rig.restart_rank(1)
    result = rig.refit()
    assert result.get("version") == 1, result
    second = rig.restart_rank(2)  # same mesh position, so the same source_id
    states = {s.version: s.state.value for s in rig.catalog.list_versions(MODEL)}
    assert states[1] == "EXPIRED", states  # its process is dead: never offered again
    assert second["source_id"] == first["source_id"] and second["incarnation"] != first["incarnation"]
    assert rig.ready_versions() == [2]
    result = rig.refit()
    assert result["ok"] and result["version"] == 2 and result["wrong"] == [], result


def test_a_dead_versions_number_can_be_published_again(rig) -> None:
    rig.version = max(rig.ready_versions() or [0])
    rig.restart_rank(rig.version)  # a restarted job republishes the step it died at
    assert rig.ready_versions() == [rig.version]
    result = rig.refit(rig.version)
    assert result["ok"] and result["wrong"] == [], result


def death_cycle(rig: SourceRig, kind: int) -> dict:
    """One source death of the given kind (0-3); returns what the reader saw."""
    if kind == 1:  # the source dies in the middle of a pull
        rig.reader.call(cmd="gate", on=True)
        rig.reader.send(cmd="refit", version=None)
        rig.reader.expect("gate")
        kill_and_wait(rig.live["pid"])
        rig.reader.send(cmd="go")
        failed = rig.reader.next(timeout=120)
        rig.reader.call(cmd="gate", on=False)
        assert failed.get("ok") is False and failed["error"] == "TransferError", failed
    if kind == 2:  # the restarted rank republishes the version number its predecessor held
        rig.restart_rank(rig.version)
    elif kind == 3:  # the successor registers while the predecessor is still dying
        rig.version += 1
        rig.restart_rank(rig.version, kill_first=False)
    else:
        rig.version += 1
        rig.restart_rank(rig.version)
    dead_ready = [v for v in rig.ready_versions() if v != rig.version]
    result = rig.refit()
    return {"dead_ready": dead_ready, "refit": result}


def test_source_deaths_leave_the_receivers_fd_count_flat(rig) -> None:
    rig.version = max(rig.ready_versions() or [0]) + 1
    rig.restart_rank(rig.version)
    rig.refit()
    baseline = None
    for i in range(12):  # the rank dies after a pull, or in the middle of one
        outcome = death_cycle(rig, i % 2)
        assert outcome["refit"]["ok"], outcome
        if i == 3:
            baseline = rig.fds()
    assert rig.fds() <= baseline + 2, (baseline, rig.fds())


@pytest.mark.slow
def test_100_rank_restarts_leave_no_dead_version_ready_and_flat_fds(rig) -> None:
    rig.version = max(rig.ready_versions() or [0]) + 1
    rig.restart_rank(rig.version)
    rig.refit()
    dead_ready_total, wrong, fds = 0, 0, []
    for i in range(100):
        outcome = death_cycle(rig, i % 4)
        dead_ready_total += len(outcome["dead_ready"])
        refit = outcome["refit"]
        assert refit["ok"] and refit["version"] == rig.version, refit
        wrong += len(refit["wrong"])
        if i % 10 == 9:
            fds.append(rig.fds())
    versions = rig.catalog.list_versions(MODEL)
    print(f"100 rank restarts: dead versions READY: {dead_ready_total}; wrong tensors: {wrong}; "
          f"reader fds every 10 deaths: {fds}; versions remembered: {len(versions)}")
    assert dead_ready_total == 0 and wrong == 0
    assert max(fds) <= fds[0] + 2, fds
    assert len(versions) <= 6  # dead versions are pruned (4 terminal kept, plus the live one)
