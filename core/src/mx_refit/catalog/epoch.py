"""The catalog's store epoch as its callers see it (see :attr:`mx_refit.catalog.store.Txn.epoch`).

Every answer a publisher or a reader relies on carries the epoch of the state it came from. An
epoch names one unbroken life of the catalog's state; a new one means the catalog may have lost
committed writes (leases among them), and a rollback never brings an old one back. So:

* a publisher that sees the epoch change treats it like a lost registration: it registers its
  intact versions again and waits its lease fence before mutating;
* a reader never confirms a lease by its deadline when the epoch changed under it;
* a drain names the epoch its caller registered the version in, and the catalog answers
  "drained" for a version from an earlier epoch only once the fence has passed.

:func:`answer_epoch` reads the epoch of the calling thread's last answer from any catalog
(a :class:`~mx_refit.catalog.client.CatalogClient` or an in-process service); "" when the
catalog does not say (an older catalog, a test double).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

__all__ = ["AnswerEpochs", "PublisherEpochs", "answer_epoch"]

log = logging.getLogger(__name__)
_VERSIONS_KEPT = 64  # a publisher drains recent versions

_REGISTRATIONS_KEPT = 4096


def answer_epoch(catalog: Any) -> str:
    """The epoch of this thread's last answer from ``catalog`` ("" when it does not say)."""
    read = getattr(catalog, "answer_epoch", None)
    return str(read()) if callable(read) else ""


class AnswerEpochs:
    """Client-side bookkeeping: the epoch of each thread's last answer, and the epoch in which
    this client first registered each (model, version)."""

    def _init_epochs(self) -> None:
        self._answers = threading.local()
        self._registered_epochs: OrderedDict[tuple[str, int], str] = OrderedDict()
        self._epochs_lock = threading.Lock()

    def answer_epoch(self) -> str:
        """The catalog epoch of this thread's last answer ("" before one, or from a catalog that
        predates epochs)."""
        return str(getattr(self._answers, "epoch", ""))

    def _note_answer(self, reply: Any) -> None:
        epoch = getattr(reply, "catalog_epoch", None)
        if epoch is not None:
            self._answers.epoch = epoch

    def _note_registration(self, model: str, version: int) -> None:
        """Remember the epoch of a registration's answer: the first one for the version (a
        registration repeated after the catalog lost it must not hide the earlier epoch)."""
        epoch = self.answer_epoch()
        if not epoch:
            return
        with self._epochs_lock:
            self._registered_epochs.setdefault((model, version), epoch)
            while len(self._registered_epochs) > _REGISTRATIONS_KEPT:
                self._registered_epochs.popitem(last=False)

    def registered_epoch(self, model: str, version: int) -> str:
        """The epoch in which this client first registered (model, version) ("" if it did not)."""
        with self._epochs_lock:
            return self._registered_epochs.get((model, version), "")


class PublisherEpochs:
    """A publisher's epochs: of each version's first registration (sent with its drains) and of
    its heartbeats' answers (a change: register the intact versions again)."""

    def __init__(self, catalog: Any, source_id: str) -> None:
        self._catalog, self._source_id = catalog, source_id
        self._beat = ""
        self._versions: dict[int, str] = {}

    def registered(self, version: int) -> None:
        """Note the epoch of this thread's last answer, a registration of ``version``."""
        self._versions.setdefault(version, answer_epoch(self._catalog))
        for older in sorted(self._versions)[:-_VERSIONS_KEPT]:
            del self._versions[older]

    def of(self, version: int) -> str:
        """The epoch of ``version``'s first registration ("" when unknown)."""
        return self._versions.get(version, "")

    def moved_since(self, version: int) -> bool:
        """Whether this thread's last answer came from another epoch than ``version``'s registration."""
        registered = self.of(version)
        return bool(registered) and answer_epoch(self._catalog) not in ("", registered)

    def beat_moved(self) -> bool:
        """Whether this thread's last answer (a heartbeat's) came from another epoch than the
        previous heartbeat's: the catalog's state may have rolled back."""
        epoch = answer_epoch(self._catalog)
        if not epoch:
            return False  # a catalog that does not say
        moved, self._beat = bool(self._beat) and epoch != self._beat, epoch
        if moved:
            log.warning("%s: the catalog's epoch changed to %s: its state may have rolled back (a store restart or "
                        "failover); registering its versions again (its drains hold the lease fence)",
                        self._source_id, epoch)
        return moved
