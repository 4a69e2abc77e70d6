"""Compile targets on the wire and in the catalog: per-tensor compile_target/compile_metadata,
per-source revision and compatibility attributes (issue 23). Real gRPC server, both stores."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import pytest
from catalog_factories import FakeClock, desc, source
from catalog_stores import STORES, build_store

from mx_refit.catalog import CatalogClient, CatalogServer, CatalogService
from mx_refit.catalog.convert import descriptor_to_proto, source_from_proto, source_to_proto
from mx_refit.catalog.digests import layout_digest
from mx_refit.catalog.v1 import catalog_pb2 as pb
from mx_refit.catalog.validation import CatalogLimits, validate_source
from mx_refit.errors import InvalidArgument
from mx_refit.types import CompileCompat, SourceInfo, TensorDescriptor

COMPAT = CompileCompat(
    framework="megatron-core", torch_version="2.11.0", cuda_version="13.0", triton_version="3.6.0",
    gpu_arch="sm_90", compile_config_digest="fp8_block:128x128",
)


def fp8(name: str = "w", **kwargs: object) -> TensorDescriptor:
    base = desc(name, dtype="float8_e4m3fn", global_shape=(256, 128))
    return dataclasses.replace(base, compile_target="fp8_block", compile_metadata={"block_size": "128,128"}, **kwargs)


def test_a_default_descriptor_is_byte_identical_to_one_without_the_new_fields() -> None:
    d = desc("w", extras={"k": 1})
    legacy = pb.TensorDescriptor(
        name=d.name, dtype=d.dtype, global_shape=d.global_shape, local_shape=d.local_shape, addr=d.addr,
        nbytes=d.nbytes, role=pb.ROLE_REPLICATED, shard_axis=-1, shard_offset=0, mem_type=pb.MEM_TYPE_DRAM,
        extras_json='{"k":1}',
    )
    assert descriptor_to_proto(d).SerializeToString(deterministic=True) == legacy.SerializeToString(deterministic=True)
    src = source(tensors=(d,))
    assert not source_to_proto(src).HasField("compat") and source_to_proto(src).revision == ""


def test_compile_fields_round_trip_through_the_proto() -> None:
    src = dataclasses.replace(source(tensors=(fp8(), desc("norm", addr=0x9000))), revision="blake2b:ab12", compat=COMPAT)
    back = source_from_proto(source_to_proto(src))
    assert back == src
    assert back.tensors[0].compile_target == "fp8_block" and back.tensors[1].compile_target == "hf_raw"
    assert back.tensors[0].compile_metadata == {"block_size": "128,128"}


def test_the_layout_digest_tells_compile_targets_apart_and_keeps_hf_raw_digests() -> None:
    raw = desc("w")
    assert layout_digest((raw,), ()) == layout_digest((dataclasses.replace(raw, compile_target="hf_raw"),), ())
    compiled = dataclasses.replace(raw, compile_target="vllm_fused")
    assert layout_digest((compiled,), ()) != layout_digest((raw,), ())
    other_meta = dataclasses.replace(compiled, compile_metadata={"a": "b"})
    assert layout_digest((compiled,), ()) != layout_digest((other_meta,), ())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"compile_target": "FP8-Block"}, r"source\.tensors\[0\]\.compile_target: 'FP8-Block' is not a compile target"),
        ({"compile_target": 7}, r"source\.tensors\[0\]\.compile_target: 7 is not a compile target"),
        ({"compile_target": "hf_raw", "compile_metadata": {"a": "b"}},
         r"source\.tensors\[0\]\.compile_metadata: .* compile target 'hf_raw', which takes none"),
        ({"compile_metadata": {"a": 1}}, r"source\.tensors\[0\]\.compile_metadata\['a'\]: 1 must be a string"),
        ({"compile_metadata": {"": "x"}}, r"source\.tensors\[0\]\.compile_metadata: key '' must be a non-empty"),
        ({"compile_metadata": {str(i): "" for i in range(65)}}, r"compile_metadata: 65 entries exceed the limit of 64"),
        ({"compile_metadata": ["a"]}, r"compile_metadata: must be a mapping of strings, got list"),
    ],
)
def test_the_catalog_rejects_bad_compile_fields_naming_field_and_value(change: dict, message: str) -> None:
    bad = dataclasses.replace(fp8(), **change)
    with pytest.raises(InvalidArgument, match=message):
        validate_source(source(tensors=(bad,)), CatalogLimits())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"revision": "has space"}, r"source\.revision: 'has space' must be at most 128 characters"),
        ({"revision": "x" * 129}, r"source\.revision: .* must be at most 128"),
        ({"compat": "sm_90"}, r"source\.compat: expected a CompileCompat, got str"),
        ({"compat": CompileCompat(gpu_arch="sm\n90")}, r"source\.compat\.gpu_arch: 'sm\\n90' must be a printable"),
        ({"compat": CompileCompat(torch_version=2)}, r"source\.compat\.torch_version: 2 must be a printable"),  # type: ignore[arg-type]
    ],
)
def test_the_catalog_rejects_bad_source_attributes(change: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        validate_source(dataclasses.replace(source(), **change), CatalogLimits())


@pytest.fixture(scope="module", params=STORES)
def client(request: pytest.FixtureRequest) -> Iterator[CatalogClient]:
    service = CatalogService(store=build_store(request.param, request, FakeClock()))
    with CatalogServer(service=service) as server, CatalogClient(server.address, timeout_s=10) as cl:
        yield cl


@pytest.fixture
def model(request: pytest.FixtureRequest) -> str:
    return re.sub(r"\W", "_", request.node.name)


def test_a_compiled_source_round_trips_through_a_real_server(client: CatalogClient, model: str) -> None:
    src: SourceInfo = dataclasses.replace(
        source(tensors=(fp8(), desc("norm", addr=0x9000))), revision="r-1", compat=COMPAT
    )
    client.register_source(model, 1, 1, src, None, ttl_s=30)
    client.mark_ready(model, 1, src.source_id)
    got = client.get_version(model).sources[0]
    assert got == dataclasses.replace(src, ready=True)
    assert got.compat == COMPAT and got.revision == "r-1"
    # Re-sending the same registration is still a no-op; a bad target is refused over the wire.
    with pytest.raises(InvalidArgument, match=r"compile_target: 'Bad' is not a compile target"):
        client.register_source(model, 2, 1, source(tensors=(dataclasses.replace(fp8(), compile_target="Bad"),)), None, ttl_s=30)
