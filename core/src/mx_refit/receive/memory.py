"""Refuse a receive arena the device cannot hold, before allocating it.

An inference engine takes most of its GPU up front (vLLM's ``gpu_memory_utilization``); an
arena allocated after that fails with an out-of-memory error in the middle of a refit. The
check runs first and says, in one line, what is needed, what is free and what to do instead.
"""

from __future__ import annotations

from mx_refit.errors import FailedPrecondition

__all__ = ["check_arena_fits", "device_free_bytes"]

GIB = float(1 << 30)


def device_free_bytes(device: str) -> int | None:
    """Bytes an allocation on ``device`` can still get: the driver's free memory plus what
    torch's caching allocator holds unused. ``None`` for host memory (not checked)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(dev)
    return int(free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))


def check_arena_fits(nbytes: int, device: str, free: int | None, *, reader: str) -> None:
    """Raise :class:`FailedPrecondition` when ``nbytes`` more do not fit in ``free``."""
    if free is None or nbytes <= free:
        return
    raise FailedPrecondition(
        f"receiver {reader!r}: the receive arena needs {nbytes / GIB:.2f} GiB on {device} but "
        f"{free / GIB:.2f} GiB are free; receive into host memory instead (device='cpu'; vLLM: "
        f"arena_device='cpu'), pull only this rank's bytes (full_tensors: false; vLLM: rank_exact), "
        f"or leave the engine less of the device"
    )
