"""The in-memory catalog store: the state lives in this process, one lock makes calls atomic."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from mx_refit.catalog.store.base import CatalogState, CatalogStore, Txn

__all__ = ["MemoryStore"]

T = TypeVar("T")


class MemoryStore(CatalogStore):
    """The embedded default: fast, and gone when the process ends.

    :param clock: monotonic seconds for every TTL (tests inject a fake clock).
    """

    url = "memory"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._state = CatalogState()
        self._generation = 0
        self.epoch = f"mem-{uuid.uuid4().hex[:16]}"  # this process's state: gone with it

    def run(self, body: Callable[[Txn], T]) -> T:
        with self._cond:
            txn = Txn(self._state, self._clock(), self._generation, epoch=self.epoch)
            try:
                return body(txn)
            finally:
                if txn.notified:
                    self._generation += 1
                    self._cond.notify_all()

    def wait_for_change(self, generation: object, timeout_s: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._generation != generation, timeout_s)
