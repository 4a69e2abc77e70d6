"""Sources in their own process for the checksum tests, driven over a Pipe (real NIXL agent).

The planner harness cuts a model's native Megatron shards per source rank and lays each rank's
shards out in one byte blob (with gaps between tensors, like an allocator); here every blob is
real memory, its tensors are published as views of it (in place, checksums on), and the test
flips single bits of a blob between the publish and the receiver's pull.
"""

from __future__ import annotations

import os
import traceback


def run(address: str, models: dict[str, int], spec_kwargs: dict, block_bytes: int, conn) -> None:
    """Publish each model of ``models`` (name -> source TP size) from this process."""
    try:
        import mx_refit
        from tests.layout import _planner_harness

        # Megatron globals from the reference math, not Bridge (its import alone takes ~20 s on
        # CI): the planner suite checks Bridge fidelity; these tests check what reaches the engine.
        _planner_harness._PM = False
        transport = mx_refit.shared_transport()
        served = {model: _Model(address, model, tp, spec_kwargs, block_bytes, transport) for model, tp in models.items()}
        conn.send(("ready", os.getpid()))
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            model, arg = arg
            conn.send(served[model].handle(cmd, arg))
        for model in served.values():
            model.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class _Model:
    def __init__(self, address, model, tp, spec_kwargs, block_bytes, transport) -> None:
        import torch

        from mx_refit.publisher import Publisher
        from mx_refit.types import PublishedTensor
        from tests.layout._planner_harness import ModelSpec, SourceLayout, publish

        self.published = published = publish(ModelSpec(model, **spec_kwargs), SourceLayout(tp=tp))
        self.ranks = ranks = []
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
                source_id=f"{model}/{source.source_id}", transport=transport, checksums=True,
                checksum_block_bytes=block_bytes,
            )
            ranks.append((pub, blob, views))

    def handle(self, cmd: str, arg):
        if cmd == "publish":
            for pub, _, views in self.ranks:
                pub.publish(arg, views, sidecar=self.published.version.sidecar)
            return ("published", None)
        if cmd == "layout":  # what was published where: the test picks bytes to flip
            layout = {}
            for pub, blob, views in self.ranks:
                base = blob.data_ptr()
                layout[pub.source_id] = [
                    (v.name, v.tensor.data_ptr() - base, v.tensor.numel() * v.tensor.element_size(),
                     v.tensor.data_ptr()) for v in views
                ]
            return ("layout", (layout, {n: t.clone() for n, t in self.published.hf.items()}))
        if cmd == "flip":  # XOR one bit of a source's blob, in this process's memory
            source_id, offset, bit = arg
            blob = next(blob for pub, blob, _ in self.ranks if pub.source_id == source_id)
            blob[offset] ^= 1 << bit
            return ("flipped", int(blob[offset]))
        return ("error", f"unknown command {cmd!r}")

    def close(self) -> None:
        for pub, _, _ in self.ranks:
            pub.close()
