"""The one polling loop with backoff, shared by every "wait until the catalog says so"."""

from __future__ import annotations

import time


class Backoff:
    """Sleeps that double from ``first_s`` up to ``max_s`` and never pass ``timeout_s``.

    ``sleep()`` returns False once the deadline has passed (the last sleep is cut short to end
    at it), so callers ask one last time at the deadline and then give up::

        wait = Backoff(timeout_s)
        while not done():
            if not wait.sleep():
                raise TimeoutError(...)
    """

    def __init__(self, timeout_s: float, *, first_s: float = 0.02, max_s: float = 0.5) -> None:
        self.deadline = time.monotonic() + max(0.0, timeout_s)
        self._delay = first_s
        self._max = max_s

    def sleep(self) -> bool:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(self._delay, remaining))
        self._delay = min(self._delay * 2, self._max)
        return True
