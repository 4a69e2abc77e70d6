"""VRAM transfers between two processes (GPU machines only: ``pytest -m gpu tests/transport``).

With two GPUs the source lives on GPU 1 and the reader on GPU 0, so the device ids of both sides
are exercised; with one GPU both processes share it (UCX moves the bytes over CUDA IPC).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mx_refit.transport import coalesce, plan_row_slice  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SEED = 31


@pytest.fixture(scope="module")
def devices() -> tuple[int, int]:
    """(source device, reader device)."""
    return (1, 0) if torch.cuda.device_count() >= 2 else (0, 0)


@pytest.fixture(scope="module")
def gpu_source(spawn_source: Any, devices: tuple[int, int]) -> Any:
    proc = spawn_source("src-gpu", SEED, device=f"cuda:{devices[0]}")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def setup(reader: Any, gpu_source: Any, patterns: Any, devices: tuple[int, int]) -> dict[str, Any]:
    src_dev, dst_dev = devices
    torch.cuda.set_device(dst_dev)
    arena = torch.zeros(16 << 20, dtype=torch.uint8, device=f"cuda:{dst_dev}")
    assert reader.register(arena)
    reader.connect("gpu", gpu_source.agent, gpu_source.metadata)
    expected = {k: v.to(f"cuda:{dst_dev}") for k, v in patterns.make_patterns(SEED).items()}
    kw = dict(remote_mem="VRAM", remote_dev=src_dev, local_mem="VRAM", local_dev=dst_dev)
    return {"arena": arena, "expected": expected, "kw": kw}


def test_vram_full_slice_and_gather(reader: Any, gpu_source: Any, setup: dict[str, Any]) -> None:
    arena, expected, kw = setup["arena"], setup["expected"], setup["kw"]
    blob, n, base = gpu_source.addr("blob"), expected["blob"].numel(), arena.data_ptr()
    arena.zero_()
    reader.read("gpu", [(blob, base, n)], **kw)
    torch.cuda.synchronize()
    assert torch.equal(arena[:n], expected["blob"])

    arena.zero_()
    off, m = 1234567, (1 << 20) + 3
    reader.read("gpu", [(blob + off, base + 777, m)], **kw)
    torch.cuda.synchronize()
    assert torch.equal(arena[777 : 777 + m], expected["blob"][off : off + m])
    assert not arena[:777].any()

    ops = [(blob + i * 8192, base + i * 8192, 4096) for i in range(64)]  # every other 4 KiB
    tail = 64 * 8192
    ops += [(blob + tail, base + tail, 4096), (blob + tail + 4096, base + tail + 4096, 4096)]
    before = (reader.transfers, reader.descriptors_posted)
    stats = reader.read("gpu", ops, **kw)
    assert reader.transfers - before[0] == 1
    assert reader.descriptors_posted - before[1] == len(coalesce(ops)) == stats.descriptors == 65
    torch.cuda.synchronize()
    for r, l, k in ops:
        assert torch.equal(arena[l - base : l - base + k], expected["blob"][r - blob : r - blob + k])


@pytest.mark.parametrize("force", ["rows", "hull"])
def test_vram_row_slice(reader: Any, gpu_source: Any, setup: dict[str, Any], force: str) -> None:
    arena, matrix, kw = setup["arena"], setup["expected"]["matrix"], setup["kw"]
    rows, cols = matrix.shape
    item = matrix.element_size()
    plan = plan_row_slice(gpu_source.addr("matrix"), rows, cols * item, 100 * item, 164 * item, force=force)
    landing = arena[: plan.landing_bytes]
    reader.read("gpu", plan.local_ops(landing.data_ptr()), **kw)
    out = torch.empty(rows, 64, dtype=matrix.dtype, device=matrix.device)
    plan.extract(landing, out)
    torch.cuda.synchronize()
    assert torch.equal(out, matrix[:, 100:164])
    regs = reader.registrations
    assert not reader.register(landing) and reader.registrations == regs
