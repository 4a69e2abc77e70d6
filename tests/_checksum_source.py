"""Sources in their own process for the checksum tests, driven over a Pipe (real NIXL agent).

The planner harness cuts a model's native Megatron shards per source rank and lays each rank's
shards out in one byte blob (with gaps between tensors, like an allocator); here every blob is
real memory, its tensors are published as views of it (in place, checksums on), and the test
flips single bits of a blob between the publish and the receiver's pull.
"""

from __future__ import annotations

import os
import traceback


def run(address: str, model: str, spec_kwargs: dict, tp: int, block_bytes: int, conn) -> None:
    try:
        import torch

        import mx_refit
        from mx_refit.publisher import Publisher
        from mx_refit.types import PublishedTensor
        from tests.layout._planner_harness import ModelSpec, SourceLayout, publish

        published = publish(ModelSpec(model, **spec_kwargs), SourceLayout(tp=tp))
        transport = mx_refit.shared_transport()
        ranks = []
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
        conn.send(("ready", os.getpid()))
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            if cmd == "publish":
                for pub, _, views in ranks:
                    pub.publish(arg, views, sidecar=published.version.sidecar)
                conn.send(("published", None))
            elif cmd == "layout":  # what was published where: the test picks bytes to flip
                layout = {}
                for pub, blob, views in ranks:
                    base = blob.data_ptr()
                    layout[pub.source_id] = [
                        (v.name, v.tensor.data_ptr() - base, v.tensor.numel() * v.tensor.element_size(),
                         v.tensor.data_ptr()) for v in views
                    ]
                conn.send(("layout", (layout, {n: t.clone() for n, t in published.hf.items()})))
            elif cmd == "flip":  # XOR one bit of a source's blob, in this process's memory
                source_id, offset, bit = arg
                blob = next(blob for pub, blob, _ in ranks if pub.source_id == source_id)
                blob[offset] ^= 1 << bit
                conn.send(("flipped", int(blob[offset])))
        for pub, _, _ in ranks:
            pub.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
