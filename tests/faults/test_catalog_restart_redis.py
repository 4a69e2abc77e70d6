"""The Redis catalog store across catalog restarts: two ``mx-refit serve --store redis://``
processes on one real ``redis-server``, each killed (SIGKILL, some SIGTERM) and restarted in
turn while a publish is in flight. Nothing that was committed is lost, leases taken before a
restart are honoured after it, TTLs keep running (the restarted reaper expires what lapsed),
and clients reconnect on their own without registering anything twice."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _harness import HERE, Proc

from mx_refit.catalog.client import CatalogClient
from mx_refit.types import MeshPosition, SourceInfo, TensorDescriptor, VersionState

sys.path.insert(0, str(HERE.parent))
from redis_server import RedisServer  # noqa: E402

pytestmark = pytest.mark.timeout(600)
MODEL = "policy"
BOUND_S = 60.0  # generous for a loaded 2-core box; a restart takes ~0.1-0.3 s


def rank(r: int, version: int) -> SourceInfo:
    tensors = tuple(
        TensorDescriptor(name=f"layer{i}.w", dtype="float32", global_shape=(8, 4), local_shape=(4, 4),
                         addr=0x1000 * (i + 1) + version, nbytes=64, shard_axis=0, shard_offset=4 * r)
        for i in range(6)
    )
    return SourceInfo(source_id=f"rank{r}", mesh=MeshPosition(tp_rank=r, tp_size=2), agent_name=f"agent{r}",
                      agent_metadata=os.urandom(64), tensors=tensors, ready=True, incarnation="run-1")


class Catalogs:
    """Two serve processes on one Redis, forked by a warm zygote; restartable by signal."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.redis = RedisServer(log_dir)
        self.zygote = Proc([sys.executable, str(HERE / "_catalog_zygote.py")], "zygote", log_dir)
        self.zygote.expect("ready")
        self.ports = [0, 0]  # the first starts bind free ports and announce them
        self.pids = [self._start(0), self._start(1)]

    def _start(self, which: int) -> int:
        """Serve on ``ports[which]``; the port is known once the catalog announces it (one JSON
        line in its log). A restart binds its old port again: a start that dies (another process
        holds the port for a moment) is retried until ``BOUND_S``."""
        log = self.log_dir / f"catalog-{which}.log"
        deadline = time.monotonic() + BOUND_S
        while True:
            seen = log.stat().st_size if log.exists() else 0
            argv = ["serve", "--json", "--port", str(self.ports[which]), "--store", self.redis.url]
            pid = int(self.zygote.call(argv=argv, log=str(log))["pid"])
            port = _announced_port(log, seen, pid, deadline)
            if port is not None:
                self.ports[which] = port
                return pid
            assert self.ports[which] != 0 and time.monotonic() < deadline, f"catalog {which} did not start: {log}"
            time.sleep(0.2)

    def restart(self, which: int, sig: int) -> None:
        pid = self.pids[which]
        os.kill(pid, sig)
        deadline = time.monotonic() + BOUND_S
        while True:  # gone (SIGTERM: after its graceful stop)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"catalog {pid} did not exit on {signal.Signals(sig).name}"
            time.sleep(0.005)
        self.pids[which] = self._start(which)

    def address(self, which: int) -> str:
        return f"127.0.0.1:{self.ports[which]}"

    def close(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.zygote.kill()
        self.redis.stop()


def _announced_port(log: Path, seen: int, pid: int, deadline: float) -> int | None:
    """The port in the catalog's announcement written to ``log`` after byte ``seen``; None once
    the process is gone without one."""
    while time.monotonic() < deadline:
        with open(log, "rb") as handle:
            handle.seek(seen)
            for line in handle.read().decode(errors="replace").splitlines():
                if line.startswith("{"):
                    return int(json.loads(line)["port"])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        time.sleep(0.01)
    raise TimeoutError(f"catalog {pid} did not announce its port within {BOUND_S:.0f} s: {log}")


@pytest.fixture(scope="module")
def catalogs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Catalogs]:
    rig = Catalogs(tmp_path_factory.mktemp("redis-restarts"))
    try:
        yield rig
    finally:
        rig.close()


def client(address: str) -> CatalogClient:
    # Bounded reconnects: ~3 s of backoff covers a restart many times over.
    return CatalogClient(address, timeout_s=10.0, retries=12, backoff_s=0.05)


