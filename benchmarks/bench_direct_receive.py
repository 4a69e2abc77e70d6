"""receive_mode direct vs staged: refit wall time and the peak receive memory outside the
parameters, one source process publishing over the real catalog and NIXL.

The receiver's engine is a mapping of preallocated destination tensors (the "parameters").
``staged`` pulls the whole version into its arena, then copies it into them; ``direct`` pulls
through a buffer of ``receive_buffer_bytes`` chunk by chunk, writing each chunk into them
(tensors larger than the buffer in row pieces). For each mode: the median whole refit
(``Receiver.refit``) over ``--cycles`` refits of the same READY version, and the peak of torch's
CPU allocations during one more refit (torch's profiler records every allocation and free of the
process, in order): the receive memory outside the parameters. Every refit's bytes are checked.

    python benchmarks/bench_direct_receive.py                       # ~250 MB model, CPU
    OMP_NUM_THREADS=1 python benchmarks/bench_direct_receive.py --cycles 7 --out direct_receive_cpu.json  # a shared box
    python benchmarks/bench_direct_receive.py --device cuda:0 --layers 36 --hidden 4096 --inter 12288 \
        --vocab 151936 --buffers-mib 64,256,1024 --out direct_receive_h200.json   # Qwen3-8B-shaped, one GPU

On a GPU the source publishes from the same device and the receive memory is torch's CUDA
allocation peak above what was allocated before the refit (``torch.cuda.max_memory_allocated``).
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "src"))

MIB = 1 << 20


def shapes(hidden: int, inter: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """A dense transformer's HF tensors (bf16), GQA with a quarter of the heads as KV heads."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    kv = hidden // 4
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
        })
    out["model.norm.weight"] = (hidden,)
    out["lm_head.weight"] = (vocab, hidden)
    return out


def tensors(spec: dict[str, tuple[int, ...]], seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in spec.items()}


def source_proc(address: str, spec: dict, device: str, conn) -> None:
    from mx_refit.publisher import Publisher
    from mx_refit.types import PublishedTensor

    pub = Publisher(address, "bench-direct", expected_sources=1, ttl_s=60.0)
    live = [PublishedTensor(n, t.to(device)) for n, t in tensors(spec, 1).items()]
    conn.send(pub.publish(1, live).value)
    conn.recv()  # stop
    pub.close()


def allocation_peak(fn, device: str = "cpu"):
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device != "cpu":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - before

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    current = peak = 0
    for event in prof.profiler.kineto_results.events():
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU:
            current += event.nbytes()
            peak = max(peak, current)
    return result, peak


def measure(address: str, spec: dict, mode: str, buffer_bytes: int, cycles: int, expected: dict,
            device: str) -> dict:
    import torch

    from mx_refit import Receiver

    engine = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in spec.items()}
    kwargs: dict = {"device": device}
    if mode == "direct":
        kwargs.update(receive_mode=mode, receive_buffer_bytes=buffer_bytes)
    with Receiver(address, "bench-direct", engine=engine, **kwargs) as rec:
        rec.refit(1)  # warm: plan cached, memory registered
        walls = []
        for _ in range(cycles):
            for t in engine.values():
                t.zero_()
            if device != "cpu":
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            result = rec.refit(1)
            if device != "cpu":
                torch.cuda.synchronize(device)
            walls.append(time.perf_counter() - began)
            bad = [n for n, t in expected.items() if not torch.equal(engine[n], t)]
            assert not bad, f"{mode}: {len(bad)} tensors differ, e.g. {bad[:3]}"
        # A fresh receiver for the memory figure: its first refit allocates what it receives into.
    with Receiver(address, "bench-direct", engine=engine, **kwargs) as fresh:
        measured, peak = allocation_peak(lambda: fresh.refit(1), device)
    stats = result.stats
    return {
        "mode": mode,
        "receive_buffer_bytes": buffer_bytes if mode == "direct" else None,
        "refit_ms_median": statistics.median(walls) * 1e3,
        "refit_ms_min": min(walls) * 1e3,
        "chunks": stats.chunks,
        "receive_memory_bytes": measured.stats.receive_memory_bytes,
        "torch_peak_bytes": peak,
        "phase_ms": {k: round(v * 1e3, 3) for k, v in stats.phase_seconds.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--buffers-mib", default="1,16,64", help="direct receive_buffer_bytes values, MiB")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N (source, receiver and parameters)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from mx_refit.catalog.server import start_embedded

    spec = shapes(args.hidden, args.inter, args.layers, args.vocab)
    model_bytes = sum(2 * math.prod(s) for s in spec.values())
    server = start_embedded()
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=source_proc, args=(server.address, spec, args.device, child), daemon=True)
    proc.start()
    try:
        assert parent.poll(300), "the source did not publish"
        print(f"published: {parent.recv()}; {len(spec)} tensors, {model_bytes / MIB:.1f} MiB", flush=True)
        expected = {n: t.to(args.device) for n, t in tensors(spec, 1).items()}
        rows = [measure(server.address, spec, "staged", 0, args.cycles, expected, args.device)]
        for mib in (float(x) for x in args.buffers_mib.split(",")):
            rows.append(measure(server.address, spec, "direct", int(mib * MIB), args.cycles, expected, args.device))
    finally:
        parent.send("stop")
        proc.join(30)
        server.stop(0)
    staged = rows[0]
    for row in rows:
        row["vs_staged_time"] = row["refit_ms_median"] / staged["refit_ms_median"]
        row["peak_vs_model"] = row["torch_peak_bytes"] / model_bytes
        label = row["mode"] if row["mode"] == "staged" else f"direct {row['receive_buffer_bytes'] / MIB:g} MiB"
        print(f"{label:>16}: refit {row['refit_ms_median']:8.1f} ms ({row['vs_staged_time']:.2f}x staged), "
              f"{row['chunks']:4d} chunks, receive memory {row['receive_memory_bytes'] / MIB:8.2f} MiB, "
              f"torch peak {row['torch_peak_bytes'] / MIB:8.2f} MiB ({row['peak_vs_model']:.3f}x the model)")
    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": args.device},
        "model_bytes": model_bytes, "tensors": len(spec), "args": vars(args), "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
