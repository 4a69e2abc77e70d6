"""Refit bandwidth: one source process publishes, one receiver process pulls, through the real
catalog and NIXL; baselines (torch device-to-device copy, NCCL/gloo broadcast) on the same bytes
in the same run.

    python benchmarks/bench_refit.py --device cuda --out results.json     # GPU0 -> GPU1
    python benchmarks/bench_refit.py --device cpu --scale 0.125            # DRAM, smaller
    python benchmarks/bench_refit.py --device cuda --transport auto        # one GPU: colocated

With one GPU both processes share GPU0 (colocated); the NCCL baseline cannot run there and the
baseline is vLLM's ``ipc`` engine path instead (CUDA IPC handle opened in the receiver, then
copied; ``_ipc_baseline.py``). ``--transport`` is ``weight_sync.transport`` (auto | nixl |
cuda_ipc); the path each refit took is reported.

Cases (sizes times --scale):
  large: 8 GiB in tensors of 64-512 MiB
  small: 10,000 tensors of 256 KiB (--small-kib; --scale scales the count)
  small-scattered: the same, each tensor its own allocation
  qwen3-8b: Qwen3-8B's 399 bf16 tensors (16.4 GB), each its own allocation (as HF/FSDP models
    and vLLM keep parameters)
Source tensors of the other cases are views into one buffer, as Megatron's DDP keeps parameters
in contiguous buffers; the receiver pulls into its registered arena. Every cycle's bytes are
checked; "whole refit" is the receiver's refit() wall time (discover, plan, lease, pull,
release, materialise), compared with the torch flat copy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling _ipc_baseline

MIB = 1 << 20


def qwen3_8b_sizes() -> list[int]:
    """Bytes of Qwen3-8B's 399 bf16 tensors, in HF order: 36 layers of hidden 4096, 32 query
    and 8 KV heads of 128, MLP 12,288; vocabulary 151,936, untied embeddings."""
    hidden, kv, ffn, vocab, head = 4096, 1024, 12288, 151_936, 128
    layer = [hidden * hidden, kv * hidden, kv * hidden, hidden * hidden, head, head,  # q k v o, q/k norms
             ffn * hidden, ffn * hidden, hidden * ffn, hidden, hidden]  # gate up down, 2 layer norms
    return [2 * n for n in [vocab * hidden, *layer * 36, hidden, vocab * hidden]]


def scattered(case: str) -> bool:
    """Whether the case's source tensors are each their own allocation."""
    return case.endswith("-scattered") or case == "qwen3-8b"


