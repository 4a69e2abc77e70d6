"""A trainer rank in its own process, driven over a Pipe by tests (real NIXL agent, real catalog)."""

from __future__ import annotations

import os
import traceback


def full_tensors(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),  # column (dim 0) shards
        "proj.weight": torch.randn(32, 48, generator=g).to(torch.bfloat16),  # row (dim 1) shards
        "norm.weight": torch.randn(32, generator=g),  # replicated
    }


def shards(seed: int, rank: int, ranks: int):
    """This rank's native shards of :func:`full_tensors`, as PublishedTensors over fresh storage."""
    from mx_refit.types import PublishedTensor, Role

    full = full_tensors(seed)
    emb = full["embed.weight"].chunk(ranks, 0)[rank].contiguous()
    proj = full["proj.weight"].chunk(ranks, 1)[rank].contiguous()
    return [
        PublishedTensor("embed.weight", emb, Role.COLUMN, (64, 32), 0, rank * emb.shape[0]),
        PublishedTensor("proj.weight", proj, Role.ROW, (32, 48), 1, rank * proj.shape[1]),
        PublishedTensor("norm.weight", full["norm.weight"].clone()),
    ]


def run(address: str, model: str, rank: int, ranks: int, conn) -> None:
    from mx_refit.publisher import Publisher
    from mx_refit.types import MeshPosition

    try:
        pub = Publisher(address, model, mesh=MeshPosition(tp_rank=rank, tp_size=ranks), expected_sources=ranks,
                        ttl_s=30.0)
        live = None
        conn.send(("ready", os.getpid()))
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            if cmd == "publish":
                version, seed = arg
                fresh = shards(seed, rank, ranks)
                if live is None:
                    live = fresh
                else:  # the trainer mutates its parameters in place between steps
                    for tensor, new in zip(live, fresh):
                        tensor.tensor.copy_(new.tensor)
                state = pub.publish(version, live)
                conn.send(("published", (state.value, pub.transport.registrations)))
            elif cmd == "drain":
                version, timeout = arg
                try:
                    pub.wait_drained(version, timeout_s=timeout)
                    conn.send(("drained", True))
                except TimeoutError as exc:
                    conn.send(("drained", str(exc)))
        pub.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
