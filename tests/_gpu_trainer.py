"""A CUDA trainer rank in its own process, driven over a Pipe by the CUDA IPC tests: parameters
are views of one DDP-style buffer plus one separately allocated tensor (two regions)."""

from __future__ import annotations

import os
import traceback

SIZES = [1 << 20, 3 << 20, 256 << 10, 5 << 20, 7 << 10]  # bytes of the buffer's views


def fill(t, seed: int) -> None:
    """Deterministic bytes of ``t`` (any uint8 tensor) for ``seed``."""
    import torch

    words = t.view(torch.int32)
    torch.arange(words.numel(), dtype=torch.int32, device=t.device, out=words)
    words.mul_(2654435761 & 0x7FFFFFFF).add_(seed * 7919)


def expected(seed: int, device: str, extra_bytes: int) -> dict:
    import torch

    out = {}
    for i, n in enumerate(SIZES):
        t = torch.empty(n, dtype=torch.uint8, device=device)
        fill(t, seed + i)
        out[f"layers.{i}.weight"] = t
    t = torch.empty(extra_bytes, dtype=torch.uint8, device=device)
    fill(t, seed + 100)
    out["lm_head.weight"] = t
    return out


def allocate(device: str, extra_bytes: int):
    import torch

    from mx_refit.types import PublishedTensor

    buf = torch.empty(sum(SIZES), dtype=torch.uint8, device=device)
    views, off = [], 0
    for i, n in enumerate(SIZES):
        views.append(PublishedTensor(f"layers.{i}.weight", buf[off:off + n]))
        off += n
    views.append(PublishedTensor("lm_head.weight", torch.empty(extra_bytes, dtype=torch.uint8, device=device)))
    return views


def run(address: str, model: str, device: str, conn, extra_bytes: int = 2 << 20, checksums: bool = False) -> None:
    import torch

    from mx_refit.publisher import Publisher

    try:
        torch.cuda.set_device(device)
        pub = Publisher(address, model, ttl_s=30.0, checksums=checksums, checksum_block_bytes=64 << 10)
        live = allocate(device, extra_bytes)
        conn.send(("ready", os.getpid()))
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            if cmd == "publish":
                version, seed = arg
                for i, t in enumerate(live):
                    fill(t.tensor, seed + (100 if t.name == "lm_head.weight" else i))
                torch.cuda.synchronize()  # the bytes are final before anyone may read them
                state = pub.publish(version, live)
                source = pub.client.get_version(model=model, version=version).sources[0] \
                    if state.value == "READY" else None
                handles = [r.handle for r in source.cuda_ipc.regions] if source and source.cuda_ipc else []
                conn.send(("published", {"registrations": pub.transport.registrations,
                                         "exported": bool(handles), "handles": handles,
                                         "ptrs": [t.tensor.data_ptr() for t in live]}))
            elif cmd == "flip":  # one bit of one published tensor, in VRAM, after its checksums were taken
                index, offset, bit = arg
                flat = live[index].tensor.view(-1)
                flat[offset] ^= 1 << bit
                torch.cuda.synchronize()
                conn.send(("flipped", live[index].name))
            elif cmd == "drain":
                pub.wait_drained(arg, timeout_s=30)
                conn.send(("drained", True))
            elif cmd == "reallocate":
                # After a drain: offload (free) every parameter, then allocate afresh.
                released = pub.release_buffers()
                old = [t.tensor.data_ptr() for t in live]
                t = None  # the last loop variable would keep one parameter's storage alive
                del live
                torch.cuda.empty_cache()
                hold = torch.empty(arg, dtype=torch.uint8, device=device)  # shifts the new addresses
                live = allocate(device, extra_bytes)
                conn.send(("reallocated", {"released": released, "old": old, "hold": hold.numel()}))
        pub.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
