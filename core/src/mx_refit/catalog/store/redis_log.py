"""The Redis store's change log: what each commit wrote, so that a catalog process whose cache is
a few commits behind (another ``mx-refit serve`` on the same Redis committed since its last call)
applies just those writes instead of reloading every live lease.

``NS log`` is a list. Every commit appends one entry in the same ``MULTI``/``EXEC`` as its writes
(and trims the list to the last :data:`LOG_KEPT`): ``[parent, token, document, leases, ended]``,
the ``gen`` token the commit was made on (the one it WATCHed), the token it wrote, whether it
rewrote the control document, and the lease fields (``NS leases``) and ended-lease fields
(``NS ended``) it wrote, each id with the value written (null: deleted). A commit whose entry
would exceed :data:`LOG_ENTRY_MAX_CHARS` logs ``[parent, token, null]``: whoever was at
``parent`` reloads everything.

A process whose state is cached at token ``T`` while ``gen`` is ``G`` looks for the chain of
entries ``T -> ... -> G`` (each entry's parent the previous entry's token; the last entry comes
with every call's first read, so one commit behind costs no extra round trip) and applies their
writes in order; a rewritten document is read as of ``G`` under the ``WATCH`` on ``gen``.
Anything else is a full reload: ``T`` not in the log (a rollback or restart that lost ``T``, a
trimmed log, a flushed or recreated lineage, ``DEBUG RELOAD`` to an older dump), a broken chain,
a null entry.

Why this keeps every rollback guarantee: the log lives in the same Redis as the state it
describes and is written in the same transaction, so whatever state Redis comes back with (a
snapshot, an AOF cut at a transaction boundary, a promoted replica) holds the log of exactly its
own history. Tokens are random and each is written once, so ``T`` names one state; if the
current log leads from ``T`` to ``G``, the state at ``G`` was made from the state at ``T`` by
those entries' writes and no other. A commit a rollback lost never comes back into the log, so a
process cached at it always reloads in full; a rollback is never read as "nothing changed"
(and the epoch, :attr:`~mx_refit.catalog.store.base.Txn.epoch`, changes as before).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from mx_refit.catalog._records import EndedLeases, LeaseRecord
from mx_refit.catalog.store.base import CatalogState

__all__ = ["LOG_ENTRY_MAX_CHARS", "LOG_KEPT", "LOG_TAIL", "Changes", "apply_ended", "apply_leases", "chain", "lease_text",
           "link_leases", "log_entry", "transplant"]

LOG_KEPT = 128  # entries kept: a process more commits behind reloads everything
LOG_TAIL = 16  # entries read first (a process that is further behind reads the whole log)
LOG_ENTRY_MAX_CHARS = 16384  # a commit that wrote more logs "reload everything" (a mass expiry)


@dataclass
class Changes:
    """What the commits from a cached token up to the current one wrote: whether the document, and
    each lease and ended-lease field's last value (None: deleted)."""

    document: bool = False
    leases: dict[str, Any] = field(default_factory=dict)
    ended: dict[str, Any] = field(default_factory=dict)


def log_entry(parent: str, token: str, document: bool, leases: dict[str, str | None],
              ended: dict[str, str | None]) -> str:
    """The log entry of the commit of ``token`` made on ``parent`` that wrote ``leases`` and
    ``ended`` (field -> value, None: deleted)."""
    entry = json.dumps([parent, token, document, leases, ended])
    return entry if len(entry) <= LOG_ENTRY_MAX_CHARS else json.dumps([parent, token, None])


def chain(raw: list[Any], cached: str, target: str) -> Changes | None:
    """The writes from ``cached`` to ``target`` in the log entries ``raw`` (oldest first), or
    None when ``raw`` holds no unbroken chain of listed entries between them."""
    entries = [_entry(item) for item in raw]
    start = next((i for i, entry in enumerate(entries) if entry is not None and entry[0] == cached), None)
    if start is None:
        return None
    changes, at = Changes(), cached
    for entry in entries[start:]:
        if entry is None or entry[0] != at or entry[2] is None:
            return None  # unreadable, a broken chain (not within one history), or "reload everything"
        _, token, document, leases, ended = entry
        changes.document |= bool(document)
        changes.leases.update(leases)  # a later write of a field wins
        changes.ended.update(ended)
        at = token
        if at == target:
            return changes
    return None  # the log does not reach the current token


def _entry(raw: Any) -> list[Any] | None:
    """A log entry, or None when this code cannot read it (another version's, a stray write)."""
    try:
        entry = json.loads(_text(raw))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(entry, list) or len(entry) not in (3, 5) or not all(isinstance(t, str) for t in entry[:2]):
        return None
    if len(entry) == 3:
        return entry if entry[2] is None else None
    return entry if isinstance(entry[3], dict) and isinstance(entry[4], dict) else None


