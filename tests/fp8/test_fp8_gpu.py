"""The GPU quantiser's bytes equal the CPU reference (GPU machines only:
``pytest -p mx_refit.testing -m gpu tests/fp8/test_fp8_gpu.py``).

On CUDA, ``quantize_into`` runs the one-pass Triton kernel (mx_refit._fp8_triton); these tests
fail if it did not load, so they prove the kernel, not the torch fallback."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mx_refit.fp8 import (  # noqa: E402
    Fp8Publishing,
    _kernel_verified,
    _launch,
    quantize_reference,
    scale_name,
    scale_shape,
)
from mx_refit.types import PublishedTensor, Role  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(23)
    cases = [(torch.randn(s, generator=g) * scale) for s, scale in
             [((4096, 4096), 0.02), ((300, 260), 1.0), ((129, 257), 30.0), ((1, 128), 1e-3), ((1024, 12288), 0.05)]]
    zeros = torch.randn(256, 384, generator=g)
    zeros[:128, :128] = 0  # an all-zero block: the floor scale
    zeros[128:, 128:256] *= 1e-7  # a block below the floor
    zeros[0, 300] = 448.0 * 3  # a block whose amax is far above FP8's range
    return [c.to(torch.bfloat16) for c in cases] + [zeros.to(torch.bfloat16), cases[1].to(torch.float32)]


@pytest.mark.parametrize("index", range(7))
def test_the_triton_kernel_equals_the_cpu_reference_bytewise(index: int) -> None:
    x = _inputs()[index]
    q_ref, s_ref = quantize_reference(x)
    xg = x.cuda()
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(scale_shape(tuple(x.shape)), dtype=torch.float32, device="cuda")
    assert _kernel_verified(), "the Triton kernel did not load, or failed its probe: the torch fallback runs"
    _launch(xg, q, s)  # the kernel itself, whatever quantize_into would choose
    torch.cuda.synchronize()
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    # and the reference itself on the GPU (torch ops on the device) agrees too
    q_dev, s_dev = quantize_reference(xg)
    assert torch.equal(q_dev.cpu().view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s_dev.cpu(), s_ref)


def test_publishing_on_the_gpu_reuses_its_buffers_and_matches_the_reference() -> None:
    w = (torch.randn(512, 256, device="cuda") * 0.02).to(torch.bfloat16)
    shard = PublishedTensor("model.layers.0.mlp.gate_proj.weight", w, Role.COLUMN, (1024, 256), 0, 512)
    pub = Fp8Publishing()
    first = {t.name: t.tensor for t in pub.convert([shard])}
    w.mul_(3)
    second = {t.name: t.tensor for t in pub.convert([shard])}
    name = shard.name
    assert second[name].data_ptr() == first[name].data_ptr()  # persistent: registered once
    q_ref, s_ref = quantize_reference(w.cpu())
    assert torch.equal(second[name].cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(second[scale_name(name)].cpu(), s_ref)
    assert second[name].device == w.device and pub.seconds > 0
