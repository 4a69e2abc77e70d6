"""The Redis store's change log (``mx_refit.catalog.store.redis_log``): a catalog process that finds
another one's commits reads only what they changed, and its state then equals a full reload's;
anything the log cannot vouch for (a rollback, a trimmed log, a commit too large to list) is a
full reload. Real ``redis-server``; two stores on one namespace stand for two catalog processes."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from catalog_factories import FakeClock, publish_ready
from redis_server import RedisServer

from mx_refit.catalog import CatalogService
from mx_refit.catalog.store import redis_log, redis_store
from mx_refit.catalog.store.base import CatalogState
from mx_refit.catalog.store.codec import StateCodec
from mx_refit.catalog.store.redis_store import RedisStore
from mx_refit.types import VersionState


def view(state: CatalogState) -> dict[str, Any]:
    """Everything a store keeps of ``state``, and the links a load rebuilds, checked."""
    leases = {}
    for lease_id, lease in state.leases.items():
        rec = lease.record
        assert rec is not None and rec is state.models[rec.model][rec.version], lease_id
        assert rec.leases[lease_id] is lease and not lease.dead, lease_id
        leases[lease_id] = (rec.model, rec.version, lease.reader_id, lease.ttl_s, lease.expires_at, lease.sources)
    heap = {(id(timed), at) for at, _, timed in state.deadlines._heap}
    for timed in (*state.leases.values(), *state.sources.values()):  # each one's deadline is in the heap
        assert (id(timed), timed.heap_at) in heap and timed.heap_at <= timed.expires_at, timed
    ended = state.ended_leases.ended
    ats = [entry[1] for entry in ended.values()]
    assert ats == sorted(ats), "ended leases out of order"
    return {
        "document": json.loads(StateCodec(blob_prefix="view:").encode(state)[0]),
        "leases": leases,
        "by version": {(m, v): sorted(rec.leases) for m, vs in state.models.items() for v, rec in vs.items()},
        "ended": dict(ended),
        "ended kept": state.ended_leases.keep,
    }


class Rig:
    """Catalog processes (stores) on one Redis namespace, and a fresh one's full load to compare."""

    def __init__(self, url: str, namespace: str, clock: Callable[[], float] | None) -> None:
        self.url, self.namespace, self.clock = url, namespace, clock
        self.made: list[CatalogService] = []

    def catalog(self) -> CatalogService:
        self.made.append(CatalogService(store=RedisStore(self.url, clock=self.clock, namespace=self.namespace)))
        return self.made[-1]

    def full_view(self) -> dict[str, Any]:
        fresh = RedisStore(self.url, clock=self.clock, namespace=self.namespace)
        try:
            return fresh.run(lambda txn: view(txn.state))
        finally:
            fresh.close()

    def generation(self) -> bytes:
        import redis

        with redis.Redis.from_url(self.url) as client:
            return client.get(f"{self.namespace}gen") or b""

    def close(self) -> None:
        for service in self.made:
            service.store.close()


def cached_view(catalog: CatalogService) -> dict[str, Any]:
    return catalog.store.run(lambda txn: view(txn.state))


def reloads(catalog: CatalogService) -> dict[str, int]:
    store = catalog.store
    assert isinstance(store, RedisStore)
    return dict(store.reloads)


@pytest.fixture
def rig(redis_server, monkeypatch) -> Iterator[Rig]:
    monkeypatch.setattr(redis_store, "ENDED_LEASES_KEPT", 3)  # drops of the oldest ended lease, too
    redis_server.flush()
    made = Rig(redis_server.url, redis_server.namespace(), FakeClock())
    yield made
    made.close()


def test_an_incremental_catch_up_equals_a_full_reload_after_every_kind_of_commit(rig) -> None:
    one, two = rig.catalog(), rig.catalog()
    clock = rig.clock
    publish_ready(one, "m", 1)
    two.list_versions("m")  # each has loaded the state once
    leases: dict[str, str] = {}

    def lease(name: str, version: int = 1, ttl: float = 60.0, **kwargs: Any) -> Callable[[CatalogService], Any]:
        return lambda c: leases.__setitem__(name, c.acquire_lease("m", version, f"reader-{name}", ttl_s=ttl, **kwargs))

    def ready_in(*catalogs: CatalogService) -> None:
        for catalog in catalogs:  # a reaper that followed a stale deadline would expire version 2
            assert {s.version: s.state for s in catalog.list_versions("m")}.get(2) is VersionState.READY

    steps: list[tuple[str, Callable[[CatalogService], Any]]] = [
        ("lease a", lease("a")),
        ("lease b", lease("b", ttl=10)),
        ("renew a", lambda c: c.heartbeat(lease_ids=[leases["a"]])),
        ("renew a shorter", lambda c: c.acquire_lease("m", 1, "reader-a", ttl_s=5, lease_id=leases["a"])),
        ("release b", lambda c: c.release_lease(leases["b"])),
        ("publish 2", lambda c: publish_ready(c, "m", 2)),
        ("lease c on 2 from tp0", lease("c", version=2, sources=("tp0",))),
        ("retire 1", lambda c: c.retire_version("m", 1)),
        ("a expires, 1 retires", lambda c: (clock.advance(6), c.list_versions("m"))),
        ("sources beat", lambda c: c.heartbeat(source_ids=["tp0", "tp1"])),
        ("past the sources' old deadline: both reapers keep them", lambda c: (clock.advance(26), ready_in(one, two))),
        ("release c, completed", lambda c: c.release_lease(leases["c"], completed=True)),
        ("leases d, e", lambda c: [lease(n, version=2, ttl=20)(c) for n in "de"]),
        ("releases d, e: the oldest ended dropped", lambda c: [c.release_lease(leases[n]) for n in "de"]),
        ("lease f", lease("f", version=2, ttl=20)),
        ("publish 3 (a version in its own key set)", lambda c: publish_ready(c, "n", 1)),
        ("sources of m and f expire", lambda c: (clock.advance(10), c.list_versions("m"))),
    ]
    committed = 0
    for i, (name, step) in enumerate(steps):
        actor, other = (one, two) if i % 2 == 0 else (two, one)
        before = rig.generation()
        step(actor)
        committed += rig.generation() != before
        assert cached_view(other) == rig.full_view(), name
        assert cached_view(actor) == rig.full_view(), name
    assert committed >= len(steps) - 2
    for catalog in (one, two):  # every catch-up read only the changes
        assert reloads(catalog)["full"] == 1, reloads(catalog)
    assert reloads(one)["incremental"] + reloads(two)["incremental"] >= committed


