"""A Redis that loses committed writes: restarts from a snapshot, rollbacks under two catalog
processes, and outages, on a real ``redis-server``.

* Restarts from a snapshot taken before the reader's lease (Redis's default RDB persistence
  after a crash): the version and the publisher's registration survive, the lease does not. The
  publisher drains at once and mutates; the reader must never load a byte of that (real
  Publisher and Receiver, real NIXL transfers, a real gRPC catalog on the Redis store).
* Rollbacks with two ``mx-refit serve`` processes on one Redis: a commit made after the
  rollback by one process is never overwritten by the other running on its stale cache.
* Outages (Redis killed, then back from its snapshot) mid-publish and mid-drain: the calls retry
  until they succeed; no client sees anything but UNAVAILABLE (never INTERNAL).

The counts asserted here are recorded in RELIABILITY.md.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import HERE

from mx_refit.catalog import CatalogService
from mx_refit.catalog.client import CatalogClient
from mx_refit.catalog.server import start_embedded
from mx_refit.catalog.store.redis_store import RedisStore
from mx_refit.errors import LeaseLost, Unavailable
from mx_refit.publisher import Publisher
from mx_refit.receive.cycle import RefitCycle
from mx_refit.receive.receiver import Receiver
from mx_refit.types import MeshPosition, PublishedTensor, SourceInfo, TensorDescriptor

sys.path.insert(0, str(HERE.parent))
from redis_server import RedisServer  # noqa: E402
from test_catalog_restart_redis import Catalogs  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ROUNDS = 30
FENCE_S = 0.6  # the publisher's lease fence and the reader's lease TTL (the deadline shortcut's case)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def _embedded(redis: RedisServer) -> Any:
    return start_embedded(service=CatalogService(store=RedisStore(redis.url, timeout_s=2.0)), reap_interval_s=0.2)


def test_restarts_from_a_snapshot_before_the_readers_lease_load_no_wrong_byte(redis, monkeypatch) -> None:
    server = _embedded(redis)
    tensors = [PublishedTensor(f"layers.{i}.weight", torch.zeros(64, 64)) for i in range(3)]
    pull = RefitCycle.pull
    drained = threading.Event()
    drains: list[threading.Thread] = []

    def drain_and_mutate(version: int) -> None:
        pub.wait_drained(version, timeout_s=60)
        for t in tensors:
            t.tensor.fill_(-float(version))  # the trainer's next step overwrites the buffers
        drained.set()

    def restart_then_pull(cycle: RefitCycle, leased: Any, arena: Any) -> Any:
        # The reader holds its lease; Redis comes back from the snapshot that predates it.
        redis.restart()
        drained.clear()
        drains.append(threading.Thread(target=drain_and_mutate, args=(leased.info.version,)))
        drains[-1].start()
        drained.wait(0.1)  # a drain that does not hold the fence mutates under the pull here
        return pull(cycle, leased, arena)

    monkeypatch.setattr(RefitCycle, "pull", restart_then_pull)
    counts = {"loaded": 0, "lease_lost": 0, "wrong_bytes": 0, "by_deadline": 0}
    try:
        with Publisher(server.address, "m", lease_fence_s=FENCE_S, ttl_s=30.0) as pub, \
                Receiver(server.address, "m", lease_ttl_s=FENCE_S) as rec:
            for version in range(1, ROUNDS + 1):
                for t in tensors:
                    t.tensor.fill_(float(version))
                pub.publish(version, tensors)
                redis.snapshot()  # the version READY, the registration; no lease yet
                try:
                    result = rec.refit(version, wait_s=30)
                except LeaseLost:
                    counts["lease_lost"] += 1
                else:
                    counts["loaded"] += 1
                    counts["by_deadline"] += result.stats.lease_confirmed_by == "deadline"
                    counts["wrong_bytes"] += sum(int((t != version).sum()) for _, t in result.tensors)
                drains[-1].join(60)
                assert not drains[-1].is_alive(), "the drain never finished"
    finally:
        server.stop(0)
    print(f"\n{ROUNDS} restarts from a snapshot before the lease: {counts}")
    assert redis.restarts == ROUNDS
    assert counts["wrong_bytes"] == 0, counts
    assert counts["loaded"] + counts["lease_lost"] == ROUNDS


def _source(version: int) -> SourceInfo:
    tensor = TensorDescriptor(name="w", dtype="float32", global_shape=(4,), local_shape=(4,),
                              addr=0x1000 + version, nbytes=16)
    return SourceInfo(source_id="rank0", mesh=MeshPosition(), agent_name="a", agent_metadata=os.urandom(16),
                      tensors=(tensor,), ready=True, incarnation="run-1")


def _register(client: CatalogClient, model: str, version: int) -> str:
    client.register_source(model, version, 1, _source(version), ttl_s=600)
    return client.answer_epoch()


def test_rollbacks_with_two_serve_processes_lose_no_committed_update(tmp_path) -> None:
    rig = Catalogs(tmp_path)
    one = CatalogClient(rig.address(0), timeout_s=10.0)
    two = CatalogClient(rig.address(1), timeout_s=10.0)
    lost: list[tuple[str, int]] = []
    epochs = set()
    try:
        for i in range(ROUNDS):
            model = f"m{i}"
            epochs.add(_register(one, model, 1))  # committed before the snapshot
            rig.redis.snapshot()
            _register(one, model, 2)  # lost with the rollback; `one` caches the state holding it
            rig.redis.restart()
            _register(two, model, 3)  # one commit after the rollback, by the other process
            epochs.add(_register(one, model, 4))  # must run on the state that holds version 3
            kept = {s.version for s in two.list_versions(model)}
            lost += [(model, v) for v in (1, 3, 4) if v not in kept]
    finally:
        one.close()
        two.close()
        rig.close()
    print(f"\n{ROUNDS} rollbacks with two serve processes: {len(lost)} committed updates lost, "
          f"{len(epochs)} epochs seen")
    assert lost == []
    assert len(epochs) == ROUNDS + 1  # every restart began a new epoch, none came back


def test_a_redis_outage_mid_publish_and_mid_drain_is_retried_never_internal(redis) -> None:
    server = _embedded(redis)
    client = CatalogClient(server.address, timeout_s=10.0)
    tensors = [PublishedTensor("w", torch.ones(16, 16))]
    errors: list[BaseException] = []

    def outage(down_s: float) -> threading.Thread:
        redis.snapshot()
        redis.kill()

        def back() -> None:
            time.sleep(down_s)
            redis.start_again()

        thread = threading.Thread(target=back)
        thread.start()
        return thread

    try:
        with Publisher(server.address, "m", lease_fence_s=0.5, ttl_s=30.0) as pub:
            for version in (1, 2, 3):
                back = outage(1.0)
                started = time.monotonic()
                assert pub.publish(version, tensors).name == "READY"  # retried through the outage
                back.join()
                assert time.monotonic() - started < 10
                lease = client.acquire_lease("m", version, "reader", ttl_s=30)
                done = threading.Event()

                def drain(version: int = version, done: threading.Event = done) -> None:
                    try:
                        pub.wait_drained(version, timeout_s=30)
                    except BaseException as exc:  # reported below
                        errors.append(exc)
                    done.set()

                thread = threading.Thread(target=drain)
                thread.start()
                time.sleep(0.2)
                back = outage(1.0)
                try:  # a raw call in the outage: UNAVAILABLE after its timeout, never INTERNAL
                    CatalogClient(server.address, timeout_s=0.5).list_versions("m")
                except Unavailable as exc:
                    assert "INTERNAL" not in str(exc)
                back.join()
                assert not done.is_set(), "drained while a lease was live"
                client.release_lease(lease)
                thread.join(40)
                assert done.is_set() and not errors, errors
    finally:
        client.close()
        server.stop(0)
