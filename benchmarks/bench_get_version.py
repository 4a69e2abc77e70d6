"""Catalog control-plane speed: ``get_version`` of a large manifest, cold vs warm.

An embedded gRPC catalog on 127.0.0.1 holds versions of ``--sources`` sources with
``--descriptors`` descriptors in all and a Megatron-like sidecar (an ``hf_map`` of
``--sidecar-entries`` entries); every version republishes the same buffers. Timed (median and
best of ``--repeat``):

* ``register``: one source's registration, first time (validate + hash) vs republished
  unchanged (validate + equality check, no hashing), in process;
* ``get_version``: a client with an empty cache (cold: the whole manifest on the wire and
  decoded) vs a client that holds the layouts (warm: digests only), over gRPC;
* ``legacy``: the pre-digest path in process (service ``get_version`` with its sidecar copy,
  re-encode, serialize, parse, decode), for comparison with the cold figure;
* ``layout_key``: the receiver's plan cache key, walking every descriptor vs from digests.

    python benchmarks/bench_get_version.py                    # 10,000 descriptors, 2 sources
    python benchmarks/bench_get_version.py --descriptors 7281 --sources 8 --sidecar-entries 18000
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "src"))

from mx_refit.catalog import CatalogClient, CatalogServer, CatalogService, convert
from mx_refit.catalog.v1 import catalog_pb2 as pb
from mx_refit.receive.plans import layout_key as _layout_key
from mx_refit.types import MeshPosition, Role, SourceInfo, TargetLayout, TensorDescriptor

MODEL = "bench"
TTL_S = 3600.0  # sources never heart-beat here: outlive the slowest run


def make_source(rank: int, count: int, sources: int) -> SourceInfo:
    """``count`` bf16 column shards of rank ``rank``, views of one buffer (one region)."""
    base = 0x7F00_0000_0000 + rank * (1 << 36)
    nbytes = 256 * 256 * 2
    tensors = tuple(
        TensorDescriptor(
            name=f"decoder.layers.{i // 8}.mlp.experts.local_experts.{i % 8}.linear_fc1.weight",
            dtype="bfloat16",
            global_shape=(256 * sources, 256),
            local_shape=(256, 256),
            addr=base + i * nbytes,
            nbytes=nbytes,
            role=Role.COLUMN,
            shard_axis=0,
            shard_offset=256 * rank,
        )
        for i in range(count)
    )
    return SourceInfo(
        source_id=f"rank{rank}",
        mesh=MeshPosition(tp_rank=rank, tp_size=sources),
        agent_name=f"agent-{rank}",
        agent_metadata=b"m" * 4096,
        tensors=tensors,
        ready=True,
        regions=((base, count * nbytes),),
    )


def sidecar(entries: int) -> dict[str, Any]:
    return {
        "megatron.config": {"num_layers": 48, "hidden_size": 2048, "num_moe_experts": 128},
        "megatron.hf_map": {
            f"decoder.layers.{i // 64}.mlp.experts.{i % 64}.linear_fc1.weight": [
                f"model.layers.{i // 64}.mlp.experts.{i % 64}.gate_proj.weight",
                f"model.layers.{i // 64}.mlp.experts.{i % 64}.up_proj.weight",
            ]
            for i in range(entries)
        },
    }


def timed(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": round(statistics.median(samples), 3), "best_ms": round(min(samples), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--descriptors", type=int, default=10_000, help="in all sources together")
    parser.add_argument("--sources", type=int, default=2)
    parser.add_argument("--sidecar-entries", type=int, default=0, help="hf_map entries")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)

    per = args.descriptors // args.sources
    sources = [make_source(r, per, args.sources) for r in range(args.sources)]
    extra = sidecar(args.sidecar_entries)
    service = CatalogService()
    result: dict[str, Any] = {
        "machine": platform.node(),
        "python": platform.python_version(),
        "descriptors": per * args.sources,
        "sources": args.sources,
        "sidecar_entries": args.sidecar_entries,
    }

    # Registration, in process: version 1 hashes; later versions reuse (fresh copies each time,
    # as a publisher sends them).
    def fresh(src: SourceInfo) -> SourceInfo:
        return replace(src, tensors=tuple(replace(d) for d in src.tensors))

    first = time.perf_counter()
    for src in sources:
        service.register_source(MODEL, 1, args.sources, fresh(src), extra, ttl_s=TTL_S)
    result["register_first_ms_per_source"] = round(
        (time.perf_counter() - first) * 1e3 / args.sources, 3
    )
    samples = []
    for version in range(2, 2 + args.repeat):
        copies = [fresh(src) for src in sources]
        start = time.perf_counter()
        for copy in copies:
            service.register_source(MODEL, version, args.sources, copy, extra, ttl_s=TTL_S)
        samples.append((time.perf_counter() - start) * 1e3 / args.sources)
    result["register_unchanged_ms_per_source"] = {
        "median_ms": round(statistics.median(samples), 3),
        "best_ms": round(min(samples), 3),
    }

    # The pre-digest path, in process: what the servicer and the client used to do per call.
    def legacy() -> None:
        info = service.get_version(MODEL)
        wire = pb.GetVersionReply(version_info=convert.version_info_to_proto(info))
        data = wire.SerializeToString()
        convert.version_info_from_proto(pb.GetVersionReply.FromString(data).version_info)

    result["legacy_in_process"] = timed(legacy, args.repeat)

    with CatalogServer(service=service) as server:
        clients: list[CatalogClient] = []

        def cold() -> None:
            client = clients.pop()
            client.get_version(MODEL)

        cold_samples = []
        for _ in range(args.repeat):
            client = CatalogClient(server.address)
            client.list_versions(MODEL)  # open the channel outside the timing
            clients.append(client)
            cold_samples.append(timed(cold, 1)["best_ms"])
            client.close()
        result["get_version_cold"] = {
            "median_ms": round(statistics.median(cold_samples), 3),
            "best_ms": round(min(cold_samples), 3),
        }

        with CatalogClient(server.address) as warm:
            full = warm.get_version(MODEL)
            result["get_version_warm"] = timed(lambda: warm.get_version(MODEL), args.repeat)
            stats = warm.manifest_stats
            result["warm_descriptors_sent_after_first"] = stats.descriptors_sent - per * args.sources
            with CatalogClient(server.address, manifest_cache_versions=0) as uncached:
                uncached.get_version(MODEL)
                assert uncached.get_version(MODEL) == warm.get_version(MODEL) == full

    target = TargetLayout()
    bare = replace(
        full,
        sidecar_digest="",
        sources=tuple(replace(s, layout_digest="") for s in full.sources),
    )
    result["layout_key_walk"] = timed(lambda: _layout_key(bare, target), args.repeat)
    result["layout_key_digests"] = timed(lambda: _layout_key(full, target), args.repeat)

    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
