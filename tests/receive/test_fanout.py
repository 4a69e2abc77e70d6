"""Replica sources and tree fan-out (``weight_sync.fanout: tree``).

Catalog rules on the embedded service and over gRPC; end to end with a TP2 Megatron trainer and
receivers in separate processes over real NIXL (UCX loopback) and the real gRPC catalog.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from mx_refit.catalog.client import CatalogClient
from mx_refit.catalog.service import CatalogService
from mx_refit.errors import FailedPrecondition, InvalidArgument, SourcesBusy
from mx_refit.receive.fanout import Copies, choose_sources, holders, replica_mirrors, replica_tensor_ranges, translate
from mx_refit.receive.receiver import Receiver
from mx_refit.types import (
    MeshPosition,
    Mirror,
    SourceInfo,
    TargetLayout,
    TensorDescriptor,
    VersionInfo,
    VersionState,
)
from tests import _fanout_procs

pytestmark = pytest.mark.timeout(240)


# ------------------------------------------------------------------ pure range translation


def test_translate_splits_across_mirrors_and_refuses_unmirrored_bytes():
    mirrors = [Mirror("t0", 1000, 100, 50_000), Mirror("t0", 1100, 50, 90_000), Mirror("t1", 1000, 999, 7)]
    assert translate([(1010, 0, 20)], mirrors, "t0") == [(50_010, 0, 20)]
    # one read crossing two mirrors becomes two reads, landing where the original would
    assert translate([(1090, 5, 30)], mirrors, "t0") == [(50_090, 5, 10), (90_000, 15, 20)]
    assert translate([(1140, 0, 20)], mirrors, "t0") is None  # 1150.. is not mirrored
    assert translate([(990, 0, 20)], mirrors, "t0") is None
    assert translate([(1000, 0, 1)], mirrors, "t2") is None
    # a replicated tensor's bytes may come from the mirror of another rank's identical copy
    norm = TensorDescriptor("norm", "float32", (4,), (4,), 1200, 16)
    info = VersionInfo("m", 1, VersionState.READY, 2, (
        SourceInfo("t0", MeshPosition(tp_size=2), "a0", b"", (norm,), ready=True),
        SourceInfo("t1", MeshPosition(tp_rank=1, tp_size=2), "a1", b"", (replace(norm, addr=5000),), ready=True),
    ))
    only_t1 = [Mirror("t1", 5000, 16, 300)]
    assert translate([(1204, 3, 8)], only_t1, "t0") is None
    assert translate([(1204, 3, 8)], only_t1, "t0", Copies(info)) == [(304, 3, 8)]
    assert translate([(1196, 0, 12)], only_t1, "t0", Copies(info)) is None  # 1196..1200 has no copy
    merged = replica_mirrors({"t0": [(2000, 0, 10), (2010, 10, 6), (4000, 16, 4)]}, 100)
    assert merged == (Mirror("t0", 2000, 16, 100), Mirror("t0", 4000, 4, 116))


# ------------------------------------------------------------------ the catalog's rules


def _trainer(sid: str, base: int, tp: int) -> SourceInfo:
    desc = TensorDescriptor("w", "float32", (8, 4), (4, 4), base, 64, shard_axis=0, shard_offset=4 * tp)
    return SourceInfo(sid, MeshPosition(tp_rank=tp, tp_size=2), f"agent-{sid}", b"", (desc,), ready=True,
                      regions=((base, 64),))


def _replica(sid: str, mirrors, ready: bool = True) -> SourceInfo:
    arena = TensorDescriptor("mx_refit.receive_arena", "uint8", (256,), (256,), 0x9000, 256)
    return SourceInfo(sid, MeshPosition(), f"agent-{sid}", b"", (arena,), ready=ready, regions=((0x9000, 256),),
                      mirrors=tuple(mirrors))


def _version(catalog, model: str) -> None:
    for tp, base in ((0, 0x1000), (1, 0x2000)):
        catalog.register_source(model, 1, 2, _trainer(f"t{tp}", base, tp))


@pytest.fixture(params=["embedded", "embedded-redis", "grpc"])
def catalog(request, mx_catalog):
    if request.param == "embedded":
        yield CatalogService()
    elif request.param == "embedded-redis":  # the catalog's Redis store keeps replicas and leases too
        from mx_refit.catalog.store.redis_store import RedisStore

        redis = request.getfixturevalue("redis_server")
        service = CatalogService(store=RedisStore(redis.url, namespace=redis.namespace()))
        yield service
        service.store.close()
    else:
        with CatalogClient(mx_catalog) as client:
            yield client


def test_replica_offered_only_once_ready_and_leases_honour_the_cap(catalog, mx_model_name):
    m = mx_model_name
    _version(catalog, m)
    full = [Mirror("t0", 0x1000, 64, 0x9000), Mirror("t1", 0x2000, 64, 0x9040)]
    # A replica promises no lease fence (its arena is rewritten once the catalog says its
    # readers left), whatever it sends: its readers always wait for the release's answer.
    catalog.register_replica(m, 1, replace(_replica("r1", full, ready=False), lease_fence_s=60.0))
    info = catalog.get_version(m, 1)
    assert info.replicas == ()  # incomplete: never offered
    with pytest.raises(SourcesBusy, match="r1 are not offered"):
        catalog.acquire_lease(m, 1, "early", sources=["r1"])
    catalog.mark_ready(m, 1, "r1")
    info = catalog.get_version(m, 1)
    assert [r.source_id for r in info.replicas] == ["r1"] and info.replicas[0].mirrors == tuple(full)
    assert info.replicas[0].lease_fence_s == 0.0
    assert replica_tensor_ranges(info, info.replicas[0]) == {"t0": {"w": [(0, 64)]}, "t1": {"w": [(0, 64)]}}

    # cap 1: a lease naming no source reads every trainer source
    legacy = catalog.acquire_lease(m, 1, "legacy")
    assert catalog.get_version(m, 1).readers == {"t0": 1, "t1": 1}
    with pytest.raises(SourcesBusy, match="t0 \\(1 readers\\)"):
        catalog.acquire_lease(m, 1, "second", sources=["t0"], max_readers_per_source=1)
    on_replica = catalog.acquire_lease(m, 1, "second", sources=["r1"], max_readers_per_source=1)
    with pytest.raises(SourcesBusy, match="r1 \\(1 readers\\)"):
        catalog.acquire_lease(m, 1, "third", sources=["r1"], max_readers_per_source=1)
    assert catalog.get_version(m, 1).readers == {"t0": 1, "t1": 1, "r1": 1}
    catalog.acquire_lease(m, 1, "uncapped", sources=["r1"])  # cap 0: not enforced
    # the receiver's choice: every holder at the cap -> wait (None), one freed -> that one
    info = catalog.get_version(m, 1)
    reads = {"t0": [(0x1000, 0, 64)], "t1": [(0x2000, 64, 64)]}
    assert choose_sources(info, reads, reader_id="x", max_readers=1) is None
    catalog.release_lease(legacy)
    choice = choose_sources(catalog.get_version(m, 1), reads, reader_id="x", max_readers=1)
    assert choice.via == {"t0": "t0", "t1": "t1"}
    assert [s.source_id for s, _ in holders(info, "t1", reads["t1"], exclude={"t1"})] == ["r1"]
    assert holders(info, "t1", reads["t1"], exclude={"t1"})[0][1] == [(0x9040, 64, 64)]
    catalog.release_lease(on_replica)


def test_replica_registrations_are_validated(catalog, mx_model_name):
    m = mx_model_name
    _version(catalog, m)
    with pytest.raises(InvalidArgument, match=r"mirrors\[0\]: bytes 0x1030\+32 lie outside the registered regions of source"):
        catalog.register_replica(m, 1, _replica("r", [Mirror("t0", 0x1030, 32, 0x9000)]))
    with pytest.raises(InvalidArgument, match=r"mirrors\[0\].source_id: 'nope' is not a trainer source"):
        catalog.register_replica(m, 1, _replica("r", [Mirror("nope", 0x1000, 4, 0x9000)]))
    with pytest.raises(InvalidArgument, match=r"mirrors\[0\].addr: bytes 0x90f0\+64 lie outside the replica's own regions"):
        catalog.register_replica(m, 1, _replica("r", [Mirror("t0", 0x1000, 64, 0x90F0)]))
    with pytest.raises(InvalidArgument, match="needs a non-empty sequence of mirrors"):
        catalog.register_replica(m, 1, _replica("r", []))
    with pytest.raises(InvalidArgument, match="'t1' is a trainer source"):
        catalog.register_replica(m, 1, _replica("t1", [Mirror("t0", 0x1000, 4, 0x9000)]))
    assert catalog.get_version(m, 1).replicas == ()  # nothing half-registered
    catalog.retire_version(m, 1)
    with pytest.raises(FailedPrecondition, match="DRAINING; only READY versions take replicas|RETIRED; only READY"):
        catalog.register_replica(m, 1, _replica("r", [Mirror("t0", 0x1000, 4, 0x9000)]))


def test_withdrawal_waits_for_replica_readers_but_the_trainer_drain_does_not(catalog, mx_model_name):
    m = mx_model_name
    _version(catalog, m)
    catalog.register_replica(m, 1, _replica("r1", [Mirror("t0", 0x1000, 64, 0x9000)]))
    on_replica = catalog.acquire_lease(m, 1, "reader", sources=["r1"])
    on_trainer = catalog.acquire_lease(m, 1, "reader2", sources=["t1"])
    assert catalog.withdraw_replica(m, 1, "r1", 0.2) is False  # still read
    assert catalog.get_version(m, 1).replicas == ()  # but no longer offered
    with pytest.raises(SourcesBusy):
        catalog.acquire_lease(m, 1, "late", sources=["r1"])
    catalog.retire_version(m, 1)
    assert catalog.wait_drained(m, 1, 0.2) is False  # a trainer source is still read
    catalog.release_lease(on_trainer)
    assert catalog.wait_drained(m, 1, 5) is True  # the replica's reader does not hold the trainer
    assert catalog.withdraw_replica(m, 1, "r1", 0.2) is False
    done = []
    waiter = threading.Thread(target=lambda: done.append(catalog.withdraw_replica(m, 1, "r1", 30)))
    waiter.start()
    catalog.release_lease(on_replica)
    waiter.join(60)
    assert done == [True]
    assert catalog.withdraw_replica(m, 1, "r1", 0) is True  # again: a no-op


def test_a_dead_replica_is_dropped_and_the_version_lives_on():
    clock = [0.0]
    service = CatalogService(clock=lambda: clock[0])
    _version(service, "m")  # the trainer's sources live 30 s
    service.register_replica("m", 1, _replica("r1", [Mirror("t0", 0x1000, 64, 0x9000)]), ttl_s=5)
    clock[0] = 10.0
    report = service.reap()
    assert report.sources == ("r1",) and report.versions == ()
    info = service.get_version("m", 1)
    assert info.state is VersionState.READY and info.replicas == ()


# ------------------------------------------------------------------ end to end, real processes


@pytest.fixture(scope="module")
def cluster(mx_catalog):
    procs = _fanout_procs.Procs()
    model = "fanout-e2e"
    try:
        procs.start(_fanout_procs.trainer, mx_catalog, model, 2)
        procs.expect(0, "ready")
        procs.start(_fanout_procs.receiver, mx_catalog, model, {"fanout": "tree"}, TargetLayout())  # full
        procs.start(_fanout_procs.receiver, mx_catalog, model, {"fanout": "none"}, TargetLayout())
        procs.expect(1, "ready")
        procs.expect(2, "ready")
        yield procs, mx_catalog, model
    finally:
        procs.close()


def test_tree_fanout_end_to_end(cluster):
    procs, address, model = cluster
    sliced = TargetLayout(tp_rank=1, tp_size=2, full_tensors=False)  # not the replica's layout
    client = CatalogClient(address)
    procs.send(0, "publish", (1, 11))
    assert procs.expect(0, "published")[-1] == "READY"

    # fanout none: byte-for-byte today's behaviour (reads the trainer, offers nothing)
    procs.send(2, "refit", (1, False))
    assert procs.expect(2, "refitted")[:2] == (1, 0)
    assert client.get_version(model, 1).replicas == ()

    # the replica: full tensors, from the trainer; offered once its pull completed
    procs.send(1, "refit", (1, True))
    version, replicas_read, *_, tensors = procs.expect(1, "refitted")
    assert (version, replicas_read) == (1, 0)
    want = _fanout_procs.expected(11, 2, TargetLayout())
    assert set(tensors) == set(want) and all(torch.equal(tensors[n], want[n]) for n in want)
    info = client.get_version(model, 1)
    (replica,) = info.replicas
    assert replica.ready and {m.source_id for m in replica.mirrors} == {s.source_id for s in info.sources}
    held = replica_tensor_ranges(info, replica)
    # the catalog's record of which published tensors' bytes it holds: exactly its mirrors
    names = {s.source_id: {d.name for d in s.tensors} for s in info.sources}
    assert all(set(held[sid]) <= names[sid] for sid in held) and len(held) == 2
    in_tensors = sum(end - start for per in held.values() for ranges in per.values() for start, end in ranges)
    assert in_tensors == sum(m.nbytes for m in replica.mirrors) >= sum(w.numel() * w.element_size() for w in want.values())

    # a reader of another layout (TP2 rank 1 slices), capped at 1 reader per source while the
    # trainer ranks are busy: it reads the replica, byte-identical to the trainer's
    # (long TTLs: a loaded box may take a while to import the planner)
    busy = client.acquire_lease(model, 1, "busy", sources=[s.source_id for s in info.sources], ttl_s=900)
    with Receiver(address, model, target=sliced, fanout="tree", max_readers_per_source=1) as reader:
        result = reader.refit(1)
        assert result.stats.replicas_read == 1 and result.stats.sources == 1
        want = _fanout_procs.expected(11, 2, sliced)
        got = dict(result.tensors)
        assert set(got) == set(want)
        for name, tensor in want.items():
            assert torch.equal(got[name].contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
        assert reader.replica.version == 1  # and it serves the next readers in turn
        # a lease on the replica holds the replica's next refit, not the trainer's drain
        on_replica = client.acquire_lease(model, 1, "slow", sources=[replica.source_id], ttl_s=900)
        client.release_lease(busy)
        procs.send(0, "drain", (1, 60))
        assert isinstance(procs.expect(0, "drained"), float)  # drained despite the replica's reader
        procs.send(0, "publish", (2, 22))
        assert procs.expect(0, "published")[-1] == "READY"
        procs.send(1, "refit", (2, True))
        assert not procs.conns[1].poll(1.5)  # waits for its reader before overwriting its arena
        client.release_lease(on_replica)
        version, replicas_read, *_, tensors = procs.expect(1, "refitted")
        want = _fanout_procs.expected(22, 2, TargetLayout())
        assert version == 2 and all(torch.equal(tensors[n], want[n]) for n in want)
    client.close()


def test_readme_fanout_example_runs_as_written(capsys):
    from tests.test_readme import readme_python

    code = readme_python("Fan-out: replica sources")
    exec(compile(code, "README.md: Fan-out", "exec"), {})  # noqa: S102
    assert capsys.readouterr().out.split() == ["0", "1", "True"]


def test_a_reader_at_the_cap_waits_for_a_replica_rather_than_queueing(mx_catalog, mx_model_name):
    from mx_refit import Publisher

    weights = {"w": torch.arange(4096.0), "b": torch.ones(64)}
    with Publisher(mx_catalog, mx_model_name) as trainer, \
            Receiver(mx_catalog, mx_model_name, fanout="tree", max_readers_per_source=1) as first, \
            Receiver(mx_catalog, mx_model_name, fanout="tree", max_readers_per_source=1) as second:
        trainer.publish(1, model=weights)
        hold = trainer.client.acquire_lease(mx_model_name, 1, "hold", sources=[trainer.source_id], ttl_s=600)
        results: dict[str, object] = {}

        def refit(name: str, rec: Receiver) -> None:
            try:
                results[name] = rec.refit(1)
            except Exception as exc:  # reported below
                results[name] = exc

        waiting = threading.Thread(target=refit, args=("second", second))
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive() and not results  # every holder (the trainer) is at its cap
        trainer.client.release_lease(hold)
        refit("first", first)  # takes the trainer's one slot, then offers a replica
        waiting.join(60)
        got = [results["first"], results["second"]]
        assert all(not isinstance(r, Exception) for r in got), got
        assert sorted(r.stats.replicas_read for r in got) in ([0, 0], [0, 1])  # who won the slot is a race
        for r in got:
            assert all(torch.equal(t, weights[n]) for n, t in r.tensors)
        deadline = time.monotonic() + 10  # a release confirmed by its lease's deadline follows the refit
        while (readers := trainer.client.get_version(mx_model_name, 1).readers) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert readers == {}  # every lease released
