"""What a reader pays per refit to take a source's block sums off the wire and compare them:
the older repeated ``sums`` (one Python int per block) against the packed ``sums_le64``.

    python benchmarks/bench_checksum_decode.py --gib 16 --rounds 20 [--device cuda]

For a model of ``--gib`` GiB in 1 MiB blocks (16 GiB: 16,384 sums): ``encode`` (SourceInfo ->
message, the catalog's reply), ``decode`` (message -> SourceInfo, validated, as a reader and the
catalog do it) and ``compare`` (received sums against the published ones: before, a host
gather and comparison of numpy arrays made from the ints; now, the published sums on
``--device`` once per version and one ``torch.equal``). Medians in milliseconds; ``before``
re-creates the previous code's steps (tuple of ints, a check per value, np.array per verify).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from mx_refit.catalog import convert
from mx_refit.catalog.v1 import catalog_pb2 as pb
from mx_refit.checksums import validate_checksums
from mx_refit.types import BlockChecksums, MemType, MeshPosition, PackedSums, Role, SourceInfo, TensorDescriptor

MIB = 1 << 20


def _source(gib: int, sums: tuple[int, ...]) -> SourceInfo:
    tensor = TensorDescriptor(name="w", dtype="bfloat16", global_shape=(gib * 512, MIB), local_shape=(gib * 512, MIB),
                              shard_axis=-1, shard_offset=0, role=Role.REPLICATED, addr=1 << 32,
                              nbytes=gib << 30, mem_type=MemType.DRAM, device_id=0)
    return SourceInfo(source_id="s0", mesh=MeshPosition(), agent_name="a", agent_metadata=b"m",
                      tensors=(tensor,), checksums=BlockChecksums(MIB, sums))


def _median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    import numpy as np
    import torch

    blocks = args.gib * 1024
    rng = np.random.default_rng(0)
    values = rng.integers(-(2**63), 2**63 - 1, size=blocks, dtype=np.int64)
    ints = tuple(values.tolist())
    source = _source(args.gib, ints)
    old_msg, new_msg = pb.SourceInfo(), pb.SourceInfo()
    convert.source_to_proto(source, new_msg)
    old_msg.CopyFrom(new_msg)
    old_msg.checksums.ClearField("sums_le64")
    old_msg.checksums.sums.extend(ints)
    old_wire, new_wire = old_msg.SerializeToString(), new_msg.SerializeToString()
    tensors = source.tensors

    def encode_before() -> None:
        m = pb.BlockChecksums(block_bytes=MIB)
        m.sums.extend(ints)

    held = PackedSums.of(ints)  # what a publisher's and the catalog's SourceInfo now hold

    def encode_after() -> None:
        pb.BlockChecksums(block_bytes=MIB, sums_le64=held.packed)

    def decode_before() -> None:  # the previous reader: a tuple of ints, then one check per value
        msg = pb.SourceInfo.FromString(old_wire)
        sums = tuple(msg.checksums.sums)
        for value in sums:
            if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
                raise ValueError(value)

    def decode_after() -> None:
        msg = pb.SourceInfo.FromString(new_wire)
        validate_checksums(convert.checksums_from_proto(msg.checksums, "source.checksums"), tensors)

    device = torch.device(args.device)
    got = torch.from_numpy(values.copy()).to(device)
    indices = np.arange(blocks, dtype=np.int64)

    def compare_before() -> None:  # sums to the host, then numpy from the ints
        host = got.cpu().numpy()
        want = np.array(ints, dtype=np.int64)[indices]
        assert not np.flatnonzero(host != want).size

    def compare_after() -> None:  # a new version: its sums to the device once, one equal there
        packed = PackedSums(new_msg.checksums.sums_le64)
        want = torch.from_numpy(packed.array().copy()).to(device)
        assert torch.equal(got, want)

    result = {"gib": args.gib, "blocks": blocks, "device": str(device), "rounds": args.rounds,
              "wire_bytes": {"before": len(old_wire), "after": len(new_wire)}}
    for name, before, after in (("encode", encode_before, encode_after), ("decode", decode_before, decode_after),
                                ("compare", compare_before, compare_after)):
        result[name + "_ms"] = {"before": _median_ms(before, args.rounds), "after": _median_ms(after, args.rounds)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