def lease_text(lease: LeaseRecord) -> str:
    """A live lease as its own field's value: its version (by model and number) and its fields."""
    rec = lease.record
    assert rec is not None, "a live lease belongs to a version"
    return json.dumps([rec.model, rec.version, lease.reader_id, lease.ttl_s, lease.expires_at, list(lease.sources)])


def _new_lease(state: CatalogState, lease_id: str, text: Any) -> LeaseRecord | None:
    """The stored lease ``lease_id``, linked to its version (None when its version is gone, which
    cannot happen: a version with live leases is kept)."""
    model, version, reader_id, ttl_s, expires_at, sources = json.loads(_text(text))
    rec = state.models.get(model, {}).get(version)
    if rec is None:
        return None
    lease = LeaseRecord(ttl_s=ttl_s, expires_at=expires_at, lease_id=lease_id, reader_id=reader_id,
                        record=rec, sources=tuple(sources))
    state.leases[lease_id] = rec.leases[lease_id] = lease
    state.deadlines.set(lease, expires_at, new=True)
    return lease


def link_leases(state: CatalogState, fields: list[tuple[Any, Any]]) -> None:
    """Link every stored lease (``NS leases``' fields) to its version, in a freshly loaded state."""
    for lease_id, text in fields:
        _new_lease(state, _text(lease_id), text)
    state.deadlines.track_leases = True  # from now on: what was loaded is no change
    state.deadlines.take_touched()


def _unlink(state: CatalogState, lease: LeaseRecord) -> None:
    lease.dead = True  # its heap entry is skipped when it comes up
    state.leases.pop(lease.lease_id, None)
    rec, lease.record = lease.record, None
    if rec is not None:
        rec.leases.pop(lease.lease_id, None)


def apply_leases(state: CatalogState, fields: dict[str, Any]) -> None:
    """Bring the live leases named in ``fields`` (id -> the field's stored value, None when it is
    deleted) to what another process committed; others stay as they are."""
    for lease_id, text in fields.items():
        held = state.leases.get(lease_id)
        if text is None:
            if held is not None:
                _unlink(state, held)
            continue
        model, version, reader_id, ttl_s, expires_at, sources = json.loads(_text(text))
        rec = held.record if held is not None else None
        if held is not None and rec is not None and (rec.model, rec.version) == (model, version):
            held.reader_id, held.ttl_s, held.sources = reader_id, ttl_s, tuple(sources)
            state.deadlines.set(held, expires_at)  # a later deadline is followed lazily
            continue
        if held is not None:
            _unlink(state, held)
        _new_lease(state, lease_id, text)
    state.deadlines.take_touched()  # another process's commit: nothing for this one to write


def apply_ended(ended: EndedLeases, fields: dict[str, Any]) -> None:
    """Bring the ended leases named in ``fields`` (id -> stored value, None: dropped) to what
    another process committed, kept oldest first by when they ended (as a full load orders them)."""
    memory = ended.ended
    unordered = False
    for lease_id, text in fields.items():
        if text is None:
            memory.pop(lease_id, None)
            continue
        entry = tuple(json.loads(_text(text)))
        memory.pop(lease_id, None)
        unordered |= bool(memory) and next(reversed(memory.values()))[1] > entry[1]
        memory[lease_id] = entry  # type: ignore[assignment]
    if unordered:
        ended.ended = OrderedDict(sorted(memory.items(), key=lambda item: item[1][1]))


def transplant(old: CatalogState, new: CatalogState) -> None:
    """Carry what ``old`` holds outside its document (live and ended leases, the deadline heap)
    into ``new``, a state just decoded from a newer document, at a cost that does not grow with
    the leases: each version keeps its record object (its leases point at it) with the new
    document's content, and the heap keeps its lease entries (the old sources' entries are
    skipped, the new sources get theirs)."""
    for model, versions in new.models.items():
        kept = old.models.get(model, {})
        for number, rec in versions.items():
            prior = kept.get(number)
            if prior is not None:
                leases = prior.leases
                prior.__dict__.update(rec.__dict__)
                prior.leases = leases
                versions[number] = prior
    for model, versions in old.models.items():
        for number, prior in versions.items():
            if new.models.get(model, {}).get(number) is not prior:  # gone (a version with leases is kept)
                for lease in list(prior.leases.values()):
                    _unlink(old, lease)
    for life in old.sources.values():
        life.dead = True  # its heap entry is skipped; the new document's one replaces it
    new.leases, new.ended_leases, new.deadlines = old.leases, old.ended_leases, old.deadlines
    for life in new.sources.values():
        new.deadlines.set(life, life.expires_at, new=True)
    new.deadlines.take_touched()


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
