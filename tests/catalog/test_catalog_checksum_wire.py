"""Block sums on the wire (catalog.proto BlockChecksums): current writers send the packed
``sums_le64``; an older writer's repeated ``sums`` is still accepted; bad packed bytes are refused
naming the field and the value. Real gRPC server on 127.0.0.1, raw stub for the wire forms."""

from __future__ import annotations

import dataclasses
import re
import struct

import grpc
import numpy as np
import pytest
from catalog_factories import desc, source

from mx_refit.catalog import CatalogClient
from mx_refit.catalog import convert
from mx_refit.catalog.v1 import catalog_pb2 as pb
from mx_refit.catalog.v1 import catalog_pb2_grpc
from mx_refit.checksums import validate_checksums
from mx_refit.types import BlockChecksums, PackedSums

BLOCK = 4096
SUMS = (-(2**63), 2**63 - 1, 0, -1, 1, 12345678901234, -987654321, 7)  # 8 blocks, int64 extremes


def _source():  # one 32 KiB tensor: 8 blocks of 4 KiB
    return source(tensors=(desc(global_shape=(1024, 8)),))


def _request(model: str, checksums: BlockChecksums) -> pb.RegisterSourceRequest:
    msg = pb.RegisterSourceRequest(model=model, version=1, expected_sources=1, ttl_s=30)
    convert.source_to_proto(dataclasses.replace(_source(), checksums=checksums), msg.source)
    return msg


def _register_ready(stub, request: pb.RegisterSourceRequest) -> None:
    stub.RegisterSource(request)
    stub.MarkReady(pb.MarkReadyRequest(model=request.model, version=1, source_id=request.source.source_id))


@pytest.fixture
def stub(mx_catalog):
    with grpc.insecure_channel(mx_catalog) as channel:
        yield catalog_pb2_grpc.CatalogServiceStub(channel)


@pytest.fixture
def model(request):
    return re.sub(r"\W", "_", request.node.name)


def test_an_older_writers_repeated_sums_are_accepted_and_read_back_packed(mx_catalog, stub, model):
    request = _request(model, BlockChecksums(BLOCK, SUMS))
    request.source.checksums.ClearField("sums_le64")  # what a writer before sums_le64 sends
    request.source.checksums.sums.extend(SUMS)
    _register_ready(stub, request)
    with CatalogClient(mx_catalog, timeout_s=10) as client:
        got = client.get_version(model, 1).sources[0].checksums
    assert got is not None and got.block_bytes == BLOCK
    assert isinstance(got.sums, PackedSums) and got.sums == SUMS and list(got.sums.array()) == list(SUMS)
    wire = stub.GetVersion(pb.GetVersionRequest(model=model, version=1)).version_info.sources[0].checksums
    assert wire.sums_le64 == struct.pack("<8q", *SUMS) and len(wire.sums) == 0  # sent packed only


def test_packed_sums_are_decoded_as_one_view_of_the_wire_bytes(stub, model):
    request = _request(model, BlockChecksums(BLOCK, SUMS))
    assert request.source.checksums.sums_le64 == struct.pack("<8q", *SUMS) and len(request.source.checksums.sums) == 0
    decoded = convert.source_from_proto(request.source).checksums
    assert decoded is not None and isinstance(decoded.sums, PackedSums)
    assert decoded.sums.array().dtype == np.dtype("<i8") and tuple(decoded.sums) == SUMS
    assert validate_checksums(decoded, _source().tensors) is decoded  # no per-block re-check or copy
    _register_ready(stub, request)
    assert stub.GetVersion(pb.GetVersionRequest(model=model, version=1)).version_info.sources[0].checksums.sums_le64 \
        == request.source.checksums.sums_le64


@pytest.mark.parametrize(("packed", "message"), [
    (struct.pack("<8q", *SUMS)[:-4], "source.checksums.sums_le64: 60 bytes, not a multiple of 8"),
    (struct.pack("<7q", *SUMS[:7]), "source.checksums.sums: 7 values, but 1 tensors in blocks of 4096 bytes make 8 blocks"),
    (b"", "source.checksums.sums: 0 values, but 1 tensors in blocks of 4096 bytes make 8 blocks"),
])
def test_bad_packed_sums_are_refused_naming_the_field_and_the_value(stub, model, packed, message):
    request = _request(model, BlockChecksums(BLOCK, SUMS))
    request.source.checksums.sums_le64 = packed
    with pytest.raises(grpc.RpcError) as info:
        stub.RegisterSource(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()
    with pytest.raises(grpc.RpcError) as missing:
        stub.GetVersion(pb.GetVersionRequest(model=model, version=1))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND  # nothing was registered
