"""CatalogService state machine: lifecycle, sidecars, leases, TTLs, drain, history."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from catalog_factories import FakeClock, desc, publish_ready, source, tp_source

from mx_refit.catalog import Catalog, CatalogService, VersionSummary
from mx_refit.errors import FailedPrecondition, InvalidArgument, NotFound
from mx_refit.types import MeshPosition, VersionState

PENDING, READY, DRAINING, RETIRED, EXPIRED = (
    VersionState.PENDING,
    VersionState.READY,
    VersionState.DRAINING,
    VersionState.RETIRED,
    VersionState.EXPIRED,
)


def test_service_satisfies_the_catalog_protocol(service: CatalogService) -> None:
    assert isinstance(service, Catalog)


# --- lifecycle -------------------------------------------------------------------------------


def test_version_becomes_ready_once_every_expected_source_is_ready(service: CatalogService) -> None:
    assert service.register_source("m", 1, 2, tp_source(0, 2)) is PENDING
    assert service.mark_ready("m", 1, "tp0") is PENDING  # one of two registered
    assert service.register_source("m", 1, 2, tp_source(1, 2)) is PENDING
    assert service.list_versions("m") == [VersionSummary("m", 1, PENDING, 2, 2, 1, 0)]
    assert service.mark_ready("m", 1, "tp1") is READY
    assert service.mark_ready("m", 1, "tp1") is READY  # idempotent

    info = service.get_version("m")
    assert (info.model, info.version, info.state, info.expected_sources) == ("m", 1, READY, 2)
    assert [s.source_id for s in info.sources] == ["tp0", "tp1"]
    assert all(s.ready for s in info.sources)
    assert info.sources[1].tensors == tp_source(1, 2).tensors


def test_register_with_ready_true_registers_and_marks_in_one_step(service: CatalogService) -> None:
    assert service.register_source("m", 1, 1, source(ready=True)) is READY


def test_sources_are_ordered_by_mesh_position_not_arrival(service: CatalogService) -> None:
    for rank in (3, 1, 0, 2):
        service.register_source("m", 1, 4, tp_source(rank, 4, ready=True))
    assert [s.mesh.tp_rank for s in service.get_version("m").sources] == [0, 1, 2, 3]


def test_get_version_newest_ready_min_version_and_exact(service: CatalogService) -> None:
    publish_ready(service, "m", 1)
    publish_ready(service, "m", 3)
    service.register_source("m", 5, 2, tp_source(0, 2))  # PENDING: never offered as newest
    assert service.get_version("m").version == 3
    assert service.get_version("m", min_version=2).version == 3
    assert service.get_version("m", 1).version == 1
    with pytest.raises(NotFound, match=r"no READY version >= 4 .*5 PENDING"):
        service.get_version("m", min_version=4)
    with pytest.raises(FailedPrecondition, match="version 5 is PENDING, not READY"):
        service.get_version("m", 5)
    with pytest.raises(NotFound, match="has no version 2"):
        service.get_version("m", 2)
    with pytest.raises(NotFound, match="unknown model 'other'"):
        service.get_version("other")
    with pytest.raises(InvalidArgument, match="version: 1 is below min_version 2"):
        service.get_version("m", 1, min_version=2)


def test_list_versions_of_an_unknown_model_is_empty(service: CatalogService) -> None:
    assert service.list_versions("never-published") == []


def test_returned_sidecar_is_a_private_copy(service: CatalogService) -> None:
    publish_ready(service, "m", 1, sidecar={"hf_name_map": {"a": "b"}})
    service.get_version("m").sidecar["hf_name_map"]["a"] = "mutated"
    assert service.get_version("m").sidecar == {"hf_name_map": {"a": "b"}}


def test_callers_later_mutations_do_not_reach_the_catalog(service: CatalogService) -> None:
    extras = {"groups": [1, 2]}
    sidecar = {"k": {"x": 1}}
    service.register_source("m", 1, 1, source(tensors=(desc(extras=extras),), ready=True), sidecar)
    extras["groups"].append(3)
    sidecar["k"]["x"] = 2
    info = service.get_version("m")
    assert info.sources[0].tensors[0].extras == {"groups": [1, 2]}
    assert info.sidecar == {"k": {"x": 1}}


def test_enum_values_given_as_strings_are_normalised(service: CatalogService) -> None:
    service.register_source(
        "m", 1, 1, source(tensors=(desc(role="column", mem_type="VRAM"),), ready=True)
    )
    stored = service.get_version("m").sources[0].tensors[0]
    assert stored.role.name == "COLUMN" and stored.mem_type.name == "VRAM"


# --- re-registration -------------------------------------------------------------------------


def test_restarted_source_replaces_itself_while_pending(service: CatalogService) -> None:
    service.register_source("m", 1, 2, tp_source(0, 2, ready=True), {"old_key": 1})
    restarted = source("tp0", tp_rank=0, tp_size=2, tensors=(desc(addr=0xBEEF),), metadata=b"new")
    assert service.register_source("m", 1, 2, restarted, {"new_key": 2}) is PENDING
    info = service.inspect_version("m", 1)
    (only,) = info.sources
    assert only.agent_metadata == b"new" and only.tensors[0].addr == 0xBEEF
    assert not only.ready  # the new incarnation must mark itself ready again
    assert info.sidecar == {"new_key": 2}  # the old incarnation's sidecar is gone


def test_replacement_is_checked_against_the_other_sources_only(service: CatalogService) -> None:
    # tp0 first registers "w" as float32; as the only holder it may change that on restart.
    service.register_source("m", 1, 2, source("tp0", tp_rank=0, tp_size=2))
    service.register_source(
        "m", 1, 2, source("tp0", tp_rank=0, tp_size=2, tensors=(desc(dtype="bfloat16"),))
    )
    service.register_source(
        "m", 1, 2, source("tp1", tp_rank=1, tp_size=2, tensors=(desc(dtype="bfloat16"),))
    )
    assert service.list_versions("m")[0].registered_sources == 2


def test_identical_registration_is_a_retry_safe_noop(service: CatalogService) -> None:
    publish_ready(service, "m", 1)
    before = service.get_version("m", 1)
    assert service.register_source("m", 1, 2, tp_source(1, 2), None) is READY
    assert service.get_version("m", 1) == before


def test_changed_registration_after_ready_is_refused(service: CatalogService) -> None:
    publish_ready(service, "m", 1)
    changed = source("tp1", tp_rank=1, tp_size=2, tensors=(desc(addr=0x5),))
    with pytest.raises(FailedPrecondition, match="is READY; source 'tp1' cannot be replaced"):
        service.register_source("m", 1, 2, changed)
    with pytest.raises(FailedPrecondition, match="is READY; source 'new' cannot be added"):
        service.register_source("m", 1, 2, source("new", tp_rank=0, tp_size=3))


# --- sidecar merge ---------------------------------------------------------------------------


def test_sidecars_merge_keywise_and_union_nested_maps(service: CatalogService) -> None:
    for rank in range(2):
        sidecar = {
            "arch": "moe",
            "num_layers": 4,
            "hf_name_map": {f"expert.{rank}": f"mlp.experts.{rank}"},
            "nested": {"deep": {f"r{rank}": [rank, rank + 0.5]}},
        }
        service.register_source(
            "m", 1, 2, source(f"ep{rank}", ep_rank=rank, ep_size=2, ready=True), sidecar
        )
    assert service.get_version("m").sidecar == {
        "arch": "moe",
        "num_layers": 4,
        "hf_name_map": {"expert.0": "mlp.experts.0", "expert.1": "mlp.experts.1"},
        "nested": {"deep": {"r0": [0, 0.5], "r1": [1, 1.5]}},
    }


@pytest.mark.parametrize(
    ("first", "second", "fragment"),
    [
        ({"n": 4}, {"n": 5}, "sidecar[\"n\"]: 5 from source 'ep1' conflicts with 4"),
        ({"n": 1}, {"n": 1.0}, 'sidecar["n"]: 1.0'),  # type-strict: 1 and 1.0 differ
        ({"n": True}, {"n": 1}, 'sidecar["n"]: 1'),
        ({"m": {"a.b": "x"}}, {"m": {"a.b": "y"}}, 'sidecar["m"]["a.b"]: "y"'),
        ({"m": {"a": 1}}, {"m": [1]}, 'sidecar["m"]: [1]'),
        ({"l": [1, 2]}, {"l": [1, 3]}, 'sidecar["l"]: [1,3]'),
    ],
)
def test_conflicting_sidecar_values_are_rejected(
    service: CatalogService, first: dict, second: dict, fragment: str
) -> None:
    service.register_source("m", 1, 2, source("ep0", ep_rank=0, ep_size=2), first)
    with pytest.raises(InvalidArgument) as err:
        service.register_source("m", 1, 2, source("ep1", ep_rank=1, ep_size=2), second)
    assert fragment in str(err.value)
    assert service.list_versions("m")[0].registered_sources == 1


# --- leases and drain ------------------------------------------------------------------------


def test_lease_lifecycle(service: CatalogService) -> None:
    publish_ready(service, "m", 1)
    lease = service.acquire_lease("m", 1, "reader-0", ttl_s=10)
    assert service.list_versions("m")[0].leases == 1
    service.heartbeat(lease_ids=[lease])
    service.release_lease(lease)
    assert service.list_versions("m")[0].leases == 0
    service.release_lease(lease)  # a retry after a lost reply: a no-op, not an ambiguous NotFound
    with pytest.raises(NotFound, match="unknown or expired lease 'ghost'.*not known to this catalog"):
        service.release_lease("ghost")


def test_an_expired_lease_says_its_ttl_ran_out(service: CatalogService, clock: FakeClock) -> None:
    publish_ready(service, "m", 1)
    lease = service.acquire_lease("m", 1, "reader-0", ttl_s=2)
    clock.advance(3)
    with pytest.raises(NotFound, match="TTL of 2 s ran out"):
        service.heartbeat(lease_ids=[lease])
    with pytest.raises(NotFound, match="TTL of 2 s ran out"):
        service.release_lease(lease)


def test_lease_with_a_chosen_id_is_idempotent(service: CatalogService) -> None:
    publish_ready(service, "m", 1)
    assert service.acquire_lease("m", 1, "r", lease_id="L1") == "L1"
    assert service.acquire_lease("m", 1, "r", lease_id="L1") == "L1"
    assert service.list_versions("m")[0].leases == 1
    with pytest.raises(InvalidArgument, match="lease_id: 'L1' is already held by reader 'r'"):
        service.acquire_lease("m", 1, "other-reader", lease_id="L1")


@pytest.mark.parametrize("state", ["PENDING", "DRAINING", "RETIRED", "EXPIRED"])
def test_only_ready_versions_can_be_leased(
    service: CatalogService, clock: FakeClock, state: str
) -> None:
    service.register_source("m", 1, 2, tp_source(0, 2, ready=True), ttl_s=5)
    if state != "PENDING":
        service.register_source("m", 1, 2, tp_source(1, 2, ready=True), ttl_s=5)
        held = service.acquire_lease("m", 1, "r")
        if state == "DRAINING":
            service.retire_version("m", 1)
        elif state == "RETIRED":
            service.release_lease(held)
            service.retire_version("m", 1)
        else:
            clock.advance(6)
    assert service.list_versions("m")[0].state.value == state
    with pytest.raises(FailedPrecondition, match=f"version 1 is {state}; only READY"):
        service.acquire_lease("m", 1, "r2")


def test_retire_without_leases_retires_at_once(service: CatalogService) -> None:
    publish_ready(service, "m", 1)
    assert service.retire_version("m", 1) is RETIRED
    assert service.retire_version("m", 1) is RETIRED  # idempotent
    assert service.wait_drained("m", 1, timeout_s=0) is True


def test_retire_drains_until_the_last_lease_is_released(service: CatalogService) -> None:
    publish_ready(service, "m", 1)
    a = service.acquire_lease("m", 1, "a")
    b = service.acquire_lease("m", 1, "b")
    assert service.retire_version("m", 1) is DRAINING
    with pytest.raises(FailedPrecondition, match="is DRAINING, not READY"):
        service.get_version("m", 1)
    service.heartbeat(lease_ids=[a, b])  # live leases may still be renewed while draining
    service.release_lease(a)
    assert service.wait_drained("m", 1, timeout_s=0) is False
    service.release_lease(b)
    assert service.list_versions("m")[0].state is RETIRED
    assert service.wait_drained("m", 1, timeout_s=0) is True


def test_retiring_a_pending_version_closes_it(service: CatalogService) -> None:
    service.register_source("m", 1, 2, tp_source(0, 2))
    assert service.retire_version("m", 1) is RETIRED
    with pytest.raises(
        FailedPrecondition, match="version 1 is RETIRED; source 'tp1' cannot be added"
    ):
        service.register_source("m", 1, 2, tp_source(1, 2))


@pytest.mark.parametrize("state", ["PENDING", "READY"])
def test_wait_drained_requires_a_retired_version(service: CatalogService, state: str) -> None:
    service.register_source("m", 1, 1, source(ready=state == "READY"))
    with pytest.raises(FailedPrecondition, match=f"is {state}; retire it before waiting"):
        service.wait_drained("m", 1, timeout_s=1)


def test_wait_drained_times_out(service: CatalogService) -> None:
    publish_ready(service, "m", 1)
    service.acquire_lease("m", 1, "r")
    service.retire_version("m", 1)
    start = time.monotonic()
    assert service.wait_drained("m", 1, timeout_s=0.05) is False
    assert 0.04 < time.monotonic() - start < 2


def test_wait_drained_wakes_when_another_thread_releases(service: CatalogService) -> None:
    publish_ready(service, "m", 1)
    lease = service.acquire_lease("m", 1, "r")
    service.retire_version("m", 1)
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(service.wait_drained("m", 1, 30)))
    waiter.start()
    time.sleep(0.05)  # let the waiter block on the condition
    assert result == []
    service.release_lease(lease)
    waiter.join(timeout=5)
    assert result == [True]
    assert service.list_versions("m")[0].state is RETIRED


def test_wait_drained_wakes_when_the_reaper_expires_the_last_lease(
    service: CatalogService, clock: FakeClock
) -> None:
    publish_ready(service, "m", 1)
    service.acquire_lease("m", 1, "slow-reader", ttl_s=5)
    service.heartbeat(source_ids=["tp0", "tp1"])
    service.retire_version("m", 1)
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(service.wait_drained("m", 1, 30)))
    waiter.start()
    time.sleep(0.05)
    clock.advance(6)  # past the lease TTL (the sources' 30 s TTL still holds)
    assert service.reap().leases != ()
    waiter.join(timeout=5)
    assert result == [True]


def test_wait_drained_with_a_real_clock_notices_lease_expiry_without_a_reaper(make_service) -> None:
    service = make_service()
    publish_ready(service, "m", 1)
    service.acquire_lease("m", 1, "r", ttl_s=0.1)
    service.retire_version("m", 1)
    start = time.monotonic()
    assert service.wait_drained("m", 1, timeout_s=10) is True
    assert time.monotonic() - start < 2


# --- TTLs, heartbeats, reaper ----------------------------------------------------------------


def test_lease_expires_without_heartbeats(service: CatalogService, clock: FakeClock) -> None:
    publish_ready(service, "m", 1)
    lease = service.acquire_lease("m", 1, "r", ttl_s=5)
    clock.advance(4)
    service.heartbeat(source_ids=["tp0", "tp1"], lease_ids=[lease])  # renewed to t+4+5
    clock.advance(4)
    service.heartbeat(source_ids=["tp0", "tp1"])
    assert service.list_versions("m")[0].leases == 1
    clock.advance(2)
    assert service.reap().leases == (lease,)
    with pytest.raises(NotFound, match="unknown or expired lease_ids"):
        service.heartbeat(lease_ids=[lease])


def test_heartbeat_is_all_or_nothing(service: CatalogService, clock: FakeClock) -> None:
    publish_ready(service, "m", 1)
    lease = service.acquire_lease("m", 1, "r", ttl_s=5)
    clock.advance(4)
    with pytest.raises(NotFound, match=r"source_ids \['ghost'\] and lease_ids \['nope'\]"):
        service.heartbeat(source_ids=["tp0", "ghost"], lease_ids=[lease, "nope"])
    clock.advance(1.5)  # the lease was not renewed by the rejected heartbeat
    assert service.reap().leases == (lease,)


def test_dead_source_expires_every_live_version_it_belongs_to(
    service: CatalogService, clock: FakeClock
) -> None:
    publish_ready(service, "m", 1)
    publish_ready(service, "m", 2)
    publish_ready(service, "m", 3)
    service.retire_version("m", 1)  # RETIRED stays RETIRED
    clock.advance(20)
    service.heartbeat(source_ids=["tp0"])  # tp1 goes silent
    clock.advance(20)
    report = service.reap()
    assert report.sources == ("tp1",)
    assert report.versions == (("m", 2), ("m", 3))
    assert [s.state for s in service.list_versions("m")] == [RETIRED, EXPIRED, EXPIRED]
    with pytest.raises(NotFound, match="no READY version"):
        service.get_version("m")
    with pytest.raises(NotFound, match=r"unknown or expired source_ids \['tp1'\]"):
        service.heartbeat(source_ids=["tp1"])
    # A dead version's number may be published afresh (a restarted job republishing it).
    assert service.register_source("m", 3, 2, tp_source(1, 2)) is PENDING
    assert [s.registered_sources for s in service.list_versions("m")] == [2, 2, 1]


def test_expiry_applies_on_the_next_call_even_without_a_reaper(
    service: CatalogService, clock: FakeClock
) -> None:
    publish_ready(service, "m", 1)
    clock.advance(31)
    with pytest.raises(NotFound, match=r"no READY version >= 0 \(known: 1 EXPIRED\)"):
        service.get_version("m")


def test_leases_on_an_expired_version_still_hold_its_drain(
    service: CatalogService, clock: FakeClock
) -> None:
    service.register_source("m", 1, 2, tp_source(0, 2, ready=True), ttl_s=60)
    service.register_source("m", 1, 2, tp_source(1, 2, ready=True), ttl_s=5)
    lease = service.acquire_lease("m", 1, "r", ttl_s=60)
    clock.advance(6)
    service.reap()
    assert service.retire_version("m", 1) is EXPIRED  # unchanged
    assert service.wait_drained("m", 1, timeout_s=0) is False  # tp0's buffers are being read
    service.release_lease(lease)
    assert service.wait_drained("m", 1, timeout_s=0) is True


def test_shorter_ttl_on_reregistration_takes_effect(
    service: CatalogService, clock: FakeClock
) -> None:
    service.register_source("m", 1, 1, source(ready=True), ttl_s=100)
    service.register_source("m", 2, 1, source(ready=True), ttl_s=5)
    clock.advance(6)
    assert service.reap().sources == ("s0",)


def test_heartbeats_do_not_grow_the_deadline_heap(
    service: CatalogService, clock: FakeClock
) -> None:
    publish_ready(service, "m", 1)
    lease = service.acquire_lease("m", 1, "r", ttl_s=10)
    for _ in range(500):
        clock.advance(1)
        service.heartbeat(source_ids=["tp0", "tp1"], lease_ids=[lease])
    assert service.store.run(lambda txn: len(txn.state.deadlines)) <= 3  # one entry per record, not per heartbeat


# --- history ---------------------------------------------------------------------------------


def test_old_terminal_versions_are_forgotten_beyond_the_history(make_service, clock: FakeClock) -> None:
    service = make_service(clock=clock, history=2)
    for version in range(1, 7):
        publish_ready(service, "m", version)
        if version < 6:
            service.retire_version("m", version)
    summaries = service.list_versions("m")
    assert [(s.version, s.state) for s in summaries] == [(4, RETIRED), (5, RETIRED), (6, READY)]
    with pytest.raises(NotFound, match="has no version 1"):
        service.retire_version("m", 1)


# --- concurrency -----------------------------------------------------------------------------


def test_concurrent_registrations_from_many_ranks(service: CatalogService) -> None:
    size = 16
    barrier = threading.Barrier(size)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            barrier.wait()
            service.register_source("m", 1, size, tp_source(r, size))
            service.mark_ready("m", 1, f"tp{r}")
            service.heartbeat(source_ids=[f"tp{r}"])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert errors == []
    info = service.get_version("m")
    assert info.state is READY and len(info.sources) == size
    assert {s.mesh for s in info.sources} == {
        MeshPosition(tp_rank=r, tp_size=size) for r in range(size)
    }


# --- incarnations: liveness follows the process ----------------------------------------------


def incarnate(src, incarnation: str):
    return replace(src, incarnation=incarnation, ready=True)


def test_a_restarted_rank_expires_its_predecessors_versions_at_once(service: CatalogService) -> None:
    service.register_source("m", 1, 1, incarnate(source("r0"), "A"), ttl_s=60)
    service.register_source("m", 2, 1, incarnate(source("r0"), "A"), ttl_s=60)
    assert service.register_source("m", 3, 1, incarnate(source("r0"), "B"), ttl_s=60) is READY
    assert [(s.version, s.state) for s in service.list_versions("m")] == [(1, EXPIRED), (2, EXPIRED), (3, READY)]
    assert service.get_version("m").version == 3
    with pytest.raises(FailedPrecondition, match=r"'r0' \(registered by incarnation 'B', not 'A'\)"):
        service.heartbeat(source_ids=["r0"], incarnations={"r0": "A"})  # the stale process learns it
    service.heartbeat(source_ids=["r0"], incarnations={"r0": "B"})


def test_a_restarted_rank_republishes_its_predecessors_version_number(service: CatalogService) -> None:
    service.register_source("m", 5, 1, incarnate(source("r0"), "A"))
    lease = service.acquire_lease("m", 5, "reader")
    assert service.register_source("m", 5, 1, incarnate(source("r0", metadata=b"new"), "B")) is READY
    info = service.get_version("m", 5)
    assert info.sources[0].incarnation == "B" and info.sources[0].agent_metadata == b"new"
    service.release_lease(lease)  # the lease on the dead record still ends cleanly
    assert service.list_versions("m")[0].leases == 0


def test_a_restarted_rank_joins_a_pending_version_keeping_the_other_ranks(service: CatalogService) -> None:
    service.register_source("m", 1, 2, incarnate(tp_source(0, 2), "A0"))
    service.register_source("m", 1, 2, incarnate(tp_source(1, 2), "A1"), ttl_s=60)
    service.retire_version("m", 1)  # leave version 1 behind; version 2 is PENDING
    service.register_source("m", 2, 2, incarnate(tp_source(1, 2), "A1"))
    assert service.register_source("m", 2, 2, incarnate(tp_source(1, 2), "B1")) is PENDING
    assert service.register_source("m", 2, 2, incarnate(tp_source(0, 2), "A0")) is READY
    assert [s.registered_sources for s in service.list_versions("m")] == [2, 2]


def test_a_rejected_registration_does_not_expire_the_predecessor(service: CatalogService) -> None:
    service.register_source("m", 1, 1, incarnate(source("r0"), "A"))
    service.register_source("m", 2, 2, replace(source("r0", tp_size=2), incarnation="A"))  # PENDING
    service.register_source("m", 2, 2, replace(source("x", tp_rank=1, tp_size=2), incarnation="X"))
    with pytest.raises(InvalidArgument, match="source.mesh: position .* already held by source 'x'"):
        service.register_source("m", 2, 2, replace(source("r0", tp_rank=1, tp_size=2), incarnation="B"))
    assert [s.state for s in service.list_versions("m")] == [READY, PENDING]
    service.heartbeat(source_ids=["r0"], incarnations={"r0": "A"})  # still the live incarnation


def test_released_leases_pin_no_retired_version() -> None:
    """A released lease stays in the deadline heap until its TTL; it must not keep its retired,
    forgotten version (the whole manifest) alive until then."""
    import gc
    import weakref

    service = CatalogService(history=1)
    records = []
    for version in (1, 2, 3):
        publish_ready(service, "m", version)
        records.append(weakref.ref(service.store.run(lambda txn, v=version: txn.state.models["m"][v])))
        lease = service.acquire_lease("m", version, "r", ttl_s=3600)
        service.release_lease(lease, completed=True)
        assert service.retire_version("m", version) is VersionState.RETIRED
    gc.collect()
    assert [ref() is None for ref in records] == [True, True, False]  # versions 1, 2 forgotten
