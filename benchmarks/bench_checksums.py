"""What an end-to-end checksum costs where the bytes live, against a copy of the same bytes.

    python benchmarks/bench_checksums.py --device cuda              # the H200 figures
    python benchmarks/bench_checksums.py --device cpu --scale 0.125 # the CPU figures (DRAM)

For each tensor set (``big``: 8 GiB in 33 bf16 tensors; ``small``: 10,000 tensors of 256 KiB;
``--scale`` shrinks both), measures :func:`mx_refit.checksums.source_checksums` (what a
publisher runs per version: every block of every tensor, the sums brought to the host once)
and, in the same run on the same tensors, the baseline: ``dst.copy_(src)`` of every tensor
(one device copy of the same bytes, what the cheapest possible pass over them costs). Reports
GB/s of each (bytes of the tensors / seconds, best of ``--reps``) and the ratio checksum time /
copy time. Before timing, the device's sums of a few tensors are compared with the same
function run on a CPU copy of them (the function must give the same numbers on every device).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

GIB = 1 << 30
KIB = 1 << 10


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _best(fn, device: str, reps: int) -> float:
    fn()  # warm-up (weights made, kernels loaded)
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def tensor_sets(scale: float) -> dict[str, tuple[int, int]]:
    """name -> (count, bytes per tensor)."""
    return {
        "big": (33, int(8 * GIB * scale) // 33 // 4096 * 4096),
        "small": (max(1, int(10_000 * scale)), 256 * KIB),
    }


def run(device: str, scale: float, block_sizes: list[int], reps: int) -> dict:
    import torch

    from mx_refit.checksums import source_checksums

    results = []
    for name, (count, nbytes) in tensor_sets(scale).items():
        gen = torch.Generator(device=device).manual_seed(0)
        tensors = [torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device, generator=gen)
                   for _ in range(count)]
        total = count * nbytes
        for block in block_sizes:  # same numbers on the CPU
            here = source_checksums(tensors[:2], block).sums
            there = source_checksums([t.cpu() for t in tensors[:2]], block).sums
            if here != there:
                raise SystemExit(f"{name}: {device} and cpu checksums differ (block {block})")
        dst = [torch.empty_like(t) for t in tensors]

        def copy() -> None:
            for d, s in zip(dst, tensors):
                d.copy_(s)

        copy_s = _best(copy, device, reps)
        del dst
        for block in block_sizes:
            sums_s = _best(lambda: source_checksums(tensors, block), device, reps)
            row = {
                "set": name, "tensors": count, "tensor_bytes": nbytes, "bytes": total, "block_bytes": block,
                "copy_s": round(copy_s, 6), "copy_gbps": round(total / copy_s / 1e9, 1),
                "checksum_s": round(sums_s, 6), "checksum_gbps": round(total / sums_s / 1e9, 1),
                "checksum_over_copy": round(sums_s / copy_s, 2),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
        del tensors
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    machine = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or platform.machine()
    return {"device": device, "machine": machine, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink both tensor sets (CPU: 0.125)")
    parser.add_argument("--blocks", default="1048576", help="comma-separated block sizes in bytes")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the JSON summary here")
    args = parser.parse_args(argv)
    summary = run(args.device, args.scale, [int(b) for b in args.blocks.split(",")], args.reps)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
