"""The checksum kernel (mx_refit.checksum_kernels) and the fused copy-and-checksum of the CUDA
IPC path: interpreted on CPU tensors by Triton's interpreter in a child pytest
(tests/_checksum_interpreted.py: the interpreter is chosen when Triton is first imported), and
compiled on a GPU in the gpu-marked test."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mx_refit import checksum_kernels as kernels
from mx_refit.checksums import source_checksums, span_sums

pytestmark = pytest.mark.timeout(600)
_REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_kernel_interpreted_on_cpu_tensors():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("MX_REFIT_CHECKSUM_TRITON", None)
    env["PYTHONPATH"] = os.pathsep.join([str(_REPO), str(_REPO / "core" / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/_checksum_interpreted.py"],
        cwd=_REPO, env=env, capture_output=True, text=True, timeout=540,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kernel_and_fused_copy_give_the_cpus_sums(monkeypatch):
    """Compiled on the GPU: source sums, the sum-only verify pass and the fused copy give the
    same numbers as the CPU's function on the same bytes (any size, tails included)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(6)
    sizes = [1, 7, 4096, 4096 * 3 + 5, 1 << 20, (1 << 20) + 8 * 3 + 3]
    cpu = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    gpu = [t.cuda() for t in cpu]
    for block in (4096, 1 << 20):
        assert source_checksums(gpu, block).sums == source_checksums(cpu, block).sums
        for c, d in zip(cpu, gpu):
            assert span_sums(d, block).tolist() == span_sums(c, block).tolist()
    # The fused copy: every tensor into one arena at 8-aligned offsets, each a span of blocks.
    block = 4096
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at = (at + n + 255) // 256 * 256
    arena = torch.zeros(at, dtype=torch.uint8, device="cuda")
    spans = [(d.data_ptr(), arena.data_ptr() + o, d.numel(), 0) for d, o in zip(gpu, offsets)]
    tasks = kernels.block_tasks(spans, block)
    tasks[:, 3] = range(len(tasks))
    out = torch.empty(len(tasks), dtype=torch.int64, device="cuda")
    kernels.launch(torch.from_numpy(tasks).cuda(), out, copy=True)
    torch.cuda.synchronize()
    assert out.tolist() == list(source_checksums(cpu, block).sums)
    for c, o in zip(cpu, offsets):
        assert torch.equal(arena[o : o + c.numel()].cpu(), c)
