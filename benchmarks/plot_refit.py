"""Plot a bench_refit.py results JSON as grouped bars (needs matplotlib).

    python benchmarks/plot_refit.py results.json benchmarks/refit_gpu.png
"""

from __future__ import annotations

import json
import sys


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.load(open(src))
    cases = results["cases"]
    bcast = "nccl" if any("nccl_broadcast_flat_gbps" in c for c in cases.values()) else "gloo"
    series = [
        ("mx-refit, cycle 1 (connect + register)", lambda c: c["cycles"][0]["gbps"]),
        ("mx-refit, steady (cycle 2+)", lambda c: c["mx_steady_gbps"]),
        ("torch copy, one flat copy", lambda c: c["torch_copy_flat_gbps"]),
        ("torch copy, per tensor", lambda c: c["torch_copy_per_tensor_gbps"]),
        (f"{bcast.upper()} broadcast, flat", lambda c: c[f"{bcast}_broadcast_flat_gbps"]),
        (f"{bcast.upper()} broadcast, per tensor", lambda c: c[f"{bcast}_broadcast_per_tensor_gbps"]),
    ]
    labels = {
        "large": f"8 GiB in 64-512 MiB tensors ({cases.get('large', {}).get('tensors', 0)})",
        "small": f"{cases.get('small', {}).get('tensors', 0):,} x 256 KiB",
    }
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / len(series)
    for i, (name, get) in enumerate(series):
        xs = [j + i * width for j in range(len(cases))]
        ys = [get(c) for c in cases.values()]
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], [labels.get(k, k) for k in cases])
    ax.set_ylabel("GB/s (GPU0 -> GPU1)" if bcast == "nccl" else "GB/s (DRAM)")
    gpus = results["machine"].get("gpus")
    ax.set_title(f"Refit bandwidth on {len(gpus)}x {gpus[0]}" if gpus else "Refit bandwidth (DRAM)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
