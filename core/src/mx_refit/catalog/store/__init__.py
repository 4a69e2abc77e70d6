"""Where the catalog keeps its state: in memory (the default) or in Redis.

``open_store("memory")`` or ``open_store("redis://HOST:PORT/DB")``; the Redis store needs the
``mx-refit[redis]`` extra and is imported only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from mx_refit.catalog.store.base import TRANSIENT, CatalogState, CatalogStore, Txn
from mx_refit.catalog.store.memory import MemoryStore
from mx_refit.errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.catalog.store.redis_store import RedisStore

__all__ = ["TRANSIENT", "CatalogState", "CatalogStore", "MemoryStore", "RedisStore", "Txn", "check_store_url",
           "open_store"]


def check_store_url(url: object, field: str = "store") -> str:
    """``url`` when it names a store (``memory``, ``redis://HOST[:PORT][/DB]``, ``rediss://``
    for TLS, or ``unix:///PATH/TO/redis.sock``), else
    ``InvalidArgument`` naming ``field`` and the value."""
    if not isinstance(url, str) or not url:
        raise InvalidArgument(f"{field}: must be 'memory' or 'redis://HOST:PORT/DB', got {url!r}")
    if url == "memory":
        return url
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise InvalidArgument(f"{field}: {url!r} is neither 'memory' nor a redis:// URL (redis://HOST:PORT/DB)")
    try:
        port = parts.port
    except ValueError:
        raise InvalidArgument(f"{field}: {url!r} has a bad port (redis://HOST:PORT/DB)") from None
    if parts.scheme == "unix":
        if not parts.path:
            raise InvalidArgument(f"{field}: {url!r} names no socket path (unix:///PATH/TO/redis.sock)")
        return url
    if not parts.hostname:
        raise InvalidArgument(f"{field}: {url!r} names no host (redis://HOST:PORT/DB)")
    if port == 0:
        raise InvalidArgument(f"{field}: {url!r} has port 0 (redis://HOST:PORT/DB)")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise InvalidArgument(f"{field}: {url!r} has database {db!r}, not a number (redis://HOST:PORT/DB)")
    return url


def open_store(url: str = "memory", *, field: str = "store", clock: Callable[[], float] | None = None,
               **kwargs: Any) -> CatalogStore:
    """The store ``url`` names (see :func:`check_store_url`); ``kwargs`` go to the Redis store.

    ``clock``: the memory store's clock (default monotonic); for Redis, None uses the Redis
    server's TIME, so every catalog process on it agrees on every TTL.
    """
    url = check_store_url(url, field)
    if url == "memory":
        return MemoryStore(clock) if clock is not None else MemoryStore()
    from mx_refit.catalog.store.redis_store import RedisStore

    return RedisStore(url, clock=clock, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "RedisStore":
        from mx_refit.catalog.store.redis_store import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
