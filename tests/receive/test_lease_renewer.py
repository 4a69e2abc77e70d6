"""``LeaseRenewer``: one thread, kept across a receiver's refits, renews each refit's lease on
a real catalog (the in-process service on real time), so a lease outlives its TTL while held."""

from __future__ import annotations

import threading
import time

import pytest

from mx_refit.catalog import CatalogService
from mx_refit.errors import LeaseLost
from mx_refit.receive.lease import LeaseGuard, LeaseRenewer
from mx_refit.types import MeshPosition, SourceInfo, TensorDescriptor

pytestmark = pytest.mark.timeout(60)

TTL_S = 1.5  # renewed every 0.5 s; gone 1.5 s after the last renewal


def _ready(service: CatalogService) -> None:
    tensor = TensorDescriptor(name="w", dtype="float32", global_shape=(4,), local_shape=(4,), addr=0x1000, nbytes=16)
    source = SourceInfo(source_id="s", mesh=MeshPosition(), agent_name="a", agent_metadata=b"", tensors=(tensor,))
    service.register_source("m", 1, 1, source, ttl_s=60)
    service.mark_ready("m", 1, "s")


def _guard(service: CatalogService, renewer: LeaseRenewer, reader: str) -> LeaseGuard:
    sent = time.monotonic()
    lease_id = service.acquire_lease("m", 1, reader, ttl_s=TTL_S)
    return LeaseGuard(service, lease_id, TTL_S, acquired_at=sent, label="model 'm' version 1", renewer=renewer)


def test_one_thread_renews_each_lease_past_its_ttl_and_stops_with_it() -> None:
    service = CatalogService()
    _ready(service)
    renewer = LeaseRenewer("test-renewer")
    threads_before = threading.active_count()
    for reader in ("first", "second"):  # two refits, one after the other
        guard = _guard(service, renewer, reader)
        guard.start()
        time.sleep(TTL_S + 0.5)  # past the TTL: only renewals keep it
        guard.check()
        guard.release(completed=True)  # the catalog confirms it was held throughout
        assert threading.active_count() == threads_before + 1  # the same one thread
    assert service.list_versions("m")[0].completed_reads == 2
    # A lease that is no longer watched is not renewed: the catalog lets it expire.
    unwatched = _guard(service, renewer, "third")
    unwatched.start()
    unwatched.stop()
    time.sleep(TTL_S + 0.3)
    with pytest.raises(LeaseLost, match="was not held for the whole refit"):
        unwatched.release(completed=True)
    renewer.close()
    deadline = time.monotonic() + 10
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == threads_before
    # A lease started after its receiver closed the renewer (a close under a running refit)
    # is still renewed, by a thread of its own.
    late = _guard(service, renewer, "late")
    late.start()
    assert threading.active_count() == threads_before + 1
    time.sleep(TTL_S + 0.5)
    late.release(completed=True)


def test_renewals_learn_which_watched_sources_the_catalog_no_longer_holds() -> None:
    service = CatalogService()
    _ready(service)
    guard = _guard(service, LeaseRenewer("watch"), "watcher")
    guard.watch_sources(["s", "ghost"])
    assert guard.gone_sources() == frozenset()  # nothing asked yet
    guard.renew()
    assert guard.gone_sources() == {"ghost"}
    service.heartbeat(watch_source_ids=["s"])  # a watch is no sign of life...
    guard.watch_sources(["s"])
    guard.renew()
    assert guard.gone_sources() == {"ghost"}  # ...and what was gone stays gone for this pull
    guard.check()  # the lease itself is held
    guard.abandon()
