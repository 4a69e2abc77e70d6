"""A delta-publishing source process for tests/test_delta.py, driven over a Pipe (real NIXL agent).

The planner harness cuts a model's native Megatron shards per source rank into one byte blob per
rank; every blob is real memory, its tensors are published as views of it with
``delta="auto"``. Before each version after the first, an optimizer-like step changes the blobs
in place: ~2% of every dense tensor's BF16 elements move by about a rounding step, some tensors
change densely, and two experts of every three are left untouched (the router did not pick them).
"""

from __future__ import annotations

import os
import traceback


def run(address: str, model: str, spec_kwargs: dict, tp: int, block_bytes: int, conn) -> None:
    try:
        import mx_refit
        from tests.layout import _planner_harness

        _planner_harness._PM = False  # reference math, not Bridge (slow import)
        served = _Model(address, model, spec_kwargs, tp, block_bytes, mx_refit.shared_transport())
        conn.send(("ready", os.getpid()))
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            conn.send(served.publish(arg))
        served.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class _Model:
    def __init__(self, address, model, spec_kwargs, tp, block_bytes, transport) -> None:
        import torch

        from mx_refit.publisher import Publisher
        from mx_refit.types import PublishedTensor
        from tests.layout._planner_harness import ModelSpec, SourceLayout, publish

        self.published = published = publish(ModelSpec(model, **spec_kwargs), SourceLayout(tp=tp))
        self.ranks = []
        for source in published.version.sources:
            base, blob = published.memory[source.source_id]
            views = [
                PublishedTensor(
                    d.name,
                    blob[d.addr - base : d.addr - base + d.nbytes].view(getattr(torch, d.dtype)).view(d.local_shape),
                    d.role, d.global_shape, d.shard_axis, d.shard_offset, dict(d.extras),
                )
                for d in source.tensors
            ]
            pub = Publisher(
                address, model, mesh=source.mesh, expected_sources=len(published.version.sources),
                source_id=f"{model}/{source.source_id}", transport=transport, delta="auto",
                checksum_block_bytes=block_bytes, delta_anchor_every=100,
            )
            self.ranks.append((pub, views))

    def publish(self, version: int):
        import torch

        if version > 1:
            for pub, views in self.ranks:
                pub.wait_drained(version - 1, timeout_s=60)
                for i, view in enumerate(views):
                    if "experts" in view.name and (i + version) % 3:
                        continue  # untouched
                    t = view.tensor
                    gen = torch.Generator().manual_seed(version * 1000 + i)
                    mask = torch.rand(t.shape, generator=gen) < (0.9 if i % 7 == 0 else 0.02)
                    moved = (t.float() * 1.01 + 1e-3).to(t.dtype)
                    t[mask] = moved[mask]
        for pub, views in self.ranks:
            pub.publish(version, views, sidecar=self.published.version.sidecar)
        return ("published", None)

    def close(self) -> None:
        for pub, _ in self.ranks:
            pub.close()
