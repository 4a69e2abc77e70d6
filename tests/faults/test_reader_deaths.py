"""A reader that dies never wedges a source: its lease expires within the TTL and the drain
completes.

One long-lived trainer rank publishes a version per case; a reader process forked from a warm
zygote (its own pid and NIXL agent) refits it and SIGKILLs itself at one point:
``before-lease`` (discovered, no lease yet), ``leased`` (lease held, nothing read), ``mid-pull``
(its READ posted and in flight), ``pulled`` (every byte in, the lease not released). The rank
then drains the version and mutates its buffers at once (its next publish): the drain must
complete within the lease's TTL after the death, plus what the calls take on a loaded box.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterator

import pytest
from _harness import failover_worker, kill_and_wait, zygote

pytestmark = pytest.mark.timeout(900)
MODEL = "reader-deaths"
LEASE_TTL_S = 0.5
SLACK_S = 5.0  # what the retire and wait calls may take on a loaded 2-core box, beyond the TTL
POINTS = ("before-lease", "leased", "mid-pull", "pulled")


class ReaderDeathRig:
    def __init__(self, catalog_proc, log_dir) -> None:
        self.zygote = zygote(catalog_proc.address, log_dir, name="reader-death-zygote")
        self.rank = failover_worker("source", catalog_proc.address, MODEL, log_dir, "reader-death-rank",
                                    "--rank", "0", "--ranks", "1", "--elems", str(1 << 12))
        self.version = 0

    def case(self, point: str) -> float:
        """One reader death at ``point``; returns the seconds from the death to the drain's end."""
        for _attempt in range(5):
            self.version += 1
            v = self.version
            assert self.rank.call(cmd="publish", version=v) == {"state": "READY"}
            self.zygote.send(cmd="spawn", fn="_failover_workers:doomed_reader", model=MODEL, version=v,
                             point=point, lease_ttl=LEASE_TTL_S, tag=v)
            event = self.zygote.next(timeout=120)
            if event.get("event") == "dying":
                kill_and_wait(event["pid"])  # it SIGKILLed itself: wait until it is gone
                drained = self.rank.call(cmd="drain", version=v, timeout=LEASE_TTL_S + 60)
                assert drained.get("drained"), drained
                return drained["at"] - event["at"]
            # The child failed before its point (its 0.5 s lease lapsed on a loaded box): not
            # the injected death. Drain and try again.
            assert event.get("event") in ("child-error", "survived"), event
            assert self.rank.call(cmd="drain", version=v).get("drained")
        raise AssertionError(f"the reader never reached {point!r} in 5 attempts: {event}")

    def close(self) -> None:
        self.rank.kill()
        self.zygote.kill()


@pytest.fixture(scope="module")
def rig(catalog_proc, log_dir) -> Iterator[ReaderDeathRig]:
    r = ReaderDeathRig(catalog_proc, log_dir)
    try:
        yield r
    finally:
        r.close()


@pytest.mark.parametrize("point", POINTS)
def test_a_reader_killed_at_any_point_of_a_refit_lets_the_source_drain_within_the_ttl(rig, point) -> None:
    assert rig.case(point) <= LEASE_TTL_S + SLACK_S


@pytest.mark.slow
def test_100_reader_deaths_leave_the_source_able_to_drain_within_the_ttl(rig) -> None:
    rng = random.Random(8)
    waits: dict[str, list[float]] = defaultdict(list)
    for _ in range(100):
        point = rng.choice(POINTS)
        waits[point].append(rig.case(point))
    summary = {p: f"{len(w)} deaths, drained after max {max(w):.2f} s" for p, w in sorted(waits.items())}
    print(f"100 reader deaths (lease TTL {LEASE_TTL_S} s): {summary}")
    assert sum(len(w) for w in waits.values()) == 100
    assert max(max(w) for w in waits.values()) <= LEASE_TTL_S + SLACK_S
