"""The catalog's state and the small store interface :class:`~mx_refit.catalog.CatalogService`
keeps it behind.

The service's logic works on plain Python objects (:class:`CatalogState` and the records of
:mod:`mx_refit.catalog._records`); a store only decides where that state lives between calls
and makes each call atomic:

* :class:`~mx_refit.catalog.store.memory.MemoryStore` keeps it in this process (the default).
* :class:`~mx_refit.catalog.store.redis_store.RedisStore` keeps it in Redis, so several catalog
  processes share it and a restarted one loses nothing (see docs/design.md, "Catalog stores").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from mx_refit.catalog._records import (
    TRANSIENT,
    Deadlines,
    EndedLeases,
    LeaseRecord,
    SourceLife,
    VersionRecord,
)
from mx_refit.catalog.digests import Layout

__all__ = ["TRANSIENT", "CatalogState", "CatalogStore", "Txn"]

T = TypeVar("T")

@dataclass(eq=False)
class CatalogState:
    """Everything the catalog knows. Stores persist every field not marked :data:`TRANSIENT`
    (generically: a field added to this class or to a record is stored with no extra code)."""

    models: dict[str, dict[int, VersionRecord]] = field(default_factory=dict)
    sources: dict[str, SourceLife] = field(default_factory=dict)
    # Kept by the store apart from the rest (the Redis store: one key per lease, so a renewal
    # writes one lease, not every one).
    leases: dict[str, LeaseRecord] = field(default_factory=dict, metadata=TRANSIENT)
    ended_leases: EndedLeases = field(default_factory=EndedLeases, metadata=TRANSIENT)  # Redis: own hash
    # Each live source id's last registered layout: a republished identical layout reuses its
    # descriptor tuple and digest instead of being hashed again (a per-process cache).
    layouts: dict[str, Layout] = field(default_factory=dict, metadata=TRANSIENT)
    # The store epoch this state was last used in, and the store time that epoch was first seen
    # (see :attr:`Txn.epoch`): versions older than the epoch may have lost leases.
    epoch: str = ""
    epoch_began: float = 0.0
    deadlines: Deadlines = field(default_factory=Deadlines, metadata=TRANSIENT)

    def __post_load__(self) -> None:
        """Rebuild the deadline heap from the live sources and leases (after a load)."""
        for timed in (*self.sources.values(), *self.leases.values()):
            self.deadlines.set(timed, timed.expires_at, new=True)


@dataclass
class Txn:
    """One atomic call's view: the state, the store's time (seconds), the store's generation
    when the call began (an opaque token for :meth:`CatalogStore.wait_for_change`) and the
    store's *epoch*.

    The epoch names one unbroken life of the store's state: it changes whenever the state may
    have lost committed writes (a memory store's process started; a Redis server restarted, failed
    over to a replica or was flushed), and a rollback cannot bring an old one back (it holds a
    random token). Leases granted in an earlier epoch may be gone without a release."""

    state: CatalogState
    now: float
    generation: object
    notified: bool = False
    epoch: str = ""

    def notify(self) -> None:
        """Wake waiters once this call has committed."""
        self.notified = True


class CatalogStore(ABC):
    """Where the catalog state lives; makes each service call atomic."""

    url: str = "memory"

    @abstractmethod
    def run(self, body: Callable[[Txn], T]) -> T:
        """Run ``body`` on the current state as one atomic step and return its result.

        ``body`` validates before it mutates; if it raises, the store keeps nothing it did
        that it has not already kept (the memory store relies on validation-first, the Redis
        store drops the attempt). A store may run ``body`` again on a fresh state when a
        concurrent writer won the race, so ``body`` must not have effects outside the state.
        """

    @abstractmethod
    def wait_for_change(self, generation: object, timeout_s: float) -> None:
        """Block up to ``timeout_s`` (real time) until a call that notified has committed after
        ``generation`` (spurious early returns are allowed: callers re-check)."""

    def close(self) -> None:  # noqa: B027 - optional: only stores with connections override it
        """Release connections (the memory store has none)."""
