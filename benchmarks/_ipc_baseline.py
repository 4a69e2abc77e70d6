"""Colocated baseline: the path of vLLM's ``ipc`` weight-transfer engine, on the same bytes.

A producer process (the trainer) holds one buffer on the GPU and hands out CUDA IPC handles the
way torch.multiprocessing does (``reduce_tensor``); the consumer (this process) rebuilds the
tensors from the handles (opening them) and copies them into its own buffer, then synchronises.
Timed: open + copy, best of ``repeats``; the open is timed alone on the first repeat (torch
caches opened handles per process, as a long-lived vLLM worker does).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

__all__ = ["ipc_copy_baseline"]


def _producer(nbytes: int, device: int, offsets: list[tuple[int, int]], conn: Any) -> None:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.set_device(device)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    buf.fill_(7)
    torch.cuda.synchronize()
    flat = reduce_tensor(buf)
    views = [reduce_tensor(buf[o:o + n]) for o, n in offsets] if offsets else []
    conn.send((flat, views))
    conn.recv()  # keep the buffer alive until the consumer is done


def ipc_copy_baseline(sizes: list[int], device: int = 0, repeats: int = 5, per_tensor: bool = False) -> dict[str, float]:
    """GB/s and seconds of (open handle, copy everything, sync) from another process's buffer
    on ``device`` into one of ours on the same device."""
    import torch

    total = sum(sizes)
    offsets: list[tuple[int, int]] = []
    if per_tensor:
        off = 0
        for n in sizes:
            offsets.append((off, n))
            off += n
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(total, device, offsets, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(300):
            raise TimeoutError("IPC baseline producer sent nothing")
        (rebuild, args), views = parent.recv()
        torch.cuda.set_device(device)
        dst = torch.empty(total, dtype=torch.uint8, device=f"cuda:{device}")
        torch.cuda.synchronize()
        t = time.perf_counter()
        src = rebuild(*args)  # cudaIpcOpenMemHandle, as the vLLM worker does per update
        torch.cuda.synchronize()
        open_s = time.perf_counter() - t
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        out = {"ipc_open_s": open_s, "ipc_copy_flat_s": best, "ipc_open_then_copy_flat_s": open_s + best,
               "ipc_copy_flat_gbps": total / best / 1e9, "ipc_open_then_copy_flat_gbps": total / (open_s + best) / 1e9}
        if views:
            dsts = [dst[o:o + n] for o, n in offsets]
            best = float("inf")
            for _ in range(max(1, repeats // 2)):
                t = time.perf_counter()
                for (fn, a), d in zip(views, dsts):
                    d.copy_(fn(*a))  # rebuild (cached handle) + copy per tensor, like load_weights
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t)
            out.update(ipc_per_tensor_s=best, ipc_per_tensor_gbps=total / best / 1e9)
        del src
        return out
    finally:
        parent.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
