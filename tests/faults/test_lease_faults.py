"""A refit holds its lease for the whole pull or fails with LeaseLost, loading nothing.

Each case: the publisher publishes version v; the reader leases v and stops right before its
NIXL READ; a fault makes the lease lapse (the reader process is SIGSTOPped past the TTL, the
link to the catalog is paused or cut, the catalog is SIGKILLed and restarted); the publisher's
drain then completes and it overwrites its buffers with v+1 at once, like an optimizer step;
then the reader continues. Before the fix, the reader returned v+1's bytes labelled v.
"""

from __future__ import annotations

import signal
import time

import pytest

pytestmark = pytest.mark.timeout(600)


def lease_loss_case(rig, fault: str) -> dict:
    rig.version += 1
    v = rig.version
    assert rig.pub.call(cmd="publish", version=v)["state"] == "READY"
    rig.reader.send(cmd="refit", version=v)
    got = rig.reader.next(timeout=90)
    if got.get("event") != "gate":
        # On a loaded box the lease can run out before the READ even starts: a genuine loss
        # too (never wrong bytes), but not the injected fault.
        assert rig.pub.call(cmd="drain", version=v, then=v + 1) == {"drained": True}
        return {**got, "fault": "before-gate"}
    # The lease is held; the READ has not started.
    if fault == "reader-stopped":  # the pull outlives the lease
        rig.reader.signal(signal.SIGSTOP)
        drained = rig.pub.call(cmd="drain", version=v, then=v + 1)
        rig.reader.signal(signal.SIGCONT)
    elif fault == "link-paused":  # heartbeats hang
        rig.relay.proc.signal(signal.SIGSTOP)
        drained = rig.pub.call(cmd="drain", version=v, then=v + 1)
        rig.relay.proc.signal(signal.SIGCONT)
    elif fault == "link-cut":  # heartbeats fail
        rig.relay.cut()
        drained = rig.pub.call(cmd="drain", version=v, then=v + 1)
        rig.relay.mend()
    elif fault == "catalog-restart":
        rig.catalog.restart()
        drained = rig.pub.call(cmd="drain", version=v, then=v + 1)
        time.sleep(1.5)  # the reader's renewals meet the new catalog
    else:
        raise AssertionError(fault)
    assert drained == {"drained": True}, drained  # the publisher has overwritten v with v+1
    rig.reader.send(cmd="go")
    result = rig.reader.next(timeout=90)
    result["fault"] = fault
    return result


def injected(rig, fault: str) -> dict:
    """A case where the injected fault, not the load of the box, cost the lease."""
    for _ in range(5):
        result = lease_loss_case(rig, fault)
        if result["fault"] != "before-gate":
            return result
    raise AssertionError(f"the lease ran out before the READ 5 times: {result}")


def assert_lease_lost(result: dict, *cause_words: str) -> None:
    assert not (result.get("ok") and result.get("wrong")), f"wrong bytes returned as success: {result}"
    assert result.get("error") == "LeaseLost", result
    assert "lease " in result["message"] and "nothing was loaded" in result["message"], result
    cause = result["cause"]
    assert any(word in cause for word in cause_words), result


def test_ttl_ran_out_during_a_slow_pull_fails_the_refit(lease_rig) -> None:
    assert_lease_lost(injected(lease_rig, "reader-stopped"), "TTL of 2 s ran out")


def test_heartbeats_that_cannot_reach_the_catalog_fail_the_refit(lease_rig) -> None:
    assert_lease_lost(injected(lease_rig, "link-paused"), "heartbeats could not reach the catalog")
    assert_lease_lost(injected(lease_rig, "link-cut"), "heartbeats could not reach the catalog")


def test_a_catalog_restart_mid_pull_fails_the_refit(lease_rig) -> None:
    assert_lease_lost(injected(lease_rig, "catalog-restart"), "catalog restarted and lost the lease")


def test_after_lost_leases_the_next_refit_is_byte_exact(lease_rig) -> None:
    lease_rig.reader.call(cmd="gate", on=False)
    try:
        lease_rig.version += 1
        v = lease_rig.version
        assert lease_rig.pub.call(cmd="publish", version=v)["state"] == "READY"
        result = lease_rig.reader.call(cmd="refit", version=v, wait_s=10, timeout=90)
        assert result["ok"] and result["version"] == v and result["wrong"] == [], result
        assert lease_rig.pub.call(cmd="drain", version=v, then=v + 1) == {"drained": True}
    finally:
        lease_rig.reader.call(cmd="gate", on=True)


@pytest.mark.slow
def test_100_lease_losses_return_no_wrong_bytes(lease_rig) -> None:
    faults = ["reader-stopped", "link-paused", "link-cut"] * 3 + ["catalog-restart"]
    outcomes: dict[str, int] = {}
    wrong = []
    for i in range(100):
        result = lease_loss_case(lease_rig, faults[i % len(faults)])
        if result.get("ok") and result.get("wrong"):
            wrong.append(result)
        key = "success" if result.get("ok") else result.get("error", "?")
        if result["fault"] == "before-gate":
            key += " (before the READ)"
        outcomes[key] = outcomes.get(key, 0) + 1
    print(f"lease-loss outcomes over 100 cases: {outcomes}; wrong bytes returned as success: {len(wrong)}")
    assert wrong == []
    assert set(outcomes) <= {"LeaseLost", "LeaseLost (before the READ)"}, outcomes