def test_a_process_far_behind_reads_the_whole_log_and_one_past_it_reloads_in_full(rig, monkeypatch) -> None:
    monkeypatch.setattr(redis_log, "LOG_TAIL", 2)
    monkeypatch.setattr(redis_log, "LOG_KEPT", 5)
    one, two = rig.catalog(), rig.catalog()
    publish_ready(one, "m", 1)
    two.list_versions("m")
    before = reloads(two)
    for i in range(4):  # four commits: past the tail of two entries, within the five kept
        one.acquire_lease("m", 1, f"r{i}")
    assert cached_view(two) == rig.full_view()
    assert reloads(two) == {"full": before["full"], "incremental": before["incremental"] + 1}
    for i in range(6):  # six commits: two's token was trimmed from the log
        one.acquire_lease("m", 1, f"s{i}")
    assert cached_view(two) == rig.full_view()
    assert reloads(two)["full"] == before["full"] + 1


def test_a_commit_too_large_to_list_makes_the_others_reload_in_full(rig, monkeypatch) -> None:
    monkeypatch.setattr(redis_log, "LOG_ENTRY_MAX_CHARS", 400)  # a lease's field: ~150 characters
    one, two = rig.catalog(), rig.catalog()
    publish_ready(one, "m", 1)
    for i in range(5):
        one.acquire_lease("m", 1, f"r{i}", ttl_s=5)
    two.list_versions("m")
    before = reloads(two)
    rig.clock.advance(6)
    one.list_versions("m")  # the reaper ends five leases in one commit: too many to list
    assert cached_view(two) == rig.full_view()
    assert cached_view(two)["leases"] == {}
    assert reloads(two)["full"] == before["full"] + 1


def test_an_unreadable_log_entry_on_the_way_makes_a_full_reload_not_an_error(rig, redis_server) -> None:
    one, two = rig.catalog(), rig.catalog()
    publish_ready(one, "m", 1)
    two.list_versions("m")
    before = reloads(two)
    one.acquire_lease("m", 1, "a")
    redis_server.client.rpush(f"{rig.namespace}log", b"\xff not json", b'["x"]')  # a stray write
    one.acquire_lease("m", 1, "b")
    assert cached_view(two) == rig.full_view()
    assert reloads(two)["full"] == before["full"] + 1
    one.acquire_lease("m", 1, "c")  # past it, the log serves again
    assert cached_view(two) == rig.full_view()
    assert reloads(two) == {"full": before["full"] + 1, "incremental": before["incremental"] + 1}


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of its own, restarted from its last snapshot (the session's one never restarts)."""
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def test_a_rollback_after_a_logged_commit_is_a_full_reload_never_nothing_changed(restartable) -> None:
    rig = Rig(restartable.url, "rollback:", None)
    one, two, three = rig.catalog(), rig.catalog(), rig.catalog()
    try:
        publish_ready(one, "m", 1)
        for catalog in (two, three):
            catalog.list_versions("m")
        restartable.snapshot()  # all three are cached at the snapshot's token
        lost = one.acquire_lease("m", 1, "lost")  # a logged commit the rollback loses
        assert lost in cached_view(two)["leases"]  # two caught up with it through the log
        epoch = two.answer_epoch()
        restartable.restart()
        before = {name: reloads(c) for name, c in (("one", one), ("two", two), ("three", three))}
        kept = one.acquire_lease("m", 1, "kept")  # one: cached at the lost token, so a full reload first
        full = rig.full_view()
        assert lost not in full["leases"] and kept in full["leases"]
        assert cached_view(two) == full  # two: cached at the lost token too: never "nothing changed"
        assert reloads(one)["full"] == before["one"]["full"] + 1
        assert reloads(two)["full"] == before["two"]["full"] + 1
        # three never saw the lost commit: the restored log leads from its token to now, and
        # reading just those changes gives the same state
        assert cached_view(three) == full
        assert reloads(three) == {"full": before["three"]["full"], "incremental": before["three"]["incremental"] + 1}
        two.list_versions("m")
        assert two.answer_epoch() not in ("", epoch)  # and the restart began a new epoch
    finally:
        rig.close()


def test_a_rollback_to_the_cached_token_itself_changes_the_epoch(restartable) -> None:
    rig = Rig(restartable.url, "same:", None)
    one, two = rig.catalog(), rig.catalog()
    try:
        publish_ready(one, "m", 1)
        lease = two.acquire_lease("m", 1, "reader")
        one.list_versions("m")
        epoch = one.answer_epoch()
        restartable.snapshot()
        restartable.restart()  # back to the very state both cached: nothing to reload
        before = reloads(one)
        assert one.list_versions("m")[0].version == 1
        assert reloads(one) == before
        assert one.answer_epoch() not in ("", epoch)  # but the epoch still says it restarted
        assert lease in cached_view(one)["leases"]
    finally:
        rig.close()
