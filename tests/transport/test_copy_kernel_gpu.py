"""The batched copy engine on a GPU (``pytest -p mx_refit.testing -m gpu tests/transport``):
the kernel against torch on every alignment class, 2-D blocks and addresses below the anchor;
a refit from separately allocated tensors over CUDA IPC (one kernel, every cycle's bytes
checked); and trainer TP2 -> receiver TP1 on one GPU over CUDA IPC, the row-parallel merge
restaged by one kernel, every HF tensor checked (the benchmarks end to end, as subprocesses)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from mx_refit import copies  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available() or not copies.available(),
                       reason="needs a CUDA device and Triton"),
]

ROOT = Path(__file__).resolve().parents[2]


def reference(blocks: list[copies.Block], memory: torch.Tensor, base: int) -> torch.Tensor:
    out = memory.clone()
    for b in blocks:
        for r in range(b.rows):
            s, d = b.src - base + r * b.src_stride, b.dst - base + r * b.dst_stride
            out[d:d + b.width] = memory[s:s + b.width]
    return out


@pytest.mark.parametrize("align", [16, 4, 2, 1])
def test_the_kernel_copies_what_torch_copies(align: int) -> None:
    rng = random.Random(align)
    memory = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, device="cuda")
    anchor = memory[4 << 20:]  # sources below the anchor: negative offsets
    base = memory.data_ptr()
    blocks, src, dst = [], base + 64, base + (4 << 20) + 64
    for _ in range(200):
        rows = rng.choice([1, 1, 1, 2, 9])
        width = rng.randrange(1, 600) * align
        stride = width + align * rng.randrange(0, 3)
        blocks.append(copies.Block(src, dst, rows, width, stride, stride))
        src += rows * stride + align
        dst += rows * stride + align * 5
    assert dst < base + (8 << 20) and src < base + (4 << 20)
    original = memory.clone()
    want = reference(blocks, memory.cpu(), base)
    batch = copies.BatchedCopy(blocks, anchor, chunk_bytes=64 << 10)
    assert {t.align for t in batch.tables} <= {16, 4, 1} and batch.programs >= len(blocks)
    batch.launch()
    torch.cuda.synchronize()
    assert torch.equal(memory.cpu(), want)
    memory.copy_(original)
    batch.launch()  # the same table, again: a steady cycle
    torch.cuda.synchronize()
    assert torch.equal(memory.cpu(), want)


def run_bench(args: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> dict:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, *args, "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=280, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_separately_allocated_tensors_over_cuda_ipc_every_cycle_identical(tmp_path: Path, mode: str) -> None:
    """1,000 tensors of 64 KiB, each its own allocation, and Qwen3-8B's 399 tensors at 1/100 size:
    one batched kernel a pull (auto) or one copy per range (never), bytes checked every cycle."""
    result = run_bench(["benchmarks/bench_refit.py", "--device", "cuda", "--cases", "small-scattered,qwen3-8b",
                        "--scale", "0.1", "--small-kib", "64", "--cycles", "3", "--no-baselines"],
                       tmp_path, {"MX_REFIT_COPY_KERNEL": mode})
    for case in ("small-scattered", "qwen3-8b"):
        cycles = result["cases"][case]["cycles"]
        assert len(cycles) == 3 and all(c["identical"] for c in cycles), case
        assert all(c["transport"] == "cuda_ipc" for c in cycles), case
        assert all(c["handles_opened"] == 0 and c["new_registrations"] == 0 for c in cycles[1:]), case
        assert cycles[0]["descriptors"] >= 100  # scattered: one range per tensor, nothing coalesces
        if case == "small-scattered" or mode == "never":  # (qwen3-8b's ranges average ~4 MB here)
            assert all(c["copy_kernel"] is (mode == "auto") for c in cycles), case


def test_tp2_trainers_to_a_tp1_receiver_on_one_gpu_over_cuda_ipc(tmp_path: Path) -> None:
    result = run_bench(["benchmarks/bench_scale.py", "--trainer-gpus", "0,0", "--receiver-gpus", "0", "--colocated",
                        "--trainer-layout", "tp2", "--cases", "tp1", "--scale", "0.001", "--dense-layers", "1",
                        "--moe-layers", "2", "--experts", "16", "--cycles", "3", "--no-baselines"], tmp_path)
    case = result["cases"]["tp1"]
    assert result["ok"] is True
    assert case["tensors_checked"] == case["identical"] > 0 and case["mismatched"] == case["missing"] == 0
    assert case["transport"] == ["cuda_ipc"]
    assert case["copy_kernel"] is True
    assert case["handles_opened_steady"] == 0 and case["new_registrations_steady"] == 0
