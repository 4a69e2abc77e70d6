"""receive_mode direct on a GPU (``pytest -m gpu tests/receive/test_direct_gpu.py``): parameters
in VRAM written through a 1 MiB VRAM buffer, chunk after chunk, every version byte-identical and
the CUDA allocation peak during the refit within the buffer."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mx_refit.publisher import Publisher  # noqa: E402
from mx_refit.receive.receiver import Receiver  # noqa: E402
from mx_refit.types import PublishedTensor  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BUFFER = 1 << 20
SHAPES = {"embed": (4096, 512), "qkv": (1536, 512), "down": (512, 2048), "norm": (512,)}  # 7.5 MiB bf16


@pytest.mark.parametrize("transport_mode", ["auto", "nixl"])
def test_direct_refit_in_vram_through_a_small_buffer(mx_catalog, mx_model_name, transport_mode):
    dev = "cuda:0"
    live = {n: torch.zeros(s, dtype=torch.bfloat16, device=dev) for n, s in SHAPES.items()}
    engine = {n: torch.zeros(s, dtype=torch.bfloat16, device=dev) for n, s in SHAPES.items()}
    with Publisher(mx_catalog, mx_model_name, expected_sources=1, transport_mode=transport_mode) as pub, Receiver(
        mx_catalog, mx_model_name, engine=engine, device=dev, receive_mode="direct", receive_buffer_bytes=BUFFER,
        transport_mode=transport_mode,
    ) as rec:
        for version in (1, 2, 3):
            g = torch.Generator(device=dev).manual_seed(version)
            for t in live.values():
                t.copy_(torch.randn(t.shape, generator=g, device=dev).to(torch.bfloat16))
            pub.publish(version, [PublishedTensor(n, t) for n, t in live.items()])
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            stats = rec.refit(version).stats
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(dev) - before
            for name, tensor in live.items():
                assert torch.equal(engine[name], tensor), (version, name)
            model_bytes = sum(t.numel() * t.element_size() for t in live.values())
            assert stats.receive_mode == "direct" and stats.chunks >= model_bytes // BUFFER, stats.chunks
            assert peak <= BUFFER, peak
            pub.wait_drained(version, timeout_s=30)
