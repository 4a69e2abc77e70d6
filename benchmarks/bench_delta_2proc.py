"""Delta against full refits of a multi-GB model, trainer and receivers in two processes over real
NIXL DRAM (issue 24): per step the wire bytes and whole-refit time of each, 0 mismatches.

    python benchmarks/bench_delta_2proc.py --gb 5 --steps 4 --out benchmarks/results/delta_2proc_cpu.json
    python benchmarks/bench_delta_2proc.py --device cuda --gb 5 --steps 6 --auto-steps 4 --out delta_2proc_h200.json

The trainer process holds the model's BF16 tensors (64 MiB each) and publishes every
version with ``delta="auto"``; the receiving process runs two receivers: ``delta``
(``delta="on"``: every version whose base it provably holds comes as a delta, and the estimate
``delta: auto`` would choose from is reported beside it) and ``full`` (a plain full refit, the
baseline), one after the other (at 5 GB this machine does not hold both arenas beside the trainer's
two copies); then, with ``--auto-steps``, a ``delta="auto"`` receiver (what it chooses and why).
After every refit each tensor's SHA-256 is compared with the trainer's (``mismatches``).

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
import gc
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


def digests(tensors) -> dict[str, str]:
    """SHA-256 of each tensor's bytes (on the host)."""
    import hashlib

    import torch

    return {name: hashlib.sha256(t.detach().reshape(-1).view(torch.uint8).cpu().numpy()).hexdigest() for name, t in tensors}


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
                seconds = time.perf_counter() - start
                conn.send(("published", seconds, changed, pub._delta.snapshot_bytes, pub._delta.records.numel(),
                           digests(weights.items())))
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
    parser.add_argument("--auto-steps", type=int, default=0, help="then this many versions to a delta='auto' receiver")
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
    rows: list[dict] = []

    def step(version: int, fraction: float) -> tuple[dict, dict]:
        conn.send(("step", version, fraction))
        reply = conn.recv()
        if reply[0] != "published":
            raise RuntimeError(f"trainer: {reply}")
        _, publish_s, changed, snapshot, record_buffer, want = reply
        return {"version": version, "fraction": fraction, "changed_elements": changed, "publish_s": publish_s,
                "tracker_snapshot_bytes": snapshot, "tracker_record_buffer_bytes": record_buffer}, want

    def refit(rec, label: str, version: int, row: dict, want: dict) -> None:
        start = time.perf_counter()
        result = rec.refit(version)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        s = result.stats
        got = digests(result.tensors)
        row[label] = {"seconds": seconds, "bytes_pulled": s.bytes_pulled, "kind": s.kind, "phases": s.phase_seconds,
                      "delta_refused": s.delta_refused, "full_estimate_s": s.full_estimate_s,
                      "delta_estimate_s": s.delta_estimate_s,
                      "mismatches": sum(got.get(n) != h for n, h in want.items()) + len(set(got) ^ set(want))}
        print(f"v{version} {label}: {s.kind}, changed {row['fraction']:.3%}, wire {s.bytes_pulled / nbytes:.3%}, "
              f"refit {seconds:.3f}s (pull {s.phase_seconds['pull']:.3f}, verify+apply {s.phase_seconds['verify']:.3f}, "
              f"arena proof {s.phase_seconds['heartbeat_start']:.3f}, load {s.phase_seconds['load']:.3f}); estimates "
              f"full {s.full_estimate_s:.3f}s delta {s.delta_estimate_s:.3f}s; publish {row['publish_s']:.2f}s; "
              f"mismatches {row[label]['mismatches']}", flush=True)

    try:
        kind, nbytes = conn.recv()
        assert kind == "ready", nbytes
        print(f"model {nbytes / 1e9:.2f} GB in {nbytes // (ROWS * COLS * 2)} tensors", flush=True)
        version = 1
        # phase 1: the delta receiver (v1 full, v1 again: a warm full pull, the rate its estimates
        # need; then every version as a delta)
        with Receiver(server.address, model, delta="on", delta_check_arena=bool(args.check_arena),
                      device=args.device) as rec:
            row, want = step(version, 0.0)
            refit(rec, "delta", version, row, want)
            refit(rec, "delta_warm_full", version, row, want)
            rows.append(row)
            for i in range(args.steps):
                version += 1
                row, want = step(version, steps[i % len(steps)])
                refit(rec, "delta", version, row, want)
                rows.append(row)
        del rec  # its arena goes before the next receiver's comes
        gc.collect()
        # phase 2: the baseline, a plain full receiver, on versions changed the same way (at 5 GB
        # the machine does not hold both receivers' arenas beside the trainer's two copies)
        with Receiver(server.address, model, device=args.device) as rec:
            for i in range(args.steps + 1):
                version += 1
                row, want = step(version, steps[i % len(steps)])
                refit(rec, "full", version, row, want)
                rows.append(row)
        del rec
        gc.collect()
        # phase 3 (--auto-steps): what delta "auto" chooses, from its own measurements
        if args.auto_steps:
            with Receiver(server.address, model, delta="auto", delta_check_arena=bool(args.check_arena),
                          device=args.device) as rec:
                for i in range(args.auto_steps):
                    version += 1
                    row, want = step(version, steps[i % len(steps)])
                    refit(rec, "auto", version, row, want)
                    rows.append(row)
        conn.send(("stop", version + 1, 0.0))
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        server.stop(0)
    deltas = [r["delta"] for r in rows[2 : args.steps + 1] if "delta" in r and r["delta"]["kind"] == "delta"]
    fulls = [r["full"] for r in rows if "full" in r][1:]  # the first is cold
    mean = lambda xs, key: sum(x[key] for x in xs) / max(1, len(xs))  # noqa: E731
    out = {
        "config": vars(args), "bytes": nbytes, "steps": rows,
        "machine": {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
                    "cpus": mp.cpu_count()},
        "steady": {
            "delta_versions": len(deltas), "full_versions": len(fulls),
            "wire_fraction": mean(deltas, "bytes_pulled") / max(1, mean(fulls, "bytes_pulled")),
            "delta_seconds": mean(deltas, "seconds"), "full_seconds": mean(fulls, "seconds"),
            "time_fraction_vs_full": mean(deltas, "seconds") / max(1e-9, mean(fulls, "seconds")),
            "mismatches": sum(r[k]["mismatches"] for r in rows for k in ("delta", "delta_warm_full", "full", "auto")
                              if k in r),
            "auto_kinds": [(r["auto"]["kind"], r["auto"]["delta_refused"]) for r in rows if "auto" in r],
        },
    }
    print(json.dumps(out["steady"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
