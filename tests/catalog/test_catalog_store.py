"""The Redis store beyond the shared suite: state shared by several catalogs on one Redis,
kept across a catalog restart, atomic under concurrent writers; store URLs; the generic codec."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from catalog_factories import FakeClock, publish_ready, snapshot, tp_source

from mx_refit.catalog import CatalogService
from mx_refit.catalog.store import check_store_url, open_store
from mx_refit.catalog.store.codec import StateCodec
from mx_refit.catalog.store.redis_store import RedisStore
from mx_refit.errors import InvalidArgument, NotFound
from mx_refit.types import VersionState


@pytest.fixture
def on_redis(redis_server):
    """``on_redis(clock=None)``: a new catalog process's service on this test's namespace."""
    redis_server.flush()
    namespace = redis_server.namespace()
    made: list[CatalogService] = []

    def make(clock=None) -> CatalogService:
        made.append(CatalogService(store=RedisStore(redis_server.url, clock=clock, namespace=namespace)))
        return made[-1]

    yield make
    for service in made:
        service.store.close()


def test_two_catalogs_on_one_redis_share_versions_and_wake_each_others_drain_waiters(on_redis) -> None:
    one, two = on_redis(), on_redis()
    publish_ready(one, "m", 1, sidecar={"arch": "dense"})
    assert two.get_version("m") == one.get_version("m")
    lease = two.acquire_lease("m", 1, "reader-a")
    assert one.retire_version("m", 1) is VersionState.DRAINING
    drained: list[bool] = []
    waiter = threading.Thread(target=lambda: drained.append(one.wait_drained("m", 1, timeout_s=60)))
    waiter.start()
    time.sleep(0.2)
    assert drained == []  # the lease, held through the other catalog, still counts
    two.release_lease(lease, completed=True)
    waiter.join(60)
    assert drained == [True]
    assert [s.state for s in one.list_versions("m")] == [VersionState.RETIRED]


def test_a_restarted_catalog_keeps_versions_leases_and_ttls(on_redis) -> None:
    clock = FakeClock()
    before = on_redis(clock)
    publish_ready(before, "m", 1)
    publish_ready(before, "m", 2)
    before.retire_version("m", 1)
    lease = before.acquire_lease("m", 2, "reader", ttl_s=10)
    released = before.acquire_lease("m", 2, "other", ttl_s=10)
    before.release_lease(released)
    seen = snapshot(before)
    before.store.close()  # the process is gone; only Redis remains

    after = on_redis(clock)
    assert snapshot(after) == seen
    after.release_lease(released)  # a retried release of a released lease is still a no-op
    clock.advance(8)
    after.heartbeat(lease_ids=[lease])  # the lease is honoured: renewed, not unknown
    clock.advance(8)
    after.release_lease(lease, completed=True)
    clock.advance(31)  # the sources' 30 s TTL, counted from before the restart, lapses
    report = after.reap()
    assert sorted(report.sources) == ["tp0", "tp1"]
    assert [s.state for s in after.list_versions("m")] == [VersionState.RETIRED, VersionState.EXPIRED]


def test_an_expired_lease_stays_expired_across_a_restart(on_redis) -> None:
    clock = FakeClock()
    before = on_redis(clock)
    publish_ready(before, "m", 1)
    lease = before.acquire_lease("m", 1, "reader", ttl_s=2)
    clock.advance(3)
    assert before.reap().leases == (lease,)
    after = on_redis(clock)
    with pytest.raises(NotFound, match="expired"):
        after.release_lease(lease)


def test_concurrent_writers_on_two_catalogs_lose_no_update(on_redis) -> None:
    one, two = on_redis(), on_redis()
    publish_ready(one, "m", 1)
    errors: list[BaseException] = []

    def lease_many(service: CatalogService, reader: str) -> None:
        try:
            for i in range(40):
                service.acquire_lease("m", 1, f"{reader}-{i}", lease_id=f"{reader}-{i}")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=lease_many, args=(svc, name))
               for svc, name in ((one, "a"), (two, "b"), (one, "c"), (two, "d"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    assert one.list_versions("m")[0].leases == 160
    assert one.counts()["leases"] == two.counts()["leases"] == 160


def test_a_rejected_call_changes_nothing_in_redis(on_redis, redis_server) -> None:
    service = on_redis()
    publish_ready(service, "m", 1)
    keys = {k: redis_server.client.dump(k) for k in redis_server.client.keys("*")}
    with pytest.raises(InvalidArgument):
        service.register_source("m", 1, 3, tp_source(0, 2))  # expected_sources disagrees
    with pytest.raises(NotFound):
        service.release_lease("never-acquired")
    assert {k: redis_server.client.dump(k) for k in redis_server.client.keys("*")} == keys


def test_descriptors_are_stored_once_and_dropped_with_their_version(on_redis, redis_server) -> None:
    service = CatalogService(store=RedisStore(redis_server.url, namespace="blobs:"), history=0)
    publish_ready(service, "m", 1)
    blobs = redis_server.client.keys("blobs:blob:*")
    assert blobs  # the sources' descriptors live outside the control document
    for _ in range(3):
        service.heartbeat(source_ids=["tp0", "tp1"])
    assert sorted(redis_server.client.keys("blobs:blob:*")) == sorted(blobs)
    service.retire_version("m", 1)  # RETIRED and, with history=0, forgotten
    assert service.list_versions("m") == []
    assert redis_server.client.keys("blobs:blob:*") == []
    service.store.close()


def test_the_codec_round_trips_the_state_it_is_given(on_redis) -> None:
    service = on_redis()
    publish_ready(service, "m", 1, sidecar={"arch": "dense", "big": "x" * 5000})
    service.acquire_lease("m", 1, "reader")
    state = service.store.run(lambda txn: txn.state)
    codec = StateCodec("k:")
    document, blobs = codec.encode(state)
    again = StateCodec("k:").decode(document, blobs)
    assert StateCodec("k:").encode(again) == (document, blobs)
    assert again.leases == {} and again.models["m"][1].leases == {}  # leases live in their own keys
    life = again.sources["tp0"]
    assert ("m", 1) in life.versions and again.models["m"][1].sources["tp0"].source_id == "tp0"


@pytest.mark.parametrize("url, message", [
    ("", "must be 'memory' or"),
    ("memcached://h:1", "neither 'memory' nor a redis://"),
    ("redis://:6379/0", "names no host"),
    ("redis://h:x/0", "bad port"),
    ("redis://h:6379/zero", "database 'zero'"),
])
def test_a_bad_store_url_is_an_error_naming_the_field_and_value(url: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=f"--store: .*{message}"):
        check_store_url(url, "--store")


def test_serve_rejects_a_bad_store_url_with_exit_2(capsys) -> None:
    from mx_refit.cli import main

    assert main(["serve", "--port", "0", "--store", "redis://h:6379/zero"]) == 2
    assert "--store: 'redis://h:6379/zero' has database 'zero'" in capsys.readouterr().err


def test_open_store_builds_each_store_and_the_catalog_imports_redis_only_when_asked(redis_server) -> None:
    assert open_store("memory").url == "memory"
    store = open_store(redis_server.url, namespace="open:")
    assert isinstance(store, RedisStore)
    store.close()
    code = ("import sys, mx_refit, mx_refit.catalog.service, mx_refit.catalog.store, mx_refit.config; "
            "assert 'redis' not in sys.modules, 'redis imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_store_checks_the_redis_settings_it_relies_on(redis_server) -> None:
    store = RedisStore(redis_server.url, namespace=redis_server.namespace())
    try:
        warnings = store.check_settings()  # the test server keeps nothing across a restart
        assert any(w.startswith("appendonly 'no'") and "keeps nothing" in w for w in warnings), warnings
        redis_server.client.config_set("maxmemory-policy", "allkeys-lru")
        try:
            with pytest.raises(InvalidArgument, match=r"maxmemory-policy allkeys-lru.*noeviction"):
                store.check_settings()
        finally:
            redis_server.client.config_set("maxmemory-policy", "noeviction")
        redis_server.client.config_set("appendonly", "yes")
        try:
            assert not any("appendonly" in w for w in store.check_settings())
        finally:
            redis_server.client.config_set("appendonly", "no")
    finally:
        store.close()


def test_a_catalog_document_that_vanishes_starts_a_new_epoch(on_redis, redis_server) -> None:
    service = on_redis()
    publish_ready(service, "m", 1)
    before = service.answer_epoch()
    keys = [k for k in redis_server.client.keys("*") if k.endswith(b"doc")]
    redis_server.client.delete(*keys)  # as an eviction or a stray DEL would
    other = on_redis()  # another catalog process: nothing cached
    assert other.list_versions("m") == []
    assert other.answer_epoch() not in ("", before)
    service.list_versions("m")  # the first process notices the new lineage too
    assert service.answer_epoch() == other.answer_epoch()


def test_ended_leases_live_in_their_own_hash_bounded_and_shared(on_redis, redis_server, monkeypatch) -> None:
    from mx_refit.catalog.store import redis_store

    monkeypatch.setattr(redis_store, "ENDED_LEASES_KEPT", 3)
    one, two = on_redis(), on_redis()
    publish_ready(one, "m", 1)
    namespace = one.store._doc_key.removesuffix("doc")
    leases = [one.acquire_lease("m", 1, f"reader{i}") for i in range(5)]
    document = redis_server.client.get(f"{namespace}doc")
    for lease in leases:
        one.release_lease(lease)
    assert redis_server.client.get(f"{namespace}doc") == document  # a release writes no document
    assert sorted(k.decode() for k in redis_server.client.hkeys(f"{namespace}ended")) == sorted(leases[2:])
    two.release_lease(leases[4])  # the other catalog knows it ended: a retried release is a no-op
    with pytest.raises(NotFound, match="not known"):
        two.release_lease(leases[0])  # the oldest, dropped past the bound, in both catalogs
    with pytest.raises(NotFound, match="not known"):
        one.release_lease(leases[0])
    one.release_lease(one.acquire_lease("m", 1, "reader5"))  # the next ends drop the oldest kept
    assert len(redis_server.client.hkeys(f"{namespace}ended")) == 3
    assert leases[2].encode() not in redis_server.client.hkeys(f"{namespace}ended")
