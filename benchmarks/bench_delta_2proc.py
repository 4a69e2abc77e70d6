"""Delta against full refits of a multi-GB model, trainer and receivers in two processes over real
NIXL DRAM (issue 24): per step the wire bytes and whole-refit time of each, 0 mismatches.

    python benchmarks/bench_delta_2proc.py --gb 5 --steps 6 --out benchmarks/results/delta_2proc_cpu.json
    python benchmarks/bench_delta_2proc.py --device cuda --gb 5 --steps 6 --out delta_2proc_h200.json  # colocated

The trainer process holds the model's BF16 tensors (64 MiB each, bf16) and publishes every
version with ``delta="auto"``; the receiving process holds two receivers: ``delta``
(``delta="on"``: every version whose base it provably holds comes as a delta, and the estimate
``delta: auto`` would choose from is reported beside it) and ``full`` (a plain full refit, the
baseline). After every refit each of the delta receiver's tensors is compared byte for byte with
the full receiver's.

The change per step is the one ``bench_delta_fraction.py`` recorded on a real mixed-precision Adam
run at the chosen learning rate (``benchmarks/results/delta_fraction.json``, steady steps 13-25, in
turn): that fraction of the elements, drawn at random, moves by one BF16 step (the low byte; a
carry into the high byte as often as it happens), which is what rounding FP32 masters into BF16
does at RL learning rates. (Running the FP32 masters and Adam themselves would need 16 bytes a
parameter more than this machine has for a 5 GB model.)

torch runs on one thread in both processes (``--threads``): on a host whose cores other work
shares, two OpenMP threads stall each other.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import sys
import time
import uuid
from pathlib import Path

MIB = 1 << 20
ROWS, COLS = 8192, 4096  # 64 MiB of BF16 per tensor


def fractions(lr: str) -> list[float]:
    data = json.loads((Path(__file__).parent / "results" / "delta_fraction.json").read_text())
    return [s["changed_fraction"] for s in data["runs"][lr]["steps"] if s["step"] >= 13]


def trainer(address: str, model: str, args: dict, conn) -> None:
    """The publishing process: builds the model, then per ("step", version, fraction) changes it
    and publishes; replies ("published", seconds, changed elements)."""
    import torch

    from mx_refit.delta.tracker import DeltaTracker
    from mx_refit.publisher import Publisher

    torch.set_num_threads(args["threads"])
    device = args["device"]
    gen = torch.Generator(device=device).manual_seed(0)
    count = max(1, int(args["gb"] * 1e9) // (ROWS * COLS * 2) + (int(args["gb"] * 1e9) % (ROWS * COLS * 2) > 0))
    weights = {f"layers.{i}.weight": (torch.randn(ROWS, COLS, generator=gen, device=device) * 0.02).to(torch.bfloat16)
               for i in range(count)}
    try:
        with Publisher(address, model, delta="auto", delta_anchor_every=10_000) as pub:
            # records of ~2.5% of the model: a buffer of 5% of it (the default 1/8 does not fit beside
            # two arenas of 5 GB on this machine)
            pub._delta = DeltaTracker(10_000, capacity_fraction=args["capacity"])
            conn.send(("ready", sum(w.numel() * 2 for w in weights.values())))
            while True:
                kind, version, fraction = conn.recv()
                if version > 1:
                    pub.wait_drained(version - 1)  # the receivers are done with it: the buffers may change
                if kind == "stop":
                    break
                changed = 0
                for w in weights.values():
                    if fraction:
                        flat = w.view(-1).view(torch.int16)
                        k = int(flat.numel() * fraction)
                        index = torch.randint(flat.numel(), (k,), generator=gen, device=device)
                        flat[index] += 1 - 2 * torch.randint(2, (k,), generator=gen, device=device, dtype=torch.int16)
                        changed += k
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                start = time.perf_counter()
                pub.publish(version, model=weights)
                conn.send(("published", time.perf_counter() - start, changed, pub._delta.snapshot_bytes,
                           pub._delta.records.numel()))
    except BaseException as exc:  # the parent reads it and fails loudly
        conn.send(("error", repr(exc)))
        raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gb", type=float, default=5.0, help="model size in 10^9 bytes")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", default="1e-06", help="which recorded run of delta_fraction.json")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--capacity", type=float, default=0.05, help="record buffer, a fraction of the model")
    parser.add_argument("--check-arena", type=int, default=1, help="0: Receiver(delta_check_arena=False)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import torch

    from mx_refit.catalog.server import start_embedded
    from mx_refit.receive.receiver import Receiver

    torch.set_num_threads(args.threads)
    steps = fractions(args.lr)
    server = start_embedded()
    model = f"delta2p-{uuid.uuid4().hex[:6]}"
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=trainer, args=(server.address, model, vars(args), child), daemon=True)
    proc.start()
    rows = []
    try:
        kind, nbytes = conn.recv()
        assert kind == "ready", nbytes
        print(f"model {nbytes / 1e9:.2f} GB in {nbytes // (ROWS * COLS * 2)} tensors", flush=True)
        with Receiver(server.address, model, delta="on", delta_check_arena=bool(args.check_arena),
                      device=args.device) as delta, Receiver(server.address, model, device=args.device) as full:
            for step in range(args.steps + 1):
                fraction = steps[(step - 1) % len(steps)] if step else 0.0
                conn.send(("step", step + 1, fraction))
                reply = conn.recv()
                if reply[0] != "published":
                    raise RuntimeError(f"trainer: {reply}")
                _, publish_s, changed, snapshot, record_buffer = reply
                row = {"version": step + 1, "fraction": fraction, "changed_elements": changed, "publish_s": publish_s,
                       "tracker_snapshot_bytes": snapshot, "tracker_record_buffer_bytes": record_buffer}
                results = {}
                for label, rec in (("delta", delta), ("full", full)):
                    start = time.perf_counter()
                    result = rec.refit(step + 1)
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    results[label] = result
                    row[label] = {"seconds": time.perf_counter() - start, "bytes_pulled": result.stats.bytes_pulled,
                                  "kind": result.stats.kind, "phases": result.stats.phase_seconds,
                                  "delta_refused": result.stats.delta_refused,
                                  "full_estimate_s": result.stats.full_estimate_s,
                                  "delta_estimate_s": result.stats.delta_estimate_s}
                got, want = dict(results["delta"].tensors), dict(results["full"].tensors)
                row["mismatches"] = sum(not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want)
                rows.append(row)
                d, f = row["delta"], row["full"]
                print(f"v{step + 1}: changed {fraction:.3%}, {d['kind']}: wire {d['bytes_pulled'] / f['bytes_pulled']:.3%}, "
                      f"refit {d['seconds']:.3f}s vs full {f['seconds']:.3f}s ({d['seconds'] / f['seconds']:.1%}); "
                      f"estimates full {d['full_estimate_s']:.3f}s delta {d['delta_estimate_s']:.3f}s; "
                      f"publish {publish_s:.2f}s; mismatches {row['mismatches']}", flush=True)
        conn.send(("stop", args.steps + 2, 0.0))
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        server.stop(0)
    steady = [r for r in rows[2:] if r["delta"]["kind"] == "delta"]
    mean = lambda label, key: sum(r[label][key] for r in steady) / max(1, len(steady))  # noqa: E731
    out = {
        "config": vars(args), "bytes": nbytes, "steps": rows,
        "machine": {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
                    "cpus": mp.cpu_count()},
        "steady": {
            "versions": [r["version"] for r in steady],
            "wire_fraction": mean("delta", "bytes_pulled") / max(1, mean("full", "bytes_pulled")),
            "time_fraction_vs_full": mean("delta", "seconds") / max(1e-9, mean("full", "seconds")),
            "mismatches": sum(r["mismatches"] for r in rows),
        },
    }
    print(json.dumps(out["steady"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
