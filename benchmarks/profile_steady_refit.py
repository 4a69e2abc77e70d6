"""Where a steady refit's time goes, phase by phase: bench_refit's source process publishes
``--tensors`` separately allocated (or, with ``--flat``, one-buffer) tensors through the embedded
catalog; a receiver process refits each version, under cProfile from ``--profile-from`` on. Per
cycle it prints the receiver's phases, the catalog's time answering ``LeaseVersion`` and the
reply's size; at the end, the Python calls per profiled refit and the top of the profile.

    python benchmarks/profile_steady_refit.py --tensors 10000 --kib 4 --cycles 8
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing as mp
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling bench_refit

import bench_refit  # noqa: E402


def receiver_proc(address: str, model: str, cmd_q, res_q, profile_from: int) -> None:
    from mx_refit.receive.receiver import Receiver

    prof, profiled = cProfile.Profile(), 0
    with Receiver(address, model, device="cpu") as rec:
        while True:
            cmd, _, version = cmd_q.get()
            if cmd == "stop":
                break
            if version >= profile_from:
                prof.enable()
                profiled += 1
            started = time.perf_counter()
            result = rec.refit(version, wait_s=30)
            wall = time.perf_counter() - started
            prof.disable()
            res_q.put(("pulled", {"wall": wall, "phases": dict(result.stats.phase_seconds)}))
    stats = pstats.Stats(prof)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
    res_q.put(("profile", {"calls_per_refit": stats.total_calls / max(profiled, 1), "top": text.getvalue()}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--kib", type=int, default=4, help="bytes of each tensor, in KiB")
    parser.add_argument("--flat", action="store_true", help="views of one buffer, not separate allocations")
    parser.add_argument("--cycles", type=int, default=8)
    parser.add_argument("--profile-from", type=int, default=3, help="first version refitted under cProfile")
    args = parser.parse_args()

    from mx_refit.catalog import servicer
    from mx_refit.catalog.server import start_embedded

    answered: list[tuple[float, int]] = []
    lease_version = servicer.CatalogServicer.LeaseVersion

    def timed(self, request, context):  # the catalog's own time per answer, and the reply's size
        started = time.perf_counter()
        reply = lease_version(self, request, context)
        answered.append((time.perf_counter() - started, reply.ByteSize()))
        return reply

    servicer.CatalogServicer.LeaseVersion = timed
    case = "small" if args.flat else "small-scattered"
    server = start_embedded()
    ctx = mp.get_context("spawn")
    src_q, rec_q, src_res, rec_res = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=bench_refit.source_proc, args=(server.address, "cpu", {case: [args.kib * 1024] * args.tensors},
                                                          args.cycles, src_q, src_res)),
        ctx.Process(target=receiver_proc, args=(server.address, f"bench-{case}", rec_q, rec_res, args.profile_from)),
    ]
    for p in procs:
        p.start()
    try:
        bench_refit._get(src_res, "ready")
        for version in range(1, args.cycles + 1):
            src_q.put(("publish", case, version))
            bench_refit._get(src_res, "published")
            rec_q.put(("pull", case, version))
            got = bench_refit._get(rec_res, "pulled")
            seconds, size = answered[-1]
            print(f"v{version}: whole refit {got['wall'] * 1e3:.2f} ms ("
                  + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in got["phases"].items())
                  + f"); catalog answered LeaseVersion in {seconds * 1e3:.3f} ms, {size} bytes", flush=True)
    finally:
        src_q.put(("stop", None, 0))
        rec_q.put(("stop", None, 0))
    profile = bench_refit._get(rec_res, "profile")
    print(f"Python calls per profiled refit: {profile['calls_per_refit']:.0f}")
    print(profile["top"])
    for p in procs:
        p.join(60)
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
