"""What an idle NIXL agent costs, and whether its progress setting changes the pull.

    python benchmarks/bench_idle.py                       # busy poll vs 20 ms wake-up, DRAM
    python benchmarks/bench_idle.py --modes busy,20,off --mib 256 --out idle.json

For each mode, one source process registers ``--mib`` of DRAM and one reader process (another
NIXL agent) connects to it; both are then measured idle for ``--idle-s`` seconds (utime + stime
from ``/proc/<pid>/stat``, as a fraction of one core), the reader pulls the whole buffer
``--pulls`` times (every byte checked on the last pull), and both are measured idle again (now
with a live connection). Modes: ``busy`` = NIXL's Python default (progress thread with
``pthrDelay=0``), a number = the progress thread's wake-up period in ms
(``NixlTransport(progress_wake_ms=...)``), ``off`` = no progress thread in either process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from typing import Any

MIB = 1 << 20


def _wake_ms(mode: str) -> float | None:
    if mode == "busy":
        return 0.0
    return None if mode == "off" else float(mode)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cores(pids: list[int], seconds: float) -> list[float]:
    before = [cpu_seconds(p) for p in pids]
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    return [(cpu_seconds(p) - b) / elapsed for p, b in zip(pids, before)]


def _pattern(nbytes: int) -> Any:
    import torch

    return (torch.arange(nbytes // 8, dtype=torch.int64) * 2654435761).view(torch.uint8)


def source_proc(conn: Any, mode: str, nbytes: int) -> None:
    from mx_refit.transport.nixl import NixlTransport

    transport = NixlTransport(f"idle-src-{os.getpid()}", progress_wake_ms=_wake_ms(mode))
    buf = _pattern(nbytes)
    transport.register(buf)
    conn.send({"agent": transport.agent_name, "metadata": transport.metadata(), "addr": buf.data_ptr()})
    conn.recv()  # "exit"
    transport.close()


def reader_proc(conn: Any, mode: str, nbytes: int, timeout_s: float) -> None:
    import torch

    from mx_refit.errors import TransferError
    from mx_refit.transport.nixl import NixlTransport

    transport = NixlTransport(f"idle-rd-{os.getpid()}", progress_wake_ms=_wake_ms(mode), max_retries=0,
                              timeout_s=timeout_s)
    arena = torch.zeros(nbytes, dtype=torch.uint8)
    transport.register(arena)
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            break
        _, source, pulls = cmd
        transport.connect("src", source["agent"], source["metadata"])
        seconds, error = [], None
        for _ in range(pulls):
            arena.zero_()
            t = time.perf_counter()
            try:
                transport.read("src", [(source["addr"], arena.data_ptr(), nbytes)])
            except TransferError as exc:
                error = str(exc)[:300]
                break
            seconds.append(time.perf_counter() - t)
        identical = error is None and bool(torch.equal(arena, _pattern(nbytes)))
        conn.send({"seconds": seconds, "error": error, "identical": identical})
    transport.close()


def run_mode(mode: str, nbytes: int, pulls: int, idle_s: float, timeout_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    src_conn, src_child = ctx.Pipe()
    rd_conn, rd_child = ctx.Pipe()
    src = ctx.Process(target=source_proc, args=(src_child, mode, nbytes), daemon=True)
    rd = ctx.Process(target=reader_proc, args=(rd_child, mode, nbytes, timeout_s), daemon=True)
    src.start()
    rd.start()
    try:
        source = src_conn.recv()
        assert rd_conn.recv() == "ready"
        time.sleep(1.0)  # let start-up settle
        idle_before = idle_cores([src.pid, rd.pid], idle_s)
        rd_conn.send(("pull", source, pulls))
        pulled = rd_conn.recv()
        time.sleep(0.5)
        idle_after = idle_cores([src.pid, rd.pid], idle_s)
        rd_conn.send(("exit",))
        src_conn.send("exit")
    finally:
        for p in (rd, src):
            p.join(30)
            if p.is_alive():
                p.kill()
    secs = pulled["seconds"]
    return {
        "mode": mode,
        "idle_cores_source": idle_before[0], "idle_cores_reader": idle_before[1],
        "idle_cores_source_connected": idle_after[0], "idle_cores_reader_connected": idle_after[1],
        "pulls_ok": len(secs), "pull_error": pulled["error"], "identical": pulled["identical"],
        "pull_best_gbps": nbytes / min(secs) / 1e9 if secs else 0.0,
        "pull_median_gbps": nbytes / statistics.median(secs) / 1e9 if secs else 0.0,
        "pull_seconds": secs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="busy,20", help="comma separated: busy, off, or a wake-up period in ms")
    parser.add_argument("--mib", type=int, default=256, help="bytes pulled per READ, MiB")
    parser.add_argument("--pulls", type=int, default=10)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--timeout-s", type=float, default=20.0, help="per-READ timeout (the 'off' mode may hang)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    results: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "load_before": os.getloadavg()},
        "modes": [],
    }
    print(f"{'mode':>6} | idle cores src / reader | connected, idle src / reader | pull best / median GB/s | ok")
    for mode in args.modes.split(","):
        r = run_mode(mode, args.mib * MIB, args.pulls, args.idle_s, args.timeout_s)
        results["modes"].append(r)
        print(f"{mode:>6} | {r['idle_cores_source']:.3f} / {r['idle_cores_reader']:.3f} | "
              f"{r['idle_cores_source_connected']:.3f} / {r['idle_cores_reader_connected']:.3f} | "
              f"{r['pull_best_gbps']:.2f} / {r['pull_median_gbps']:.2f} | "
              f"{r['pulls_ok']}/{args.pulls} identical={r['identical']} {r['pull_error'] or ''}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["identical"] for r in results["modes"] if r["mode"] != "off") else 1


if __name__ == "__main__":
    sys.exit(main())
