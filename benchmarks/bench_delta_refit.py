"""Delta refits against full refits: wire bytes and whole-refit time, same bytes, same run (issue 24).

    python benchmarks/bench_delta_refit.py --device cpu --gib 1 --out delta_refit_cpu.json
    python3 benchmarks/bench_delta_refit.py --device cuda --gib 6 --out delta_refit_h200.json  # colocated, one GPU

A publisher (``delta="auto"``) and three receivers live in this process and talk over real NIXL
(and, on CUDA, whatever ``transport: auto`` picks for a same-node source) through an embedded
catalog: ``delta`` (``delta="auto"``), ``delta-trusting-arena`` (the same with
``delta_check_arena=False``: no fingerprint passes over the arena), ``full+checksums`` (a full refit with the same
verification a delta refit needs) and ``full`` (no checksums: the plain refit). Two model shapes,
bf16:

- ``dense``: tensors of 4096 columns, 64 MiB each;
- ``moe``: expert tensors of 1536 x 2048 (6 MiB each), of which ``--touched-experts`` get a
  gradient each step (the rest are experts the router did not pick), plus 10% dense tensors.

Each step is Megatron's mixed precision at ``--lr``: FP32 master weights (init std 0.02) take
an Adam-sized update (``lr`` times a unit normal per element: Adam's normalised step) and are
rounded to nearest into the published BF16 buffers, so what changes is what crosses a BF16
rounding step, as on a real optimizer (``bench_delta_fraction.py`` measures that on a trained
LM). After every step all three receivers refit the new version; every tensor of the delta
receiver is compared byte for byte with the full receiver's (``mismatches``, must be 0).
Reported per step: wire bytes (``RefitStats.bytes_pulled``) and whole-refit wall seconds of
each receiver, the publish time with and without change detection, and the changed fraction.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import uuid
from pathlib import Path

GIB = 1 << 30


def shapes(kind: str, gib: float) -> list[tuple[str, tuple[int, int], bool]]:
    """(name, shape, is_expert) of the model's tensors."""
    total = int(gib * GIB)
    if kind == "dense":
        rows = 8192
        return [(f"layers.{i}.weight", (rows, 4096), False) for i in range(max(1, total // (rows * 4096 * 2)))]
    dense = [(f"layers.{i}.attn.weight", (4096, 4096), False) for i in range(max(1, total // 10 // (4096 * 4096 * 2)))]
    experts = max(2, (total - len(dense) * 4096 * 4096 * 2) // (1536 * 2048 * 2))
    return dense + [(f"experts.{i}.weight", (1536, 2048), True) for i in range(experts)]


def run_shape(kind: str, args: argparse.Namespace) -> dict:
    import torch

    from mx_refit.catalog.server import start_embedded
    from mx_refit.publisher import Publisher
    from mx_refit.receive.receiver import Receiver

    device = args.device
    gen = torch.Generator(device=device).manual_seed(0)
    spec = shapes(kind, args.gib)
    masters = {n: torch.randn(s, generator=gen, device=device) * 0.02 for n, s, _ in spec}
    weights = {n: m.to(torch.bfloat16) for n, m in masters.items()}
    experts = [n for n, _, e in spec if e]
    nbytes = sum(w.numel() * 2 for w in weights.values())
    server = start_embedded()
    model = f"delta-{kind}-{uuid.uuid4().hex[:6]}"
    rows = []
    with Publisher(server.address, model, delta="auto", delta_anchor_every=args.steps + 10) as pub, \
            Receiver(server.address, model, delta="auto", device=device) as delta, \
            Receiver(server.address, model, delta="auto", delta_check_arena=False, device=device) as trusting, \
            Receiver(server.address, model, checksums=True, device=device) as checked, \
            Receiver(server.address, model, device=device) as plain:
        for step in range(args.steps + 1):
            touched = set(experts[: int(len(experts) * args.touched_experts)]) if step else set(masters)
            changed = 0
            if step:
                for name, master in masters.items():
                    if name in touched or name not in experts:
                        master.add_(torch.randn(master.shape, generator=gen, device=device), alpha=-args.lr)
                        new = master.to(torch.bfloat16)
                        changed += int((new.view(torch.int16) != weights[name].view(torch.int16)).sum())
                        weights[name].copy_(new)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            version = step + 1
            t0 = time.perf_counter()
            pub.publish(version, model=weights)
            publish_s = time.perf_counter() - t0
            results = {}
            receivers = (("delta", delta), ("delta-trusting-arena", trusting), ("full+checksums", checked), ("full", plain))
            for label, rec in receivers:
                t0 = time.perf_counter()
                result = rec.refit(version)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                results[label] = (time.perf_counter() - t0, result)
            got, want = dict(results["delta"][1].tensors), dict(results["full"][1].tensors)
            trusted = dict(results["delta-trusting-arena"][1].tensors)
            mismatches = sum(not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want)
            mismatches += sum(not torch.equal(trusted[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want)
            row = {
                "version": version, "changed_fraction": changed / (nbytes // 2), "publish_s": publish_s,
                "mismatches": mismatches, "delta_kind": results["delta"][1].stats.kind,
                "delta_refused": results["delta"][1].stats.delta_refused,
            }
            for label, (seconds, result) in results.items():
                row[label] = {"seconds": seconds, "bytes_pulled": result.stats.bytes_pulled,
                              "phases": result.stats.phase_seconds}
            rows.append(row)
            print(f"{kind} v{version}: {row['delta_kind']} changed {row['changed_fraction']:.3%} "
                  f"wire {row['delta']['bytes_pulled'] / nbytes:.3%} of {nbytes / GIB:.2f} GiB, "
                  f"refit {row['delta']['seconds']:.3f}s (arena trusted {row['delta-trusting-arena']['seconds']:.3f}s) "
                  f"vs full {row['full']['seconds']:.3f}s "
                  f"(+checksums {row['full+checksums']['seconds']:.3f}s), publish {publish_s:.3f}s, "
                  f"mismatches {mismatches}", flush=True)
            pub.wait_drained(version)
    server.stop(0)
    steady = [r for r in rows[2:] if r["delta_kind"] == "delta"] or rows[1:]
    mean = lambda key, sub: sum(r[key][sub] for r in steady) / len(steady)  # noqa: E731
    return {
        "bytes": nbytes, "tensors": len(spec), "steps": rows,
        "steady": {
            "wire_fraction": mean("delta", "bytes_pulled") / mean("full", "bytes_pulled"),
            "time_fraction_vs_full": mean("delta", "seconds") / mean("full", "seconds"),
            "time_fraction_trusting_arena_vs_full": mean("delta-trusting-arena", "seconds") / mean("full", "seconds"),
            "time_fraction_vs_full_checksums": mean("delta", "seconds") / mean("full+checksums", "seconds"),
            "mismatches": sum(r["mismatches"] for r in rows),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--shapes", nargs="+", default=["dense", "moe"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--touched-experts", type=float, default=0.5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import torch

    out = {"config": vars(args), "machine": {"python": sys.version.split()[0], "torch": torch.__version__,
                                             "platform": platform.platform()}, "shapes": {}}
    for kind in args.shapes:
        out["shapes"][kind] = run_shape(kind, args)
        print(kind, json.dumps(out["shapes"][kind]["steady"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
