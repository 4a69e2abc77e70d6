"""The fused copy-and-checksum kernel's launch shape against torch's copy of the same bytes.

One GPU: ``--gib`` GiB of random bytes in 1 MiB blocks (the receiver's default block), copied by
``dst.copy_(src)`` and by :mod:`mx_refit.checksum_kernels`' kernel (copy + one checksum per block)
at several (words per step, warps) shapes, and summed without the copy; best of ``--reps`` by CUDA
events. Every shape's sums must equal the shipped shape's: the checksum does not depend on it.

    python benchmarks/bench_checksum_kernel.py --gib 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "src"))

SHAPES = ((1024, 4), (1024, 8), (1024, 16), (2048, 8), (4096, 8), (4096, 16))


def main() -> None:
    import torch

    from mx_refit import checksum_kernels as ck

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda:0")
    n = int(args.gib * (1 << 30)) // 8 * 8
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    src.view(torch.int64).random_()
    dst = torch.empty_like(src)
    tasks = torch.from_numpy(ck.block_tasks([(src.data_ptr(), dst.data_ptr(), n, 0)], 1 << 20)).to(dev)
    shipped = torch.zeros(tasks.shape[0], dtype=torch.int64, device=dev)
    out = torch.zeros_like(shipped)

    def best_ms(fn) -> float:  # noqa: ANN001
        fn()
        torch.cuda.synchronize(dev)
        times = []
        for _ in range(args.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return min(times)

    kernel = ck._kernel()
    result: dict[str, object] = {"device": torch.cuda.get_device_name(dev), "bytes": n, "blocks": int(tasks.shape[0])}
    result["torch_copy_ms"] = best_ms(lambda: dst.copy_(src))
    result["shipped_copy_sums_ms"] = best_ms(lambda: ck.launch(tasks, shipped, copy=True))
    result["shipped_sums_only_ms"] = best_ms(lambda: ck.launch(tasks, out, copy=False))
    same = torch.equal(out, shipped) and torch.equal(dst, src)
    shapes = {}
    for words, warps in SHAPES:
        out.zero_()
        shapes[f"{words}x{warps}"] = best_ms(
            lambda w=words, k=warps: kernel[(tasks.shape[0],)](tasks, out, COPY=True, CHUNK=w, num_warps=k))
        same = same and torch.equal(out, shipped)
    result["copy_sums_ms_by_words_x_warps"] = shapes
    result["sums_equal_across_shapes"] = same
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
