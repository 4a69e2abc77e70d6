"""The Redis catalog store: the state lives in Redis, so several ``mx-refit serve`` processes
share it and a restarted one loses nothing that was committed.

Layout (``NS`` is the key prefix, ``mx-refit:catalog:`` by default):

* ``NS doc`` — the control document: every version's state, sources' ready flags and
  incarnations, TTL deadlines, counters (:mod:`~mx_refit.catalog.store.codec`).
* ``NS leases`` — a hash, one field per live lease (its version, reader, TTL, deadline, sources):
  a lease's renewal, creation or end writes that field only, so its cost does not grow with the
  number of live leases (the document does not hold them).
* ``NS ended`` — a hash, one field per recently ended lease (``[how, at, ttl]``; the last
  :data:`ENDED_LEASES_KEPT`): a release writes its field (and drops the oldest), not the document.
* ``NS blob:<hash>`` — the large immutable parts (a source's descriptors and agent metadata,
  the encoded sidecar), content-addressed: written once, deleted when no document refers to them.
* ``NS gen`` — ``LINEAGE:TOKEN``: a random lineage made when the key is first written (a flushed
  Redis makes a new one, and so does a document that vanished after a commit), and a random
  token that every commit replaces (``new`` before the first).
* ``NS log`` — the change log: per commit (the last 128), its parent and new token and the
  lease and ended-lease fields it wrote (:mod:`~mx_refit.catalog.store.redis_log`).

Each call is optimistic, on one held connection: ``UNWATCH``, ``WATCH gen``, ``GET gen``, the
change log's last entry, ``TIME`` in one write; if ``gen`` changed since this process last saw it,
apply what the commits since wrote (the change log leads from this process's token to ``gen``;
one commit behind, the entry already read says it all) or else load the document and every lease;
run the call on the Python state, then ``MULTI`` (new blobs, document, touched lease fields, a new
``gen`` token, its log entry, dropped blobs) ``EXEC`` in one write. A concurrent commit aborts the
``EXEC`` and the call runs again on the fresh state. Two round trips per call, also right after
another process's commit (one more when that commit rewrote the document, one or two more when
several commits came between). The cache check compares random tokens, not a counter: a Redis
that rolled back (restarted from an older snapshot) and took other commits since cannot make an
old ``gen`` come back, nor put it in the log, so no process runs on a stale state and overwrites
newer commits.

The store's *epoch* (:attr:`~mx_refit.catalog.store.base.Txn.epoch`) is the Redis server's
``run_id`` (new at every server start and on the replica a failover promotes; read on every new
connection, so a transaction sees the run id of the very server it runs on) with the lineage:
a restart from a snapshot, a failover that lost the replication tail, or a flush all start a new
epoch. A call that changed nothing writes nothing. TTLs use the Redis server's ``TIME``,
so every catalog process agrees on them; each runs the (idempotent) reaper. Waits poll ``gen``
with a bounded backoff, so a release committed by any process wakes them within 50 ms.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.exceptions import RedisError, WatchError

from mx_refit.catalog._records import EndedLeases
from mx_refit.catalog.store import redis_log
from mx_refit.catalog.store.base import CatalogState, CatalogStore, Txn
from mx_refit.catalog.store.codec import StateCodec
from mx_refit.catalog.store.redis_log import lease_text, link_leases
from mx_refit.errors import InvalidArgument, Unavailable

__all__ = ["DEFAULT_NAMESPACE", "RedisStore"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_NAMESPACE = "mx-refit:catalog:"
# Ended leases remembered for "why is my lease gone" (the memory store keeps 65,536), each in a
# field of ``NS ended``; a reload reads them all.
ENDED_LEASES_KEPT = 1024
_MAX_ATTEMPTS = 200  # optimistic retries of one call under contention
_POLL_MAX_S = 0.05
_NEW = "new"  # the token of a lineage that has no document yet


class _CacheKept(WatchError):
    """A commit landed while this process read what changed: run the call again, on the cached
    state as it was (nothing was applied to it)."""


def _fresh_state() -> CatalogState:
    return CatalogState(ended_leases=EndedLeases(keep=ENDED_LEASES_KEPT, changes={}))


class RedisStore(CatalogStore):
    """Catalog state in Redis (``redis://HOST:PORT/DB``).

    :param clock: seconds for every TTL; None (the default) uses the Redis server's ``TIME``,
        which every catalog process on the same Redis shares. Tests inject a fake clock.
    :param namespace: key prefix; catalogs with different prefixes share a Redis independently.
    :param timeout_s: socket timeout of every Redis command.
    """

    def __init__(
        self,
        url: str,
        *,
        clock: Callable[[], float] | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        timeout_s: float = 5.0,
    ) -> None:
        self.url = url
        self._redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=10,
            redis_connect_func=_learn_run_id,
        )
        self._clock = clock
        self._gen_key = f"{namespace}gen"
        self._doc_key = f"{namespace}doc"
        self._leases_key = f"{namespace}leases"
        self._ended_key = f"{namespace}ended"
        self._log_key = f"{namespace}log"
        self._codec = StateCodec(blob_prefix=f"{namespace}blob:")
        self._cond = threading.Condition(threading.Lock())  # serialises this process's calls
        self._state: CatalogState | None = None  # as of ``_generation``; None: load it
        self._generation = ""  # the ``gen`` value the cached state was loaded or committed at
        self._document = ""
        self._blob_keys: set[str] = set()  # blobs the document at ``_generation`` refers to
        # How this process brought its cache up to another process's commits (tests, benchmarks).
        self.reloads = {"full": 0, "incremental": 0}

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"

    def ping(self) -> None:
        """Raise :class:`~mx_refit.errors.Unavailable` unless Redis answers."""
        try:
            self._redis.ping()
        except RedisError as exc:
            raise Unavailable(f"catalog store {self.url}: {exc}") from None

    def check_settings(self) -> list[str]:
        """Check the Redis settings the store relies on (at ``mx-refit serve``'s start); return
        the warnings, each naming its setting, after logging them.

        Refused (``InvalidArgument``): a ``maxmemory-policy`` that evicts keys without a TTL
        (``allkeys-*``): the catalog's keys could vanish without the epoch changing. Warned:
        settings under which a Redis restart or failover loses committed writes (no AOF, an AOF
        not synced every second, no replica acknowledging writes). Those stay safe (a lost write
        starts a new epoch: publishers register again, drains hold the lease fence) but cost a
        fence per restart, and without persistence every version is published again.
        """
        try:
            config = {k: str(v) for k, v in self._redis.config_get("*").items()}
        except RedisError as exc:  # managed Redis services often refuse CONFIG
            message = (f"catalog store {self.url}: could not read the Redis settings ({exc}); make sure "
                       "maxmemory-policy is noeviction or volatile-*, and appendonly yes (RELIABILITY.md)")
            logger.warning(message)
            return [message]
        policy = config.get("maxmemory-policy", "noeviction")
        if policy.startswith("allkeys"):
            raise InvalidArgument(
                f"store: Redis at {self.url} has maxmemory-policy {policy}: it may evict the catalog's keys and "
                "silently lose leases; set maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction)"
            )
        warnings = []
        if config.get("appendonly") != "yes":
            kept = f"its last RDB snapshot (save {config.get('save')!r})" if config.get("save") else "nothing"
            warnings.append(f"appendonly {config.get('appendonly')!r}: a Redis restart keeps {kept}, losing "
                            "the catalog's later writes; set appendonly yes")
        elif config.get("appendfsync") not in ("always", "everysec"):
            warnings.append(f"appendfsync {config.get('appendfsync')!r}: a host crash loses unsynced writes; "
                            "set appendfsync everysec (or always)")
        replicas = int(self._redis.info("replication").get("connected_slaves", 0) or 0)
        if replicas and int(config.get("min-replicas-to-write", "0") or 0) == 0:
            warnings.append("min-replicas-to-write 0 with replicas: a failover loses writes no replica got; "
                            "set min-replicas-to-write 1")
        for warning in warnings:
            logger.warning("catalog store %s: %s (each such loss starts a new catalog epoch: publishers "
                           "register again and drains hold the lease fence)", self.url, warning)
        return warnings

    def close(self) -> None:
        self._redis.close()

    def run(self, body: Callable[[Txn], T]) -> T:
        with self._cond:
            for attempt in range(_MAX_ATTEMPTS):
                try:
                    return self._attempt(body)
                except WatchError as exc:  # another process committed first: run again on its state
                    if not isinstance(exc, _CacheKept):  # else the cache is as it was, still valid
                        self._state = None
                    time.sleep(random.uniform(0, min(0.001 * 2**attempt, 0.02)))
                except Unavailable:
                    self._state = None
                    raise
                except (RedisError, OSError) as exc:  # down, restarting, unreachable: clients retry
                    self._state = None
                    raise Unavailable(f"catalog store {self.url}: {exc}") from None
                except BaseException:
                    self._state = None  # the call may have changed it half-way: reload
                    raise
            raise Unavailable(
                f"catalog store {self.url}: gave up after {_MAX_ATTEMPTS} attempts lost to "
                "concurrent writers"
            )

    def _attempt(self, body: Callable[[Txn], T]) -> T:
        # One held connection, the transaction framed by hand so that a call costs two round
        # trips: (UNWATCH, WATCH gen, GET gen, LINDEX log -1, TIME) and (MULTI ... EXEC);
        # redis-py's WATCH pipeline sends each of the first ones on its own.
        conn = _pooled_connection(self._redis.connection_pool)
        try:
            return self._attempt_on(conn, body)
        except BaseException:
            if getattr(conn, "mx_refit_pending", False):  # failed mid-batch: replies left unread
                conn.disconnect()
            raise  # else (the body refused, a lost race) it is clean: the next UNWATCH drops the WATCH
        finally:
            self._redis.connection_pool.release(conn)

    def _attempt_on(self, conn: Any, body: Callable[[Txn], T]) -> T:
        # The log's last entry too: after one commit by another process, all it takes to catch up.
        reads: list[tuple[Any, ...]] = [("UNWATCH",), ("WATCH", self._gen_key), ("GET", self._gen_key),
                                        ("LINDEX", self._log_key, -1)]
        if self._clock is None:
            reads.append(("TIME",))
        replies = _batch(conn, reads, check_health=True)  # the one place a health check may reconnect
        raw = replies[2]
        if raw is None:  # a new (or flushed) store: start a lineage, then run on it
            _batch(conn, [("UNWATCH",), ("SET", self._gen_key, f"{uuid.uuid4().hex[:16]}:{_NEW}", "NX")])
            raise WatchError("the store's lineage was just created")
        generation = _text(raw)
        lineage = generation.partition(":")[0]
        epoch = f"{_run_id(conn)}.{lineage}"
        if self._clock is not None:
            now = self._clock()
        else:
            seconds, micros = replies[4]
            now = int(seconds) + int(micros) / 1e6
        if self._state is None or generation != self._generation:
            if self._state is None or not self._catch_up(conn, generation, replies[3]):
                self._load(conn, generation)
        assert self._state is not None
        txn = Txn(self._state, now, generation, epoch=epoch)
        result = body(txn)
        touched = self._state.deadlines.take_touched()
        ended_changes = self._state.ended_leases.take_changes()
        document, blobs = self._codec.encode(self._state)
        if document == self._document and not touched and not ended_changes:
            return result  # nothing changed: nothing to write (the next call's UNWATCH clears the WATCH)
        keys = set(blobs)
        committed = f"{lineage}:{uuid.uuid4().hex}"
        live: dict[Any, Any] = {lease.lease_id: lease_text(lease) for lease in touched if not lease.dead}
        ended = {lease.lease_id for lease in touched if lease.dead} - set(live)
        writes: list[tuple[Any, ...]] = [("SET", key, blobs[key]) for key in keys - self._blob_keys]
        if document != self._document:
            writes.append(("SET", self._doc_key, document))
        if ended:
            writes.append(("HDEL", self._leases_key, *ended))
        if live:
            writes.append(("HSET", self._leases_key, *(x for item in live.items() for x in item)))
        gone = [lease_id for lease_id, entry in ended_changes.items() if entry is None]
        if gone:
            writes.append(("HDEL", self._ended_key, *gone))
        ended_texts = {lease_id: None if entry is None else json.dumps(entry)
                       for lease_id, entry in ended_changes.items()}
        if len(gone) < len(ended_changes):
            writes.append(("HSET", self._ended_key, *(x for lease_id, text in ended_texts.items()
                                                       if text is not None for x in (lease_id, text))))
        writes.append(("SET", self._gen_key, committed))
        entry = redis_log.log_entry(generation, committed, document != self._document,
                                    {**dict.fromkeys(ended), **live}, ended_texts)
        writes += [("RPUSH", self._log_key, entry), ("LTRIM", self._log_key, -redis_log.LOG_KEPT, -1)]
        stale = self._blob_keys - keys
        if stale:
            writes.append(("DEL", *stale))
        if _batch(conn, [("MULTI",), *writes, ("EXEC",)])[-1] is None:
            raise WatchError("another process committed first")
        self._generation, self._document, self._blob_keys = committed, document, keys
        self._cond.notify_all()
        return result

    def _load(self, conn: Any, generation: str) -> None:
        # The document and the leases as of one instant (MULTI/EXEC: no commit lands between
        # them), then the WATCH again (EXEC dropped it) and gen, which must still be the same.
        replies = _batch(conn, [("MULTI",), ("GET", self._doc_key), ("HGETALL", self._leases_key),
                                ("HGETALL", self._ended_key), ("EXEC",),
                                ("WATCH", self._gen_key), ("GET", self._gen_key)])
        snapshot, now_at = replies[4], replies[6]
        if snapshot is None or now_at is None or _text(now_at) != generation:
            raise WatchError("a commit landed while the state was loading")  # no torn state
        raw, lease_fields, ended_fields = snapshot
        if raw is None and not generation.endswith(f":{_NEW}"):
            # Committed once, now gone (deleted, evicted): whatever it held was lost, so the
            # state starts again under a new lineage, and with it a new epoch.
            logger.warning("catalog store %s: the catalog document vanished; starting a new epoch", self.url)
            _batch(conn, [("MULTI",), ("SET", self._gen_key, f"{uuid.uuid4().hex[:16]}:{_NEW}"),
                          ("DEL", self._leases_key, self._ended_key, self._log_key), ("EXEC",)])
            raise WatchError("the catalog's document vanished")
        if raw is None:
            self._state, self._document, self._blob_keys = _fresh_state(), "", set()
            self._state.deadlines.track_leases = True
        else:
            document = _text(raw)
            state, self._blob_keys = self._decode(conn, document, generation)
            link_leases(state, _pairs(lease_fields))
            state.ended_leases = _ended_leases(_pairs(ended_fields))
            self._state, self._document = state, document
        self._generation = generation
        self.reloads["full"] += 1

    def _decode(self, conn: Any, document: str, generation: str) -> tuple[CatalogState, set[str]]:
        """The state ``document`` holds (without its leases), fetching the blobs this process has
        not decoded yet, and the keys of every blob it refers to."""
        keys = self._codec.blob_keys(document)
        missing = [k for k in keys if k not in self._codec.cached_blobs()]
        texts: dict[str, Any] = {}
        if missing:
            values, now_at = _batch(conn, [("MGET", *missing), ("GET", self._gen_key)])
            if now_at is None or _text(now_at) != generation:
                raise WatchError("a commit landed (and may have dropped blobs) while the state was loading")
            texts = dict(zip(missing, values, strict=True))
        lost = [k for k, v in texts.items() if v is None]
        if lost:
            raise Unavailable(f"catalog store {self.url}: the document refers to missing blobs {lost[:3]}")
        state = self._codec.decode(document, {k: _text(v) for k, v in texts.items()})
        if not isinstance(state, CatalogState):
            raise Unavailable(f"catalog store {self.url}: {self._doc_key} holds no catalog state")
        return state, set(keys)

    def _catch_up(self, conn: Any, generation: str, last: Any) -> bool:
        """Bring the cached state from ``_generation`` to ``generation`` with what the commits in
        between wrote (:mod:`~mx_refit.catalog.store.redis_log`; ``last``: the log's last entry,
        read with ``gen``); False, changing nothing, when the log does not lead there (the caller
        loads everything)."""
        assert self._state is not None
        changes = redis_log.chain([last] if last is not None else [], self._generation, generation)
        if changes is None:  # more than one commit behind: the log's tail, else all of it
            tail = _batch(conn, [("LRANGE", self._log_key, -redis_log.LOG_TAIL, -1)])[0]
            changes = redis_log.chain(tail, self._generation, generation)
            if changes is None and len(tail) >= redis_log.LOG_TAIL:
                whole = _batch(conn, [("LRANGE", self._log_key, 0, -1)])[0]
                changes = redis_log.chain(whole, self._generation, generation)
        if changes is None:
            return False
        state = self._state
        if changes.document:
            # As of ``generation`` under the WATCH (a commit since makes EXEC nil), then WATCH again.
            replies = _batch(conn, [("MULTI",), ("GET", self._doc_key), ("EXEC",), ("WATCH", self._gen_key),
                                    ("GET", self._gen_key)])
            values, now_at = replies[2], replies[4]
            if values is None or now_at is None or _text(now_at) != generation:
                raise _CacheKept("a commit landed while the document was read")
            if values[0] is None:
                return False  # the document vanished: the full load starts a new lineage
            document = _text(values[0])
            try:
                fresh, blob_keys = self._decode(conn, document, generation)
            except WatchError:
                raise _CacheKept("a commit landed while the document's blobs were read") from None
            redis_log.transplant(state, fresh)
            state, self._document, self._blob_keys = fresh, document, blob_keys
        redis_log.apply_leases(state, changes.leases)
        redis_log.apply_ended(state.ended_leases, changes.ended)
        self._state, self._generation = state, generation
        self.reloads["incremental"] += 1
        return True

    def wait_for_change(self, generation: object, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        step = 0.002
        while True:
            with self._cond:  # commits of this process wake it at once
                remaining = deadline - time.monotonic()
                if self._generation != generation or remaining <= 0:
                    return
                self._cond.wait(min(step, remaining))
            try:
                raw = self._redis.get(self._gen_key)
                if raw is None or (raw.decode() if isinstance(raw, bytes) else raw) != generation:
                    return  # another process committed
            except (RedisError, OSError) as exc:
                raise Unavailable(f"catalog store {self.url}: {exc}") from None
            step = min(step * 2, _POLL_MAX_S)


def _learn_run_id(connection: Any) -> None:
    """Connect callback: the usual handshake, then remember the server's ``run_id`` on the
    connection (a reconnect runs this again, so it always names the server at the other end)."""
    connection.on_connect()
    connection.send_command("INFO", "server")
    info = connection.read_response()
    text = info.decode() if isinstance(info, bytes) else str(info)
    run_id = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("run_id:")), "")
    connection.mx_refit_run_id = run_id or uuid.uuid4().hex  # no run_id: assume a new server


def _run_id(conn: Any) -> str:
    """The run id of the server ``conn`` talks to (first 16 hex digits)."""
    run_id = getattr(conn, "mx_refit_run_id", None)
    if run_id is None:  # connected without the callback (should not happen): a new server, say
        run_id = conn.mx_refit_run_id = uuid.uuid4().hex
    return str(run_id)[:16]


def _batch(conn: Any, commands: list[tuple[Any, ...]], *, check_health: bool = False) -> list[Any]:
    """Send ``commands`` in one write and read their replies: one round trip. Only the first
    batch of an attempt may run the health check, which can reconnect (and so drop a WATCH)."""
    conn.mx_refit_pending = True
    conn.send_packed_command(conn.pack_commands(commands), check_health=check_health)
    replies = []
    for _ in commands:
        replies.append(conn.read_response())  # an error reply raises; the caller disconnects
    conn.mx_refit_pending = False
    return replies


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _pairs(reply: Any) -> list[tuple[Any, Any]]:
    """HGETALL's reply as pairs: a flat list under RESP2, a map under RESP3."""
    if isinstance(reply, dict):
        return list(reply.items())
    return list(zip(reply[::2], reply[1::2], strict=True))


def _ended_leases(fields: list[tuple[Any, Any]]) -> EndedLeases:
    """The stored ended leases, oldest first (by when they ended), noting changes from now on."""
    entries = sorted(((_text(lease_id), tuple(json.loads(text))) for lease_id, text in fields), key=lambda e: e[1][1])
    return EndedLeases(keep=ENDED_LEASES_KEPT, ended=OrderedDict(entries), changes={})


def _pooled_connection(pool: Any) -> Any:
    """A connection from ``pool``: redis-py before 5.3 requires a command name here (the
    floors pin 5.0), later versions deprecate passing one."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("MULTI")
