"""A source's NIXL agent metadata stays off the wire while the reader holds it (real gRPC).

A NIXL agent's metadata lists every region it registered (~44 bytes each), so a source of
10,000 separately allocated tensors carried ~440 KB of it in every reply, after its layout had
been left out. The catalog digests it (``agent_metadata_digest``) and leaves it out for a reader
that announces the digest (``known_agent_metadata_digests``); a changed agent (a restart, a new
registration) is sent again.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import grpc
import pytest
from catalog_factories import FakeClock, desc

from mx_refit.catalog import CatalogClient, CatalogServer, CatalogService, convert
from mx_refit.catalog.digests import NOTHING_KNOWN, UnknownDigest, metadata_digest
from mx_refit.catalog.v1 import catalog_pb2 as pb
from mx_refit.catalog.v1 import catalog_pb2_grpc
from mx_refit.types import MeshPosition, SourceInfo


def source(count: int, metadata: bytes) -> SourceInfo:
    """``count`` separately allocated DRAM tensors (each its own region), fresh objects."""
    tensors = tuple(desc(f"layers.{i}.w", addr=0x7F00_0000_0000 + i * 8192) for i in range(count))
    return SourceInfo(source_id="src", mesh=MeshPosition(), agent_name="agent", agent_metadata=metadata,
                      tensors=tensors, ready=True, regions=tuple((d.addr, d.nbytes) for d in tensors))


def region_list(count: int, tag: bytes = b"") -> bytes:
    """Metadata the size a NIXL agent's is with ``count`` registered regions."""
    return tag + b"".join(i.to_bytes(8, "little") * 5 + b"DRAM" for i in range(count))


@pytest.fixture(scope="module")
def server() -> Iterator[CatalogServer]:
    with CatalogServer(service=CatalogService(clock=FakeClock())) as srv:
        yield srv


@pytest.fixture
def model(request: pytest.FixtureRequest) -> str:
    return re.sub(r"\W", "_", request.node.name)


def warm_reply(server: CatalogServer, model: str, info: object, *, announce_metadata: bool = True) -> pb.GetVersionReply:
    """The reply to a reader announcing what it holds of ``info``."""
    with grpc.insecure_channel(server.address) as channel:
        stub = catalog_pb2_grpc.CatalogServiceStub(channel)  # type: ignore[no-untyped-call]
        sources = info.sources  # type: ignore[attr-defined]
        return stub.GetVersion(pb.GetVersionRequest(
            model=model,
            known_layout_digests={s.source_id: s.layout_digest for s in sources},
            known_sidecar_digest=info.sidecar_digest,  # type: ignore[attr-defined]
            known_agent_metadata_digests={s.source_id: s.agent_metadata_digest for s in sources}
            if announce_metadata else {},
        ))


@pytest.mark.parametrize("count", [10, 10_000])
def test_a_warm_reply_carries_no_per_region_bytes(server: CatalogServer, model: str, count: int) -> None:
    metadata = region_list(count)
    with CatalogClient(server.address) as client:
        client.register_source(model, 1, 1, source(count, metadata), {})
        first = client.get_version(model)
        assert first.sources[0].agent_metadata == metadata
        assert first.sources[0].agent_metadata_digest == metadata_digest(metadata) != ""
        client.register_source(model, 2, 1, source(count, metadata), {})
        warm = warm_reply(server, model, first)
        (sent,) = warm.version_info.sources
        assert sent.agent_metadata_omitted and not sent.agent_metadata and sent.tensors_omitted
        assert warm.ByteSize() < 400, warm  # the same whatever the count
        before = client.manifest_stats
        second = client.get_version(model)
        after = client.manifest_stats
    assert (after.metadata_omitted - before.metadata_omitted, after.metadata_sent - before.metadata_sent) == (1, 0)
    assert second.sources[0].agent_metadata is first.sources[0].agent_metadata  # the held bytes
    assert second.sources[0].tensors is first.sources[0].tensors


def test_a_reader_that_does_not_announce_metadata_gets_it(server: CatalogServer, model: str) -> None:
    """An older reader (layouts announced, metadata not) still gets the metadata in full."""
    metadata = region_list(100)
    with CatalogClient(server.address) as client:
        client.register_source(model, 1, 1, source(100, metadata), {})
        first = client.get_version(model)
        client.register_source(model, 2, 1, source(100, metadata), {})
    (sent,) = warm_reply(server, model, first, announce_metadata=False).version_info.sources
    assert sent.tensors_omitted and not sent.agent_metadata_omitted and sent.agent_metadata == metadata


@pytest.mark.parametrize("change", ["restart", "new-registration"])
def test_changed_metadata_is_sent_again(server: CatalogServer, model: str, change: str) -> None:
    """A restarted agent (same layout) or one more registered region (a new tensor) changes
    the metadata: the reply carries it, and the reader uses the new bytes."""
    count = 50
    with CatalogClient(server.address) as client:
        client.register_source(model, 1, 1, source(count, region_list(count)), {})
        first = client.get_version(model)
        if change == "restart":
            new, count2 = region_list(count, b"restarted"), count
        else:
            new, count2 = region_list(count + 1), count + 1
        client.register_source(model, 2, 1, source(count2, new), {})
        before = client.manifest_stats
        second = client.get_version(model)
        after = client.manifest_stats
    assert after.metadata_sent - before.metadata_sent == 1 and after.metadata_omitted == before.metadata_omitted
    (got,) = second.sources
    assert got.agent_metadata == new and got.agent_metadata_digest == metadata_digest(new)
    assert got.agent_metadata_digest != first.sources[0].agent_metadata_digest
    assert (got.tensors is first.sources[0].tensors) == (change == "restart")  # the layout changed with it


def test_an_omitted_metadata_the_reader_does_not_hold_is_an_error_not_empty_bytes() -> None:
    service = CatalogService(clock=FakeClock())
    service.register_source("m", 1, 1, source(3, b"meta"), {})
    (stamped,) = service.get_version("m").sources
    msg = convert.source_to_proto(stamped, omit_metadata=True)
    assert msg.agent_metadata_omitted and not msg.agent_metadata
    with pytest.raises(UnknownDigest, match="agent metadata of source 'src'"):
        convert.source_from_proto(msg, "sources[0]", NOTHING_KNOWN)


def test_a_registration_may_not_leave_its_metadata_out(server: CatalogServer, model: str) -> None:
    msg = convert.source_to_proto(source(2, b"meta"))
    msg.agent_metadata_omitted = True
    with grpc.insecure_channel(server.address) as channel:
        stub = catalog_pb2_grpc.CatalogServiceStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterSource(pb.RegisterSourceRequest(model=model, version=1, expected_sources=1, source=msg))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "agent_metadata_omitted" in (err.value.details() or "")
