"""A daemon thread that keeps catalog TTLs (sources, leases) alive."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Heartbeat:
    """Calls ``beat()`` every ``interval_s`` until stopped. Failures are logged and retried:
    a missed beat only matters once the TTL runs out, and the catalog then says so."""

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
        while not self._stop.wait(self._interval_s):
            try:
                self._beat()
            except Exception as exc:  # keep beating; the TTL decides
                log.warning("%s: heartbeat failed: %s", self._name, exc)
