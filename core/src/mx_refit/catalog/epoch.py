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

import threading
from collections import OrderedDict
from typing import Any

__all__ = ["AnswerEpochs", "answer_epoch"]

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
