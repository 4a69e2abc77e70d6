"""Applying a delta's records: record by record (decode + apply_changes per tensor, what delta
refits did before) against all at once (``mx_refit.delta.batch.apply_batch``), same records, same
arena, bytes compared (issue 24).

    python benchmarks/bench_delta_apply.py --device cpu --mib 512 --out benchmarks/results/delta_apply_cpu.json
    python benchmarks/bench_delta_apply.py --device cuda --mib 4096 --out delta_apply_h200.json

Two shapes of BF16 tensors, each changed the way bench_delta_fraction.py recorded at lr 1e-6
(``--fraction`` of the elements, at random, by one BF16 step): ``dense`` (64 MiB tensors) and
``moe`` (1.5 MiB expert tensors: many small records). Reported: seconds of each way (best of
``--repeat``), changed elements, record bytes, and the seconds of one copy of the whole arena
(what a full pull's bytes cost to write at this memory's speed).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path


def run(shape: str, args: argparse.Namespace) -> dict:
    import torch

    from mx_refit.delta.batch import Item, apply_batch
    from mx_refit.delta.records import apply_changes, decode, encode

    device = args.device
    rows, cols = (8192, 4096) if shape == "dense" else (768, 1024)
    count = max(1, args.mib * (1 << 20) // (rows * cols * 2))
    gen = torch.Generator(device=device).manual_seed(0)
    olds = [(torch.randn(rows, cols, generator=gen, device=device) * 0.02).to(torch.bfloat16) for _ in range(count)]
    news = []
    for old in olds:
        new = old.clone()
        flat = new.view(-1).view(torch.int16)
        k = int(flat.numel() * args.fraction)
        flat[torch.randint(flat.numel(), (k,), generator=gen, device=device)] += 1
        news.append(new)
    nbytes = rows * cols * 2
    records = [encode(o, n) for o, n in zip(olds, news)]
    data = torch.cat([r.data for r in records])
    base = torch.cat([o.reshape(-1).view(torch.uint8) for o in olds])
    want = torch.cat([n.reshape(-1).view(torch.uint8) for n in news])
    items, offset = [], 0
    for i, r in enumerate(records):
        items.append(Item(r.form, offset, r.data.numel(), i * nbytes, nbytes, 2, r.changed, r.narrow, i * nbytes))
        offset += r.data.numel()
    reads = [(i * nbytes, i * nbytes, nbytes) for i in range(count)]

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def per_record(arena: "torch.Tensor") -> None:
        at = 0
        for i, r in enumerate(records):
            positions, values = decode(r.form, data[at : at + r.data.numel()], nbytes, 2, r.changed, r.narrow)
            apply_changes(arena, positions + i * nbytes, values, [reads[i]])
            at += r.data.numel()

    timings: dict[str, float] = {}
    for label, fn in (("per_record", per_record), ("batched", lambda a: apply_batch(a, data, items, reads)),
                      ("copy_whole_arena", lambda a: a.copy_(want))):
        best = float("inf")
        for _ in range(args.repeat):
            arena = base.clone()
            sync()
            start = time.perf_counter()
            fn(arena)
            sync()
            best = min(best, time.perf_counter() - start)
            if not torch.equal(arena, want):
                raise AssertionError(f"{shape}: {label} wrote other bytes than the new version's")
        timings[label] = best
    row = {"tensors": count, "bytes": count * nbytes, "changed": sum(r.changed for r in records),
           "record_bytes": data.numel(), "seconds": timings,
           "speedup_batched_vs_per_record": timings["per_record"] / timings["batched"]}
    print(shape, json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--fraction", type=float, default=0.0215)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    out = {"config": vars(args), "machine": {"python": sys.version.split()[0], "torch": torch.__version__,
                                             "platform": platform.platform()},
           "shapes": {shape: run(shape, args) for shape in ("dense", "moe")}}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
