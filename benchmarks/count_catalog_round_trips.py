"""Redis round trips per catalog store call: socket writes of redis-py's connections (each
write is followed by reading its replies) during a renewal, a lease + release, a lease +
release by a second store on the same Redis right after the first one's commits (its first
call: a full load), and two stores taking turns (each call right after the other's commit).

    python benchmarks/count_catalog_round_trips.py [REPO_ROOT]   # REPO_ROOT: a checkout whose store to count
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # its bench_catalog_store puts ROOT's core/src first

import redis.connection  # noqa: E402
from bench_catalog_store import make_source  # noqa: E402
from redis_server import RedisServer  # noqa: E402

from mx_refit.catalog import CatalogService  # noqa: E402
from mx_refit.catalog.store.redis_store import RedisStore  # noqa: E402

writes = [0]
_send = redis.connection.Connection.send_packed_command


def _counted(self: Any, *args: Any, **kwargs: Any) -> Any:
    writes[0] += 1
    return _send(self, *args, **kwargs)


def count(label: str, call: Callable[[], Any]) -> None:
    writes[0] = 0
    call()
    print(f"{label}: {writes[0]} round trips")


def main() -> None:
    redis.connection.Connection.send_packed_command = _counted  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as workdir:
        server = RedisServer(Path(workdir))
        try:
            first = CatalogService(store=RedisStore(server.url, namespace="rt:"))
            second = CatalogService(store=RedisStore(server.url, namespace="rt:"))
            second.store.ping()  # its connection's handshake is not what is counted
            first.register_source("m", 1, 1, make_source(0, 4, 1), ttl_s=3600)
            mine = first.acquire_lease("m", 1, "reader", ttl_s=3600)
            count("renewal", lambda: first.heartbeat(lease_ids=[mine]))
            count("lease + release", lambda: first.release_lease(first.acquire_lease("m", 1, "r", ttl_s=60)))
            count("lease + release by a second store after the first's commits",
                  lambda: second.release_lease(second.acquire_lease("m", 1, "r", ttl_s=60)))
            count("a renewal by the second store right after the first's renewal",
                  lambda: (first.heartbeat(lease_ids=[mine]), writes.__setitem__(0, 0),
                           second.heartbeat(lease_ids=[mine])))
            count("lease through one store, release through the other (each call one commit behind)",
                  lambda: second.release_lease(first.acquire_lease("m", 1, "r", ttl_s=60)))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
