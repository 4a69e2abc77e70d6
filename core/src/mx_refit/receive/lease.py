"""A reader's lease, held continuously for one refit or the refit fails (``LeaseLost``).

The publisher mutates a version's buffers once the catalog says its leases drained, so bytes
pulled under a lease are trustworthy only if the catalog kept that lease from acquisition until
its release. :class:`LeaseGuard` enforces that on one clock, the catalog's:

* the catalog's word is final: a renewal or release answered NotFound (the TTL ran out, or the
  catalog restarted and lost it) fails the refit, and a renewal that says so aborts the pull;
* between answers, the guard keeps a conservative local bound: each acknowledged renewal sent at
  local time ``t`` keeps the lease until at least ``t + ttl`` on the catalog (the catalog set its
  deadline after receiving the call), so once local time passes the last such bound without a
  newer acknowledgement the lease may be gone and the pull is aborted.

Each renewal also asks the catalog which of the sources the pull reads it no longer holds
live (:meth:`LeaseGuard.watch_sources`): a frozen source (SIGSTOP: its heartbeats stop but its
connections stay up) is then failed over within its TTL plus ``ttl_s / 3``, not at the
transfer timeout (:meth:`LeaseGuard.gone_sources`, polled by the transport's read loop).

Renewals cost nothing for short pulls: the timer first fires at a third of the TTL. A
:class:`LeaseRenewer` keeps one renewal thread across a receiver's refits, so a steady refit
starts no thread (starting one costs 0.1-0.3 ms, as much as a third of a catalog round trip).

The release need not be waited for when the lease's own deadline already proves it was held
(:meth:`LeaseGuard.release` with ``fence_s``). Within one catalog life a lease ends only when
released or at its deadline, never earlier. Across a catalog that lost its leases (a restart
of a store that keeps nothing), every source of the version promised a fence: its publisher
learns of the loss at some time ``n`` after the old catalog died at ``d``, and mutates nothing
before ``n + fence_s``; a lease acknowledged by the old catalog is held locally until at most
``d + ttl_s``. With ``ttl_s <= fence_s`` and the pull finished before the local bound, no
source mutated a byte during the pull whatever the catalog did, so the refit loads at once and
the release (it still ends the drain, and counts the completed read) goes out on the renewal
thread. Otherwise the refit waits for the catalog's answer as before. A renewal answered from
another catalog epoch than the acquisition (:mod:`mx_refit.catalog.epoch`: the catalog's state
may have rolled back, e.g. Redis restarted from a snapshot) ends that shortcut for the lease:
its release then waits for the catalog, which answers NotFound for a lease it lost.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from mx_refit.catalog.epoch import answer_epoch
from mx_refit.errors import LeaseLost, MxRefitError, NotFound

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.catalog.api import Catalog

__all__ = ["LeaseGuard", "LeaseRenewer"]

log = logging.getLogger(__name__)

# Slack on the local bound before it confirms a lease by itself: monotonic clocks of two hosts
# may run apart by up to ~500 ppm (NTP's slew limit), plus a fixed margin for scheduling.
_DEADLINE_SLACK_FRACTION = 1e-3
_DEADLINE_SLACK_S = 0.01


class LeaseGuard:
    """Renews ``lease_id`` every ``ttl_s / 3`` while started and knows whether it is still held.

    :param acquired_at: local monotonic time at which the acquiring call was sent.
    :param label: what the lease covers (``model 'm' version 3``), for messages.
    :param renewer: renews on this long-lived thread instead of one started for this lease.
    :param epoch: the catalog epoch of the acquiring answer ("": unknown, never compared).
    """

    def __init__(
        self,
        catalog: "Catalog",
        lease_id: str,
        ttl_s: float,
        *,
        acquired_at: float,
        label: str,
        renewer: "LeaseRenewer | None" = None,
        epoch: str = "",
    ) -> None:
        self._catalog = catalog
        self.lease_id = lease_id
        self.ttl_s = ttl_s
        self.label = label
        self._held_until = acquired_at + ttl_s  # local lower bound of the catalog's deadline
        self.epoch = epoch
        self.epoch_changed = False  # a renewal came from another epoch: no deadline shortcut
        self._lost: str | None = None  # the catalog said the lease is gone (its message)
        self._renew_error: str | None = None  # last renewal that could not reach the catalog
        self._renew_error_since: float | None = None
        self._inflight_since: float | None = None
        self._slowest_renewal_s = 0.0  # a renewal that took this long crossed a stalled link
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewer = renewer
        self.next_renewal = math.inf  # local monotonic time of the next renewal (a renewer's)
        self._watched: tuple[str, ...] = ()  # sources the pull reads
        self._gone: frozenset[str] = frozenset()  # of those, the ones the catalog expired

    def watch_sources(self, source_ids: Iterable[str]) -> None:
        """Ask the catalog, with every renewal, whether these sources (the pull's holders) are live."""
        self._watched = tuple(sorted(source_ids))

    def gone_sources(self) -> frozenset[str]:
        """The watched sources the catalog said are no longer live (cheap: polled mid-read)."""
        return self._gone

    # -- renewals ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._renewer is not None:
            self.next_renewal = time.monotonic() + self.ttl_s / 3
            if self._renewer.watch(self):
                return
            self._renewer = None  # closed (its receiver is closing under this refit): own thread
        self._thread = threading.Thread(target=self._run, name=f"mx-refit-lease[{self.lease_id}]", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.unwatch(self)
        # A renewal stuck on an unreachable catalog must not hold the refit up: the thread is a
        # daemon and its outcome no longer matters once the release decides.
        if self._thread is not None:
            self._thread.join(timeout=0.2)

    def _run(self) -> None:
        interval = self.ttl_s / 3
        while not self._stop.wait(interval):
            interval = self.renew_and_schedule()
            if self._lost is not None:
                return

    def renew_and_schedule(self) -> float:
        """Renew now; return the seconds until the next renewal (sooner after a failed one;
        infinite once the catalog said the lease is gone)."""
        self.renew()
        interval = self.ttl_s / 3 if self._renew_error is None else min(self.ttl_s / 6, 0.5)
        if self._lost is not None:
            interval = math.inf
        self.next_renewal = time.monotonic() + interval
        return interval

    def renew(self) -> None:
        sent = time.monotonic()
        self._inflight_since = sent
        try:
            gone = self._catalog.heartbeat(lease_ids=[self.lease_id], watch_source_ids=self._watched)
        except NotFound as exc:
            self._lost = str(exc)
        except MxRefitError as exc:  # Unavailable and friends: the local bound decides
            if self._renew_error is None:
                self._renew_error_since = sent
            self._renew_error = f"{type(exc).__name__}: {exc}"
            log.warning("lease %s on %s: renewal failed: %s", self.lease_id, self.label, exc)
        else:
            if gone:  # a catalog that predates watch_source_ids answers None or nothing
                self._gone = self._gone | gone
            epoch = answer_epoch(self._catalog)
            if self.epoch and epoch and epoch != self.epoch and not self.epoch_changed:
                self.epoch_changed = True
                log.warning("lease %s on %s: the catalog's epoch changed (%s -> %s): its state may have "
                            "rolled back; the release will be confirmed by the catalog", self.lease_id,
                            self.label, self.epoch, epoch)
            self._held_until = max(self._held_until, sent + self.ttl_s)
            self._renew_error = self._renew_error_since = None
        finally:
            self._inflight_since = None
            self._slowest_renewal_s = max(self._slowest_renewal_s, time.monotonic() - sent)

    # -- verdicts ------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`LeaseLost` when the lease is gone or may be gone (called while pulling,
        so a lost lease aborts the pull at once)."""
        if self._lost is not None:
            self._fail(self._gone_cause(self._lost))
        now = time.monotonic()
        if now > self._held_until:
            self._fail(self._lapsed_cause(now))

    def release(self, *, completed: bool = False, fence_s: float = 0.0) -> str:
        """Release the lease and confirm it was held until now, else raise :class:`LeaseLost`.

        ``completed``: the reader pulled everything it needed (counted by ``wait_read``).
        ``fence_s``: the smallest ``lease_fence_s`` of the sources the pull may have read. When
        it covers the TTL and the local bound still holds, the deadline confirms the lease and
        the release is sent on the renewal thread without waiting (see the module docstring).
        Returns how the lease was confirmed: ``"deadline"`` or ``"catalog"``.
        """
        self.stop()
        if self._lost is not None:
            self._fail(self._gone_cause(self._lost))
        if (
            self._held_by_deadline(fence_s)
            and self._renewer is not None
            and self._renewer.release_later(self, completed)
        ):
            return "deadline"
        try:
            self._catalog.release_lease(lease_id=self.lease_id, completed=completed)
        except NotFound as exc:
            self._fail(self._gone_cause(str(exc)))
        except MxRefitError as exc:
            self._fail(f"the release could not be confirmed by the catalog ({type(exc).__name__}: {exc})")
        return "catalog"

    def _held_by_deadline(self, fence_s: float) -> bool:
        """Whether the lease is provably held until now without asking the catalog."""
        slack = _DEADLINE_SLACK_S + self.ttl_s * _DEADLINE_SLACK_FRACTION
        return (
            fence_s >= self.ttl_s
            and self._renew_error is None
            and not self.epoch_changed
            and time.monotonic() < self._held_until - slack
        )

    def send_release(self, completed: bool) -> None:
        """Send a release whose lease the deadline already confirmed (on the renewal thread):
        it ends the publisher's drain early and counts the read; if it cannot be delivered the
        lease simply runs out at its TTL."""
        try:
            self._catalog.release_lease(lease_id=self.lease_id, completed=completed)
        except NotFound as exc:  # the catalog lost it: the sources' fences covered the pull
            log.info("lease %s on %s: released after the catalog forgot it: %s", self.lease_id, self.label, exc)
        except Exception as exc:
            log.warning(
                "lease %s on %s: release not delivered (%s); the catalog ends it at its TTL of %g s",
                self.lease_id, self.label, exc, self.ttl_s,
            )

    def abandon(self) -> None:
        """Stop renewing and release best-effort (the refit already failed for another reason)."""
        self.stop()
        try:
            self._catalog.release_lease(lease_id=self.lease_id)
        except Exception as exc:  # the original failure is what the caller reports
            log.debug("lease %s: release after a failed refit: %s", self.lease_id, exc)

    def _gone_cause(self, catalog_says: str) -> str:
        if "not known to this catalog" in catalog_says:
            return f"the catalog restarted and lost the lease: {catalog_says}"
        if self._renew_error is not None:
            return (
                f"heartbeats could not reach the catalog ({self._renew_error}), and it let the "
                f"lease expire: {catalog_says}"
            )
        if self._slowest_renewal_s > self.ttl_s / 3:
            return (
                f"heartbeats could not reach the catalog (a renewal took {self._slowest_renewal_s:.3g} s), "
                f"and it let the lease expire: {catalog_says}"
            )
        if "expired" in catalog_says:
            return f"its TTL of {self.ttl_s:g} s ran out during a slow pull: {catalog_says}"
        return f"the catalog reported it gone: {catalog_says}"

    def _lapsed_cause(self, now: float) -> str:
        overdue = now - self._held_until + self.ttl_s
        if self._renew_error is not None:
            return (
                f"heartbeats could not reach the catalog for {now - (self._renew_error_since or now):.3g} s "
                f"(last error: {self._renew_error}), and no renewal was acknowledged within its TTL "
                f"of {self.ttl_s:g} s"
            )
        if self._inflight_since is not None and now - self._inflight_since > self.ttl_s / 3:
            return (
                f"heartbeats could not reach the catalog: a renewal sent {now - self._inflight_since:.3g} s ago "
                f"is unanswered, and no renewal was acknowledged within its TTL of {self.ttl_s:g} s"
            )
        return (
            f"its TTL of {self.ttl_s:g} s ran out during a slow pull: no renewal was acknowledged for "
            f"{overdue:.3g} s (the pull or this process stalled)"
        )

    def _fail(self, cause: str) -> None:
        raise LeaseLost(
            f"lease {self.lease_id} on {self.label} was not held for the whole refit: {cause}; "
            "nothing was loaded",
            lease_id=self.lease_id,
            cause=cause,
        )


class LeaseRenewer:
    """One daemon thread, kept across refits, renewing whichever lease its owner holds now (a
    receiver holds one at a time); started on the first lease, ended by :meth:`close`.

    Handing over a lease wakes the thread only when it would otherwise sleep past the new
    lease's first renewal: a woken thread competes for the GIL with the refit's next catalog
    call (measured: up to a few ms on a loaded machine). Otherwise it wakes at the time it had
    planned, finds the lease it now holds, and sleeps again."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._guard: LeaseGuard | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._wakes_at = math.inf  # when the sleeping thread wakes by itself (inf: never)
        self._releases: list[tuple[LeaseGuard, bool]] = []  # confirmed by deadline, to send
        self._sending = False  # a release is on the wire

    def watch(self, guard: LeaseGuard) -> bool:
        """Renew ``guard`` from now on (instead of the previous lease); False once closed."""
        with self._cond:
            if self._closed:
                return False
            self._guard = guard
            if not self._ensure_thread() and guard.next_renewal < self._wakes_at:
                self._cond.notify()
            return True

    def release_later(self, guard: LeaseGuard, completed: bool) -> bool:
        """Send ``guard``'s release on this thread, soon; False once closed (send it yourself)."""
        with self._cond:
            if self._closed:
                return False
            self._releases.append((guard, completed))
            if not self._ensure_thread():
                self._cond.notify()
            return True

    def _ensure_thread(self) -> bool:
        """Start the thread on first use (or in a forked child); True when it was started."""
        if self._thread is not None and self._thread.is_alive():
            return False
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return True

    def unwatch(self, guard: LeaseGuard) -> None:
        """Stop renewing ``guard`` (the thread is not woken: it finds out when it wakes)."""
        with self._cond:
            if self._guard is guard:
                self._guard = None

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop renewing; releases still queued are sent first (waited for up to ``timeout_s``:
        an undelivered one holds the publisher's drain until its TTL runs out)."""
        with self._cond:
            self._closed = True
            self._guard = None
            self._cond.notify()
            pending, thread = bool(self._releases) or self._sending, self._thread
        if pending and thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self) -> None:
        with self._cond:
            while self._releases or not self._closed:
                if self._releases:
                    releasing, completed = self._releases.pop(0)
                    self._sending = True
                    self._cond.release()  # the round trip must not block release_later/watch
                    try:
                        releasing.send_release(completed)
                    finally:
                        self._cond.acquire()
                        self._sending = False
                    continue
                guard = self._guard
                wait = math.inf if guard is None else guard.next_renewal - time.monotonic()
                if guard is None or wait > 0:
                    self._wakes_at = time.monotonic() + wait
                    self._cond.wait(None if math.isinf(wait) else wait)
                    continue
                self._wakes_at = -math.inf  # renewing: a new lease waits for the next loop
                self._cond.release()  # the renewal's round trip must not block watch/unwatch
                try:
                    guard.renew_and_schedule()
                finally:
                    self._cond.acquire()
