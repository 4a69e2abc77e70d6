"""What end-to-end checksums cost a refit: the same refit with ``checksums`` off and on, in the
same run, as ratios.

    python benchmarks/bench_checksums.py --device cuda --out r.json           # the H200 (colocated)
    python benchmarks/bench_checksums.py --device cpu --scale 0.05 --out r.json  # DRAM over NIXL

One process holds an embedded catalog, the publishers and the receivers (on one GPU a receiver
reads the publisher's VRAM by device copy, the colocated path; on the CPU it reads over NIXL/UCX
from DRAM). Layouts (sizes times ``--scale``):
  separate: 8 GiB in 33 separately allocated bf16 tensors (64-512 MiB, one allocation each)
  qwen3-8b: a Qwen3-8B-shaped model (36 layers; q/k/v/o, gate/up/down, norms; embedding and
            lm_head), bf16, each tensor its own allocation
For each layout, two publisher/receiver pairs on the same tensors: ``plain`` (checksums off) and
``checked`` (on, 1 MiB blocks). Each round publishes a new version on both and refits both,
alternating which goes first; reported: medians of ``publish`` (the publisher's call, source
sums included) and ``refit`` (the receiver's call: pull and, when checked, verify) and the
ratios checked / plain. Every checked refit is also compared byte for byte with the source.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

MIB = 1 << 20


def layout_sizes(name: str, scale: float) -> list[tuple[str, tuple[int, ...]]]:
    """(tensor name, shape) in bf16 elements."""
    if name == "separate":
        sizes = [64, 128, 256, 512] * 8 + [512]
        return [(f"t{i}", (max(1, int(s * MIB * scale)) // 2,)) for i, s in enumerate(sizes)]
    if name == "qwen3-8b":
        hidden, inter, kv, vocab, layers = 4096, 12288, 1024, 151936, 36
        layers = max(1, round(layers * scale))
        vocab = max(64, int(vocab * scale))  # the embedding and lm_head shrink with the layers
        shapes: list[tuple[str, tuple[int, ...]]] = [("embed", (vocab, hidden))]
        for i in range(layers):
            p = f"layers.{i}."
            shapes += [(p + "q", (hidden, hidden)), (p + "k", (kv, hidden)), (p + "v", (kv, hidden)),
                       (p + "o", (hidden, hidden)), (p + "q_norm", (128,)), (p + "k_norm", (128,)),
                       (p + "gate", (inter, hidden)), (p + "up", (inter, hidden)), (p + "down", (hidden, inter)),
                       (p + "ln1", (hidden,)), (p + "ln2", (hidden,))]
        return shapes + [("norm", (hidden,)), ("lm_head", (vocab, hidden))]
    raise ValueError(name)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_layout(address: str, device: str, name: str, scale: float, rounds: int, transport: str) -> dict:
    import torch

    from mx_refit.publisher import Publisher
    from mx_refit.receive.receiver import Receiver
    from mx_refit.types import PublishedTensor

    gen = torch.Generator(device=device).manual_seed(0)
    tensors = [PublishedTensor(n, torch.randn(shape, dtype=torch.bfloat16, device=device, generator=gen))
               for n, shape in layout_sizes(name, scale)]
    total = sum(t.tensor.numel() * 2 for t in tensors)
    pairs = {}
    for mode in ("plain", "checked"):
        model = f"bench-{name}-{mode}"
        on = mode == "checked"
        pairs[mode] = (
            Publisher(address, model, source_id=f"{model}/src", transport_mode=transport, checksums=on),
            Receiver(address, model, device=device, transport_mode=transport, checksums=on),
        )
    times: dict[str, dict[str, list[float]]] = {m: {"publish": [], "refit": []} for m in pairs}
    path = blocks = None
    for version in range(1, rounds + 2):  # round 1 warms up (plans, registrations, handles)
        order = ("plain", "checked") if version % 2 else ("checked", "plain")
        for mode in order:
            pub, rec = pairs[mode]
            if version > 1:
                pub.wait_drained(version - 1, timeout_s=60)
            _sync(device)
            t0 = time.perf_counter()
            pub.publish(version, tensors)
            t1 = time.perf_counter()
            result = rec.refit(version, wait_s=30)
            _sync(device)
            t2 = time.perf_counter()
            if mode == "checked":
                path, blocks = result.stats.transport, result.stats.blocks_verified
                if version == 1 or version == rounds + 1:  # every byte, once early and once late
                    got = dict(result.tensors)
                    assert all(torch.equal(got[t.name].view(-1).view(torch.uint8), t.tensor.view(-1).view(torch.uint8))
                               for t in tensors), "a checked refit delivered wrong bytes"
            if version > 1:
                times[mode]["publish"].append(t1 - t0)
                times[mode]["refit"].append(t2 - t1)
                for phase, seconds in result.stats.phase_seconds.items():  # every phase of the refit
                    times[mode].setdefault(phase, []).append(seconds)
    for pub, rec in pairs.values():
        rec.close()
        pub.close()
    med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
    row = {
        "layout": name, "tensors": len(tensors), "bytes": total, "transport": path, "blocks_verified": blocks,
        "rounds": rounds,
        **{f"{m}_{k}_ms": round(v * 1e3, 3) for m, d in med.items() for k, v in d.items()},
        "refit_ratio": round(med["checked"]["refit"] / med["plain"]["refit"], 3),
        "publish_ratio": round(med["checked"]["publish"] / med["plain"]["publish"], 3),
        "publish_plus_refit_ratio": round((med["checked"]["refit"] + med["checked"]["publish"])
                                          / (med["plain"]["refit"] + med["plain"]["publish"]), 3),
    }
    print(json.dumps(row), flush=True)
    del tensors
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the layouts (CPU: 0.05)")
    parser.add_argument("--layouts", default="separate,qwen3-8b")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--out", default=None, help="also write the JSON summary here")
    args = parser.parse_args(argv)
    import torch

    from mx_refit import start_catalog

    catalog = start_catalog()
    try:
        rows = [run_layout(catalog.address, args.device, name, args.scale, args.rounds, args.transport)
                for name in args.layouts.split(",")]
    finally:
        catalog.stop()
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine()
    summary = {"device": args.device, "machine": machine, "torch": torch.__version__, "scale": args.scale,
               "threads": torch.get_num_threads(), "results": rows}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
