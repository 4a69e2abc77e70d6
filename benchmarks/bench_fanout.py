"""Tree fan-out: 1 trainer -> R receivers on DRAM, every process its own NIXL agent.

    python benchmarks/bench_fanout.py                        # R=7, 128 MiB, 3 rounds
    python benchmarks/bench_fanout.py --receivers 7 --mib 256 --rounds 5 --out fanout.json

One trainer process publishes ``--mib`` of float32 tensors (one source, full tensors); R receiver
processes each hold two ``Receiver`` s (each with its own NIXL agent and arena): one with
``fanout: none`` and one with ``fanout: tree`` and ``max_readers_per_source: 1``. The catalog is
embedded in this process (gRPC on 127.0.0.1). Every receiver first refits once in both modes
(connections, registrations), then each round measures, on a fresh version each time:

- ``one``: one receiver alone pulls from the trainer (the single-transfer time T1, its refit
  call's wall time);
- ``none``: all R receivers start together (a shared start time) and each pulls everything
  from the trainer; wall = last end - start;
- ``tree``: all R start together with ``fanout: tree`` and a cap of 1 reader per source: the
  first pulls from the trainer and then serves as a replica, the others wait for a free holder;
  wall = last end - start. Ideal: ceil(log2(R + 1)) x T1.

Every receiver checks every byte against the trainer's values in one more, untimed round of each
mode. The ratios are
what to read on a shared machine; absolute times move with its load.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from typing import Any

MIB = 1 << 20
TENSORS = 16


def _tensors(nbytes: int, seed: int) -> dict[str, Any]:
    import torch

    per = nbytes // TENSORS // 4
    return {f"layer{i}.weight": torch.full((per,), float(seed * 100 + i)) for i in range(TENSORS)}


def trainer_proc(conn: Any, address: str, model: str, nbytes: int) -> None:
    from mx_refit.publisher import Publisher
    from mx_refit.types import MeshPosition, PublishedTensor

    pub = Publisher(address, model, mesh=MeshPosition(), expected_sources=1, ttl_s=60.0)
    live = _tensors(nbytes, 0)
    published = [PublishedTensor(name, t) for name, t in live.items()]
    conn.send("ready")
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            break
        version = arg
        if version > 1:
            pub.wait_drained(version - 1, timeout_s=300)
        for name, fresh in _tensors(nbytes, version).items():  # mutated in place, like a trainer
            live[name].copy_(fresh)
        pub.publish(version, published)
        conn.send("published")
    pub.close()


def receiver_proc(conn: Any, address: str, model: str, nbytes: int) -> None:
    from mx_refit.receive.receiver import Receiver

    receivers = {
        "none": Receiver(address, model, fanout="none", lease_ttl_s=120),
        "tree": Receiver(address, model, fanout="tree", max_readers_per_source=1, lease_ttl_s=120),
    }
    conn.send("ready")
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            break
        mode, version, start_at, check = arg
        time.sleep(max(0.0, start_at - time.time()))
        began = time.time()
        result = receivers[mode].refit(version, wait_s=120)
        ended = time.time()
        ok = None
        if check:
            want = _tensors(nbytes, version)
            ok = all(bool((t == want[n]).all()) for n, t in result.tensors)
        conn.send((began, ended, result.stats.replicas_read, ok))
    for rec in receivers.values():
        rec.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--receivers", type=int, default=7)
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from mx_refit.catalog.server import start_embedded

    nbytes = args.mib * MIB
    server = start_embedded()
    model = f"fanout-bench-{os.getpid()}"
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for target, extra in [(trainer_proc, ())] + [(receiver_proc, ())] * args.receivers:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, server.address, model, nbytes, *extra), daemon=True)
        proc.start()
        conns.append(parent)
        procs.append(proc)
    for c in conns:
        assert c.recv() == "ready"
    trainer, readers = conns[0], conns[1:]
    version = 0

    def publish() -> int:
        nonlocal version
        version += 1
        trainer.send(("publish", version))
        assert trainer.recv() == "published"
        return version

    def together(mode: str, who: list[Any], check: bool = False) -> tuple[float, list[Any]]:
        v = publish()
        start_at = time.time() + 0.5
        for c in who:
            c.send(("refit", (mode, v, start_at, check)))
        replies = [c.recv() for c in who]
        return max(end for _, end, _, _ in replies) - start_at, replies

    for mode in ("none", "tree"):  # warm-up: connections, arenas, registrations
        for c in readers:
            together(mode, [c])
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        _, (one,) = together("none", readers[:1])
        t1 = one[1] - one[0]
        none_wall, _ = together("none", readers)
        tree_wall, tree_replies = together("tree", readers)
        rounds.append({
            "one_s": t1, "none_wall_s": none_wall, "tree_wall_s": tree_wall,
            "tree_replicas_read": sum(rep[2] for rep in tree_replies),
        })
        print(json.dumps(rounds[-1]), flush=True)
    # Every byte checked in a last, untimed round of each mode (the checks would compete for
    # the cores with the transfers still running).
    checked = [rep[3] for mode in ("none", "tree") for rep in together(mode, readers, True)[1]]
    for c in conns:
        c.send(("stop", None))
    for p in procs:
        p.join(30)
    server.stop(0)

    levels = math.ceil(math.log2(args.receivers + 1))
    t1 = statistics.median(r["one_s"] for r in rounds)
    none_wall = statistics.median(r["none_wall_s"] for r in rounds)
    tree_wall = statistics.median(r["tree_wall_s"] for r in rounds)
    summary = {
        "receivers": args.receivers, "mib": args.mib, "rounds": args.rounds, "levels": levels,
        "one_transfer_s": t1, "ideal_tree_s": levels * t1, "tree_wall_s": tree_wall, "none_wall_s": none_wall,
        "tree_vs_ideal": tree_wall / (levels * t1), "tree_vs_none": tree_wall / none_wall,
        "none_vs_one": none_wall / t1, "bytes_ok": all(checked),
        "machine": f"{platform.node()} {os.cpu_count()} cores, Python {sys.version.split()[0]}",
        "rounds_detail": rounds,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds_detail"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