def case_sizes(case: str, scale: float, small_kib: int = 256) -> list[int]:
    if case == "qwen3-8b":
        return [max(16, int(n * scale) // 16 * 16) for n in qwen3_8b_sizes()]
    case = case.removesuffix("-scattered")
    if case == "large":
        sizes = [64, 128, 256, 512] * 8 + [512]  # 8 GiB
        return [max(1, int(s * scale)) * MIB for s in sizes]
    if case == "small":
        return [small_kib * 1024] * max(1, int(10_000 * scale))
    raise ValueError(case)


def _device(kind: str, index: int) -> str:
    return f"cuda:{index}" if kind == "cuda" else "cpu"


def _fill(buf, version: int, first_word: int = 0) -> None:
    """Version ``version``'s bytes of ``buf``, as the slice from word ``first_word`` of one
    flat buffer: a scattered source and the receiver's flat check agree."""
    import torch

    words = buf.view(torch.int32)
    torch.arange(first_word, first_word + words.numel(), dtype=torch.int32, device=buf.device, out=words)
    words.add_(version * 7919)


def source_proc(address: str, device: str, cases: dict, cycles: int, cmd_q, res_q, transport: str = "auto") -> None:
    import torch

    from mx_refit.publisher import Publisher
    from mx_refit.types import PublishedTensor

    try:
        dev = _device(device, 0)
        if device == "cuda":
            torch.cuda.set_device(0)
        publishers, tensors, buffers = {}, {}, {}
        for case, sizes in cases.items():
            views, off = [], 0
            if scattered(case):  # each its own allocation; filled tensor by tensor
                for i, size in enumerate(sizes):
                    views.append(PublishedTensor(f"layers.{i}.weight",
                                                 torch.empty(size, dtype=torch.uint8, device=dev)))
                buffers[case] = None
            else:
                buf = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
                for i, size in enumerate(sizes):
                    views.append(PublishedTensor(f"layers.{i}.weight", buf[off : off + size]))
                    off += size
                buffers[case] = buf
            tensors[case] = views
            publishers[case] = Publisher(address, f"bench-{case}", source_id=f"bench-{case}/src",
                                         transport_mode=transport)
        res_q.put(("ready", None))
        while True:
            cmd, case, version = cmd_q.get()
            if cmd == "stop":
                break
            pub = publishers[case]
            if version > 1:
                pub.wait_drained(version - 1)
            if buffers[case] is not None:
                _fill(buffers[case], version)
            else:
                word = 0
                for t in tensors[case]:
                    _fill(t.tensor, version, word)
                    word += t.tensor.numel() // 4
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            pub.publish(version, tensors[case])
            res_q.put(("published", {"publish_s": time.perf_counter() - t,
                                     "registrations": pub.transport.registrations}))
        for pub in publishers.values():
            pub.close()
    except BaseException as exc:
        import traceback

        res_q.put(("error", traceback.format_exc()))
        raise SystemExit(1) from exc


def receiver_proc(address: str, device: str, cmd_q, res_q, transport: str = "auto") -> None:
    import torch

    from mx_refit.receive.receiver import Receiver

    try:
        index = 1 if device == "cuda" and torch.cuda.device_count() > 1 else 0
        dev = _device(device, index)
        if device == "cuda":
            torch.cuda.set_device(index)
        receivers = {}
        res_q.put(("ready", None))
        while True:
            cmd, case, version = cmd_q.get()
            if cmd == "stop":
                break
            rec = receivers.get(case) or receivers.setdefault(case, Receiver(address, f"bench-{case}", device=dev,
                                                                                   transport_mode=transport))
            started = time.perf_counter()
            result = rec.refit(version, wait_s=30)
            wall = time.perf_counter() - started
            # Byte check of everything received (on the device: cheap).
            total = sum(t.numel() for _, t in result.tensors)
            expected = torch.empty(total, dtype=torch.uint8, device=dev)
            _fill(expected, version)
            got = torch.cat([t.view(-1) for _, t in result.tensors]) if len(result.tensors) > 1 else result.tensors[0][1]
            s = result.stats
            res_q.put(("pulled", {"seconds": s.seconds, "gbps": s.gbps, "bytes": s.bytes_pulled,
                                  "descriptors": s.descriptors, "new_registrations": s.new_registrations,
                                  "tensors": s.tensors, "plan_s": s.plan_seconds, "refit_wall_s": wall,
                                  "transport": s.transport, "handles_opened": s.handles_opened,
                                  "device_copy_s": rec.transport.ipc().last_copy_s if s.transport == "cuda_ipc" else None,
                                  "read_s": rec.transport.last_read_s,
                                  "copy_kernel": rec.transport.ipc().last_kernel if s.transport == "cuda_ipc" else None,
                                  "ipc_timing": dict(rec.transport.ipc().last_timing),
                                  "phase_s": dict(s.phase_seconds),
                                  "identical": bool(torch.equal(got, expected))}))
        for rec in receivers.values():
            rec.close()
    except BaseException as exc:
        import traceback

        res_q.put(("error", traceback.format_exc()))
        raise SystemExit(1) from exc


def _get(q, kind):
    got, payload = q.get(timeout=900)
    if got == "error":
        raise RuntimeError(payload)
    assert got == kind, (got, kind)
    return payload


def torch_copy_baseline(device: str, sizes: list[int], repeats: int = 5) -> dict:
    """Device-to-device copy of the same bytes: one flat copy and one copy per tensor."""
    import torch

    n = torch.cuda.device_count() if device == "cuda" else 1
    src = torch.empty(sum(sizes), dtype=torch.uint8, device=_device(device, 0))
    dst = torch.empty(sum(sizes), dtype=torch.uint8, device=_device(device, n - 1))
    srcs, dsts, off = [], [], 0
    for size in sizes:
        srcs.append(src[off : off + size])
        dsts.append(dst[off : off + size])
        off += size

    def sync():
        if device == "cuda":
            for i in range(n):
                torch.cuda.synchronize(i)

    def timed(fn, idle_s=0.0):
        fn(); sync()
        best = float("inf")
        for _ in range(repeats):
            time.sleep(idle_s)
            t = time.perf_counter(); fn(); sync()
            best = min(best, time.perf_counter() - t)
        return src.numel() / best / 1e9

    flat = timed(lambda: dst.copy_(src))
    per_tensor = timed(lambda: [d.copy_(s) for d, s in zip(dsts, srcs)])
    # The same flat copy after 20 ms of an idle GPU, as a refit finds it (diagnostic: the
    # ratios use the back-to-back figure above).
    idle = timed(lambda: dst.copy_(src), idle_s=0.02) if device == "cuda" else flat
    return {"torch_copy_flat_gbps": flat, "torch_copy_per_tensor_gbps": per_tensor,
            "torch_copy_flat_after_idle_gbps": idle}


def _broadcast_worker(rank: int, device: str, sizes: list[int], port: int, q) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=2)
    dev = _device(device, rank)
    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
    views, off = [], 0
    for size in sizes:
        views.append(buf[off : off + size])
        off += size

    def timed(fn, repeats=5):
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter(); fn()
            if device == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            best = min(best, time.perf_counter() - t)
        return buf.numel() / best / 1e9

    flat = timed(lambda: dist.broadcast(buf, 0))
    per_tensor = timed(lambda: [dist.broadcast(v, 0) for v in views], repeats=3)
    if rank == 1:
        q.put({f"{backend}_broadcast_flat_gbps": flat, f"{backend}_broadcast_per_tensor_gbps": per_tensor})
    dist.destroy_process_group()


def broadcast_baseline(device: str, sizes: list[int]) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_broadcast_worker, args=(r, device, sizes, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    result = q.get(timeout=900)
    for p in procs:
        p.join(60)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--cases", default="large,small")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every case's size")
    parser.add_argument("--small-kib", type=int, default=256,
                        help="tensor size of the small case (keep 10,000 tensors on a small host)")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the results JSON here too")
    parser.add_argument("--transport", choices=("auto", "nixl", "cuda_ipc"), default="auto")
    parser.add_argument("--no-baselines", action="store_true",
                        help="skip the torch copy and broadcast baselines (control-plane runs)")
    args = parser.parse_args()

    import torch

    from mx_refit.catalog.server import start_embedded

    cases = {c: case_sizes(c, args.scale, args.small_kib) for c in args.cases.split(",")}
    machine = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__}
    if args.device == "cuda":
        machine["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    results = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "machine": machine, "cases": {}}

    server = start_embedded()
    ctx = mp.get_context("spawn")
    src_q, rec_q, res_src, res_rec = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=source_proc, args=(server.address, args.device, cases, args.cycles, src_q, res_src,
                                              args.transport)),
        ctx.Process(target=receiver_proc, args=(server.address, args.device, rec_q, res_rec, args.transport)),
    ]
    for p in procs:
        p.start()
    _get(res_src, "ready"); _get(res_rec, "ready")
    try:
        for case, sizes in cases.items():
            cycles = []
            for version in range(1, args.cycles + 1):
                src_q.put(("publish", case, version))
                published = _get(res_src, "published")
                rec_q.put(("pull", case, version))
                pulled = _get(res_rec, "pulled")
                cycles.append({**pulled, **published})
                print(f"{case} cycle {version}: {pulled['bytes'] / 2**30:.2f} GiB in {pulled['seconds'] * 1e3:.1f} ms "
                      f"= {pulled['gbps']:.1f} GB/s, {pulled['descriptors']} descriptors, "
                      f"new registrations {pulled['new_registrations']}, handles opened {pulled['handles_opened']}, "
                      f"over {pulled['transport']}"
                      + (f" (device copy {pulled['device_copy_s'] * 1e3:.2f} ms, transport read "
                         f"{pulled['read_s'] * 1e3:.2f} ms: "
                         + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in pulled["ipc_timing"].items()) + ")"
                         if pulled["device_copy_s"] else "")
                      + f", identical={pulled['identical']}; whole refit "
                      f"(discover, plan, lease, pull, release, materialize) {pulled['refit_wall_s'] * 1e3:.1f} ms ("
                      + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in pulled["phase_s"].items()) + ")",
                      flush=True)
            results["cases"][case] = {"tensors": len(sizes), "bytes": sum(sizes), "cycles": cycles}
    finally:
        src_q.put(("stop", None, 0)); rec_q.put(("stop", None, 0))
        for p in procs:
            p.join(120)
        server.stop(0)

    colocated = args.device == "cuda" and torch.cuda.device_count() == 1
    for case, sizes in cases.items():
        entry = results["cases"][case]
        steady_cycles = entry["cycles"][1:] or entry["cycles"]
        steady = max(c["gbps"] for c in steady_cycles)
        entry["mx_steady_gbps"] = steady
        # Control plane: the whole refit (discover, plan, lease, pull, release, materialise)
        # against the pull alone, steady cycles.
        entry["steady_pull_ms_median"] = statistics.median(c["seconds"] for c in steady_cycles) * 1e3
        entry["steady_refit_ms_median"] = statistics.median(c["refit_wall_s"] for c in steady_cycles) * 1e3
        entry["steady_refit_over_pull_median"] = statistics.median(
            c["refit_wall_s"] / c["seconds"] for c in steady_cycles
        )
        entry["steady_phase_ms_median"] = {
            phase: statistics.median(c["phase_s"].get(phase, 0.0) for c in steady_cycles) * 1e3
            for phase in steady_cycles[0]["phase_s"]
        }
        if args.no_baselines:
            print(json.dumps({case: {k: v for k, v in entry.items() if k != "cycles"}}), flush=True)
            continue
        entry.update(torch_copy_baseline(args.device, sizes))
        entry["ratio_vs_torch_copy_flat"] = steady / entry["torch_copy_flat_gbps"]
        # The whole refit (steady median) against the flat copy of the same bytes.
        flat_ms = sum(sizes) / entry["torch_copy_flat_gbps"] / 1e6
        entry["torch_copy_flat_ms"] = flat_ms
        entry["ratio_whole_refit_vs_torch_copy_flat"] = flat_ms / entry["steady_refit_ms_median"]
        if colocated:  # NCCL needs one GPU per rank: the colocated baseline is vLLM's ipc path
            from _ipc_baseline import ipc_copy_baseline

            entry.update(ipc_copy_baseline(sizes, per_tensor=True))
            entry["ratio_vs_ipc_open_then_copy_flat"] = steady / entry["ipc_open_then_copy_flat_gbps"]
            entry["ratio_vs_ipc_per_tensor"] = steady / entry["ipc_per_tensor_gbps"]
        else:
            entry.update(broadcast_baseline(args.device, sizes))
            bcast = "nccl" if args.device == "cuda" else "gloo"
            entry["ratio_vs_broadcast_flat"] = steady / entry[f"{bcast}_broadcast_flat_gbps"]
        print(json.dumps({case: {k: v for k, v in entry.items() if k != "cycles"}}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    ok = all(c["identical"] for e in results["cases"].values() for c in e["cycles"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