def observed(cl: CatalogClient) -> list[tuple[Any, ...]]:
    return [(s.version, s.state, s.registered_sources, s.ready_sources, s.leases, s.completed_reads)
            for s in cl.list_versions(MODEL)]


def publish(cl: CatalogClient, version: int) -> None:
    for r in (0, 1):
        cl.register_source(MODEL, version, 2, rank(r, version), {"arch": "dense"}, ttl_s=600.0,
                           expected_readers=1)


@pytest.mark.slow
def test_100_catalog_restarts_lose_nothing_that_was_committed(catalogs: Catalogs) -> None:
    rng = random.Random(13)
    pub, rdr = client(catalogs.address(0)), client(catalogs.address(1))  # one per serve process
    publish(pub, 1)
    held = {1: rdr.acquire_lease(MODEL, 1, "reader", ttl_s=600.0)}
    recoveries: list[float] = []
    lost: list[str] = []
    expired_checks = 0
    for i in range(100):
        version = i + 2
        victim = i % 2  # the publisher's catalog, then the reader's
        sig = signal.SIGTERM if i % 4 == 3 else signal.SIGKILL
        doomed = rdr.acquire_lease(MODEL, version - 1, f"doomed-{i}", ttl_s=0.5) if i % 5 == 0 else None
        before = observed(rdr)
        live_manifest = rdr.get_version(MODEL, version - 1)
        # The kill lands while the next version is being registered: the client retries, and
        # must not register anything twice.
        inflight = threading.Thread(target=publish, args=(pub, version))
        inflight.start()
        time.sleep(rng.uniform(0, 0.02))
        started = time.monotonic()
        catalogs.restart(victim, sig)
        inflight.join(BOUND_S)
        assert not inflight.is_alive(), f"restart {i}: the in-flight publish never finished"
        after = observed(pub)
        recoveries.append(time.monotonic() - started)
        newest = after[-1]
        if newest[:5] != (version, VersionState.READY, 2, 2, 0):
            lost.append(f"restart {i}: the retried publish of version {version} left {newest}")
        # Everything committed before the kill is still there. The doomed lease (TTL 0.5 s) may
        # have expired meanwhile: that is its TTL at work, not a loss.
        kept = [row for row in after if row[0] != version]
        if doomed is not None:
            live = next(row for row in kept if row[0] == version - 1)
            if live[4] not in (1, 2):
                lost.append(f"restart {i}: version {version - 1} has {live[4]} leases, not 1 or 2")
            before = [(*row[:4], None, row[5]) if row[0] == version - 1 else row for row in before]
            kept = [(*row[:4], None, row[5]) if row[0] == version - 1 else row for row in kept]
        if kept != before:
            lost.append(f"restart {i}: {before} became {kept}")
        again = pub.get_version(MODEL, version - 1)
        if (again.sources, again.sidecar, again.sidecar_digest) != (
                live_manifest.sources, live_manifest.sidecar, live_manifest.sidecar_digest):
            lost.append(f"restart {i}: version {version - 1}'s manifest changed")
        # The lease taken before the restart is honoured: renewed, released as a completed read,
        # and the drain finishes through the other catalog process.
        old = version - 1
        rdr.heartbeat(lease_ids=[held[old]])
        held[version] = rdr.acquire_lease(MODEL, version, "reader", ttl_s=600.0)
        pub.retire_version(MODEL, old)
        rdr.release_lease(held.pop(old), completed=True)
        if doomed is not None:  # its TTL ran across the restart: the restarted reapers expire it
            expired_checks += 1
            assert pub.wait_drained(MODEL, old, timeout_s=BOUND_S), f"restart {i}: the doomed lease never expired"
        else:
            assert pub.wait_drained(MODEL, old, timeout_s=BOUND_S)
        assert pub.wait_read(MODEL, old, timeout_s=BOUND_S).done
    assert lost == [], lost
    final = observed(rdr)
    assert [row[0] for row in final][-1] == 101 and final[-1][1] is VersionState.READY
    pub.close()
    rdr.close()
    recoveries.sort()
    print(f"100 catalog restarts (2 serve processes, one Redis; {sum(1 for i in range(100) if i % 4 == 3)} "
          f"SIGTERM, the rest SIGKILL): 0 committed changes lost, {expired_checks} short leases expired "
          f"across a restart; restart + retried publish s: median {recoveries[50]:.2f}, "
          f"max {recoveries[-1]:.2f}")
