"""A daemon thread that keeps catalog TTLs (sources, leases) alive."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


# After a failed beat, retry sooner (from 0.1 s, doubling, at most the interval and 1 s), so a
# restarted catalog is back in use within about a second of answering again.
_RETRY_FIRST_S = 0.1
_RETRY_MAX_S = 1.0


class Heartbeat:
    """Calls ``beat()`` every ``interval_s`` until stopped. Failures are logged and retried with
    a bounded backoff: a missed beat only matters once the TTL runs out, and the catalog then
    says so."""

    def __init__(self, beat: Callable[[], None], interval_s: float, name: str = "mx-refit-heartbeat") -> None:
        self._beat = beat
        self._interval_s = interval_s
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._interval_s + 5)
            self._thread = None

    def _run(self) -> None:
        wait = self._interval_s
        failures = 0
        while not self._stop.wait(wait):
            try:
                self._beat()
            except Exception as exc:  # keep beating; the TTL decides
                if failures == 0 or failures % 20 == 0:  # no log storm while the catalog is down
                    log.warning("%s: heartbeat failed: %s", self._name, exc)
                wait = min(_RETRY_FIRST_S * 2 ** min(failures, 10), _RETRY_MAX_S, self._interval_s)
                failures += 1
            else:
                wait, failures = self._interval_s, 0
