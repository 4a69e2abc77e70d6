"""Layout and sidecar digests: an unchanged republished layout stays off the wire.

Through a real gRPC server on 127.0.0.1 and the typed client, plus the in-process service.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import grpc
import pytest
from catalog_factories import FakeClock, desc

import mx_refit.catalog.digests as digests
from mx_refit.catalog import CatalogClient, CatalogServer, CatalogService, convert
from mx_refit.catalog.digests import ManifestCache, ManifestStats, UnknownDigest
from mx_refit.catalog.v1 import catalog_pb2 as pb
from mx_refit.catalog.v1 import catalog_pb2_grpc
from mx_refit.catalog.validation import json_text
from mx_refit.errors import InvalidArgument
from mx_refit.receive.plans import layout_key as _layout_key
from mx_refit.types import (
    CudaIpcExport,
    IpcRegion,
    MemType,
    MeshPosition,
    Role,
    SourceInfo,
    TargetLayout,
    TensorDescriptor,
    VersionInfo,
)

TENSORS = 64  # per source
SIDECAR = {"megatron.hf_map": {f"layers.{i}.w": [f"model.layers.{i}.weight"] for i in range(64)}}


def rank(
    tp: int,
    *,
    base: int = 0x7F00_0000_0000,
    metadata: bytes = b"nixl-metadata",
    bump: int | None = None,
) -> SourceInfo:
    """TP rank ``tp`` of 2: ``TENSORS`` column shards in one region; fresh objects every call.

    ``bump`` moves that one tensor's address (a changed layout); ``base`` moves them all (a
    restarted process)."""
    start = base + tp * (1 << 32)
    tensors = tuple(
        desc(
            f"layers.{i}.w",
            dtype="bfloat16",
            global_shape=(64, 32),
            local_shape=(32, 32),
            shard_axis=0,
            shard_offset=32 * tp,
            role=Role.COLUMN,
            addr=start + i * 4096 + (2048 if i == bump else 0),
            extras={"layer": i},
        )
        for i in range(TENSORS)
    )
    return SourceInfo(
        source_id=f"tp{tp}",
        mesh=MeshPosition(tp_rank=tp, tp_size=2),
        agent_name=f"agent-tp{tp}",
        agent_metadata=metadata,
        tensors=tensors,
        ready=True,
        regions=((start, TENSORS * 4096 + 4096),),
    )


def publish(
    catalog: Any,
    model: str,
    version: int,
    sources: tuple[SourceInfo, ...] | None = None,
    sidecar: dict[str, Any] | None = None,
) -> None:
    for src in sources or (rank(0), rank(1)):
        catalog.register_source(model, version, 2, src, SIDECAR if sidecar is None else sidecar)


def delta(client: CatalogClient, before: ManifestStats) -> dict[str, int]:
    after = client.manifest_stats
    return {k: getattr(after, k) - getattr(before, k) for k in ManifestStats.__dataclass_fields__}


def assert_same_info(got: VersionInfo, want: VersionInfo) -> None:
    """Equal, digests included (they take no part in ``==``)."""
    assert got == want
    assert got.sidecar_digest == want.sidecar_digest != ""
    assert [s.layout_digest for s in got.sources] == [s.layout_digest for s in want.sources]
    assert all(s.layout_digest for s in got.sources)


@pytest.fixture(scope="module")
def server() -> Iterator[CatalogServer]:
    with CatalogServer(service=CatalogService(clock=FakeClock())) as srv:
        yield srv


@pytest.fixture
def client(server: CatalogServer) -> Iterator[CatalogClient]:
    """A fresh client (an empty cache) per test."""
    with CatalogClient(server.address) as cl:
        yield cl


@pytest.fixture
def model(request: pytest.FixtureRequest) -> str:
    return re.sub(r"\W", "_", request.node.name)


def cold(server: CatalogServer, model: str, version: int | None = None) -> VersionInfo:
    with CatalogClient(server.address) as fresh:
        info = fresh.get_version(model, version)
        assert fresh.manifest_stats.sources_omitted == 0
        return info


# --- the catalog side --------------------------------------------------------------------------


def test_registration_stamps_stable_layout_and_sidecar_digests(make_service) -> None:
    infos = []
    for _ in range(2):  # two catalogs (think: before and after a restart) agree
        service = make_service()
        publish(service, "m", 1)
        infos.append(service.get_version("m"))
    one, two = infos
    assert_same_info(one, two)
    src = one.sources[0]
    assert src.layout_digest == digests.layout_digest(src.tensors, src.regions)
    assert one.sidecar_digest == digests.sidecar_digest(json_text(SIDECAR))
    assert one.sources[0].layout_digest != one.sources[1].layout_digest
    # Whatever digest a publisher sends is ignored.
    service = make_service()
    publish(service, "m", 1, (replace(rank(0), layout_digest="forged"), rank(1)))
    assert service.get_version("m").sources[0].layout_digest == src.layout_digest


def test_an_unchanged_republish_reuses_the_tuple_and_digest_without_rehashing(make_service,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hashed: list[int] = []
    real = digests.layout_digest
    monkeypatch.setattr(
        digests, "layout_digest", lambda t, r, *ipc: hashed.append(len(t)) or real(t, r, *ipc)
    )
    service = make_service()
    publish(service, "m", 1)
    assert hashed == [TENSORS, TENSORS]
    publish(service, "m", 2)  # equal descriptors, new objects
    assert hashed == [TENSORS, TENSORS]
    v1, v2 = service.get_version("m", 1), service.get_version("m", 2)
    for old, new in zip(v1.sources, v2.sources, strict=True):
        assert new.tensors is old.tensors
        assert new.layout_digest == old.layout_digest
    assert v2.sidecar_digest == v1.sidecar_digest


@pytest.mark.parametrize(
    "changed",
    [
        pytest.param(lambda: rank(0, bump=17), id="one-addr"),
        pytest.param(lambda: rank(0, base=0x7E00_0000_0000), id="restarted"),
        pytest.param(lambda: replace(rank(0), regions=((0x7F00_0000_0000, 1 << 30),)), id="regions"),
        pytest.param(  # == takes 17 and 17.0 as equal; the layout does not
            lambda: replace(
                rank(0),
                tensors=tuple(
                    replace(d, extras={"layer": float(d.extras["layer"])}) for d in rank(0).tensors
                ),
            ),
            id="extras-type",
        ),
    ],
)
def test_a_changed_layout_gets_a_new_digest(make_service, changed: Any) -> None:
    service = make_service()
    publish(service, "m", 1)
    publish(service, "m", 2, (changed(), rank(1)))
    v1, v2 = service.get_version("m", 1), service.get_version("m", 2)
    assert v2.sources[0].layout_digest != v1.sources[0].layout_digest
    assert v2.sources[0].tensors is not v1.sources[0].tensors
    assert v2.sources[1].tensors is v1.sources[1].tensors  # the other rank is unchanged


def test_the_in_process_service_path_is_unchanged(make_service) -> None:
    service = make_service()
    publish(service, "m", 1)
    info = service.get_version("m")
    assert info.sources == (rank(0), rank(1))  # digests take no part in equality
    assert info.sidecar == SIDECAR
    info.sidecar["megatron.hf_map"].clear()  # the sidecar is still a fresh copy per call
    again = service.get_version("m")
    assert again.sidecar == SIDECAR
    assert_same_info(again, service.inspect_version("m", 1))
    assert again.sources[0].tensors is info.sources[0].tensors  # shared, as before


# --- over the wire -----------------------------------------------------------------------------


def test_second_get_version_of_an_unchanged_republish_sends_no_descriptors(
    server: CatalogServer, client: CatalogClient, model: str
) -> None:
    publish(client, model, 1)
    first = client.get_version(model)
    assert client.manifest_stats == ManifestStats(
        replies=1, sources_sent=2, descriptors_sent=2 * TENSORS, sidecars_sent=1, metadata_sent=2
    )
    publish(client, model, 2)
    before = client.manifest_stats
    second = client.get_version(model)
    assert delta(client, before) == {
        "replies": 1,
        "sources_sent": 0,
        "sources_omitted": 2,
        "descriptors_sent": 0,
        "sidecars_sent": 0,
        "sidecars_omitted": 1,
        "metadata_sent": 0,
        "metadata_omitted": 2,
        "refetches": 0,
    }
    assert second.version == 2
    assert_same_info(second, cold(server, model))
    for old, new in zip(first.sources, second.sources, strict=True):
        assert new.tensors is old.tensors  # the cached tuples, not a decoded copy
    assert second.sidecar is first.sidecar


def test_the_reply_of_a_warm_reader_is_small(
    server: CatalogServer, client: CatalogClient, model: str
) -> None:
    publish(client, model, 1)
    info = client.get_version(model)
    publish(client, model, 2)
    with grpc.insecure_channel(server.address) as channel:
        stub = catalog_pb2_grpc.CatalogServiceStub(channel)  # type: ignore[no-untyped-call]
        full = stub.GetVersion(pb.GetVersionRequest(model=model))
        warm = stub.GetVersion(
            pb.GetVersionRequest(
                model=model,
                known_layout_digests={s.source_id: s.layout_digest for s in info.sources},
                known_sidecar_digest=info.sidecar_digest,
            )
        )
    assert full.ByteSize() > 10_000
    assert warm.ByteSize() < 600, warm
    assert all(s.tensors_omitted and not s.tensors and not s.regions for s in warm.version_info.sources)
    assert warm.version_info.sidecar_omitted and not warm.version_info.sidecar_json
    assert not any(s.tensors_omitted for s in full.version_info.sources)


@pytest.mark.parametrize(
    "changed",
    [
        pytest.param(lambda: rank(1, bump=5), id="one-addr"),
        pytest.param(lambda: rank(1, base=0x7E00_0000_0000, metadata=b"new-agent"), id="restarted"),
    ],
)
def test_a_changed_source_is_sent_in_full(
    server: CatalogServer, client: CatalogClient, model: str, changed: Any
) -> None:
    publish(client, model, 1)
    first = client.get_version(model)
    publish(client, model, 2, (rank(0), changed()))
    before = client.manifest_stats
    second = client.get_version(model)
    got = delta(client, before)
    assert (got["sources_sent"], got["sources_omitted"], got["descriptors_sent"]) == (1, 1, TENSORS)
    assert_same_info(second, cold(server, model))
    assert second.sources[1] == changed()
    assert second.sources[0].tensors is first.sources[0].tensors


def test_a_restarted_source_with_the_same_layout_brings_its_new_agent_metadata(
    server: CatalogServer, client: CatalogClient, model: str
) -> None:
    publish(client, model, 1)
    client.get_version(model)
    publish(client, model, 2, (rank(0), rank(1, metadata=b"restarted-agent")))
    before = client.manifest_stats
    second = client.get_version(model)
    assert delta(client, before)["sources_omitted"] == 2  # the layout is the same...
    assert second.sources[1].agent_metadata == b"restarted-agent"  # ...the agent is not
    assert_same_info(second, cold(server, model))


def test_a_changed_sidecar_is_sent_and_an_unchanged_one_is_not(
    server: CatalogServer, client: CatalogClient, model: str
) -> None:
    publish(client, model, 1)
    client.get_version(model)
    publish(client, model, 2, sidecar={**SIDECAR, "step": 2})
    before = client.manifest_stats
    second = client.get_version(model)
    got = delta(client, before)
    assert (got["sidecars_sent"], got["sidecars_omitted"], got["sources_omitted"]) == (1, 0, 2)
    assert second.sidecar == {**SIDECAR, "step": 2}
    assert_same_info(second, cold(server, model))
    publish(client, model, 3, sidecar={**SIDECAR, "step": 2})
    before = client.manifest_stats
    assert_same_info(client.get_version(model), cold(server, model))
    assert delta(client, before)["sidecars_omitted"] == 1


def test_a_reply_leaving_out_what_the_cache_lost_is_asked_again_in_full(
    server: CatalogServer, client: CatalogClient, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish(client, model, 1)
    client.get_version(model)
    publish(client, model, 2)
    # A race: the digests are announced, but what they stand for is gone by the time the
    # reply is completed.
    real_known = client._manifests.known
    monkeypatch.setattr(
        client._manifests,
        "known",
        lambda m: replace(real_known(m), layouts={}, sidecars={}),
    )
    before = client.manifest_stats
    info = client.get_version(model)
    got = delta(client, before)
    assert (got["replies"], got["refetches"], got["descriptors_sent"]) == (2, 1, 2 * TENSORS)
    assert_same_info(info, cold(server, model))


def test_evicted_layouts_are_fetched_again(server: CatalogServer, model: str) -> None:
    publish(server.service, model, 1)
    publish(server.service, model, 2, (rank(0, bump=1), rank(1, bump=1)))
    with CatalogClient(server.address, manifest_cache_versions=1) as short:
        short.get_version(model, 1)
        short.get_version(model, 2)  # evicts version 1's layouts
        before = short.manifest_stats
        assert_same_info(short.get_version(model, 1), cold(server, model, 1))
        assert delta(short, before)["descriptors_sent"] == 2 * TENSORS
    with CatalogClient(server.address) as keeps_two:
        v1 = keeps_two.get_version(model, 1)
        keeps_two.get_version(model, 2)
        again = keeps_two.get_version(model, 1)  # sent (announced: version 2's), not decoded
        assert_same_info(again, v1)
        assert again.sources[0].tensors is v1.sources[0].tensors


def test_a_disabled_cache_always_fetches_everything(server: CatalogServer, model: str) -> None:
    publish(server.service, model, 1)
    publish(server.service, model, 2)
    with CatalogClient(server.address, manifest_cache_versions=0) as uncached:
        revived = pickle.loads(pickle.dumps(uncached))
        assert revived.manifest_cache_versions == 0
        for cl in (uncached, revived):
            cl.get_version(model, 1)
            assert_same_info(cl.get_version(model, 2), cold(server, model, 2))
            assert cl.manifest_stats.sources_omitted == 0
            assert cl.manifest_stats.descriptors_sent == 4 * TENSORS
    with pytest.raises(InvalidArgument, match="manifest_cache_versions"):
        CatalogClient(server.address, manifest_cache_versions=-1)


def test_an_omission_nobody_asked_for_is_an_error_not_partial_data(make_service) -> None:
    service = make_service()
    publish(service, "m", 1)
    manifest = service.get_manifest("m")
    digest = manifest.sources[0].layout_digest
    msg = convert.manifest_to_proto(manifest, {"tp0": digest}, "")
    assert msg.sources[0].tensors_omitted and not msg.sources[1].tensors_omitted
    with pytest.raises(UnknownDigest, match=r"sources\[0\]: the catalog left out the tensors"):
        convert.version_info_from_proto(msg)
    msg = convert.manifest_to_proto(manifest, {}, manifest.sidecar_digest)
    with pytest.raises(UnknownDigest, match="sidecar: the catalog left out sidecar"):
        convert.version_info_from_proto(msg)
    # A registration can never leave its tensors out.
    wire = convert.source_to_proto(rank(0), omit_tensors=True)
    with pytest.raises(InvalidArgument, match="source.tensors_omitted: only GetVersion"):
        convert.source_from_proto(wire)


def test_the_manifest_cache_is_bounded_by_models(make_service) -> None:
    cache = ManifestCache(versions=2, models=2)
    service = make_service()
    for name in ("a", "b", "c"):
        publish(service, name, 1)
        cache.remember(name, service.get_version(name))
    assert cache.known("a") is digests.NOTHING_KNOWN
    known = cache.known("c")
    assert set(known.layout_digests) == {"tp0", "tp1"}
    assert set(known.layouts) == set(known.layout_digests.values())


# --- the receiver's plan cache key -------------------------------------------------------------


class _Unwalkable(tuple[TensorDescriptor, ...]):
    def __iter__(self) -> Iterator[TensorDescriptor]:
        raise AssertionError("the layout key walked the descriptors")


def test_the_layout_key_uses_digests_and_walks_only_without_them(make_service) -> None:
    service = make_service()
    publish(service, "m", 1)
    publish(service, "m", 2)
    publish(service, "m", 3, (rank(0), rank(1, bump=3)))
    target = TargetLayout()
    v1, v2, v3 = (service.get_version("m", v) for v in (1, 2, 3))
    assert _layout_key(v1, target) == _layout_key(v2, target) != _layout_key(v3, target)
    unwalkable = replace(
        v2, sources=tuple(replace(s, tensors=_Unwalkable(s.tensors)) for s in v2.sources)
    )
    assert _layout_key(unwalkable, target) == _layout_key(v1, target)
    # Without digests (a hand-built VersionInfo) the key still follows the descriptors.
    bare = [
        replace(v, sidecar_digest="", sources=tuple(replace(s, layout_digest="") for s in v.sources))
        for v in (v1, v2, v3)
    ]
    assert _layout_key(bare[0], target) == _layout_key(bare[1], target)
    assert _layout_key(bare[1], target) != _layout_key(bare[2], target)


# --- CUDA IPC exports: one handle per region, digested with the layout -------------------------


def scattered(count: int, handle: bytes = b"h" * 64) -> SourceInfo:
    """``count`` VRAM tensors, each its own region (separately allocated parameters), exported
    over CUDA IPC with one handle per region: fresh objects every call."""
    base = 0x7F00_0000_0000
    tensors = tuple(
        desc(f"layers.{i}.w", dtype="bfloat16", global_shape=(64, 32), addr=base + i * 8192,
             mem_type=MemType.VRAM)
        for i in range(count)
    )
    regions = tuple((d.addr, d.nbytes) for d in tensors)
    export = CudaIpcExport("boot", "host", 4242, "pidns", b"u" * 16,
                           tuple(IpcRegion(a, n, handle[:-1] + bytes([i % 251]), 0)
                                 for i, (a, n) in enumerate(regions)))
    return SourceInfo(source_id="scattered", mesh=MeshPosition(), agent_name="a", agent_metadata=b"m",
                      tensors=tensors, ready=True, regions=regions, cuda_ipc=export)


@pytest.mark.parametrize("count", [10, 2_000])
def test_a_warm_reply_leaves_out_an_unchanged_cuda_ipc_export(
    server: CatalogServer, client: CatalogClient, model: str, count: int
) -> None:
    client.register_source(model, 1, 1, scattered(count), {})
    first = client.get_version(model)
    client.register_source(model, 2, 1, scattered(count), {})
    with grpc.insecure_channel(server.address) as channel:
        stub = catalog_pb2_grpc.CatalogServiceStub(channel)  # type: ignore[no-untyped-call]
        warm = stub.GetVersion(pb.GetVersionRequest(
            model=model, known_layout_digests={s.source_id: s.layout_digest for s in first.sources},
            known_sidecar_digest=first.sidecar_digest,
        ))
    (sent,) = warm.version_info.sources
    assert sent.tensors_omitted and not sent.HasField("cuda_ipc")
    assert warm.ByteSize() < 400, warm  # the same whatever the count: no per-region data
    second = client.get_version(model)
    (a,), (b,) = first.sources, second.sources
    assert b.cuda_ipc is a.cuda_ipc and b.cuda_ipc == scattered(count).cuda_ipc  # the held object
    assert b.tensors is a.tensors


def test_a_changed_cuda_ipc_handle_is_a_changed_layout_sent_in_full(
    client: CatalogClient, model: str
) -> None:
    client.register_source(model, 1, 1, scattered(50), {})
    first = client.get_version(model)
    moved = scattered(50, handle=b"k" * 64)  # the trainer reallocated: same addresses, new handles
    client.register_source(model, 2, 1, moved, {})
    before = client.manifest_stats
    second = client.get_version(model)
    assert delta(client, before)["sources_sent"] == 1
    assert second.sources[0].layout_digest != first.sources[0].layout_digest
    assert second.sources[0].cuda_ipc == moved.cuda_ipc != first.sources[0].cuda_ipc


def test_the_digest_without_an_export_is_the_digest_before_exports_were_digested() -> None:
    src = scattered(3)
    assert digests.layout_digest(src.tensors, src.regions) == digests.layout_digest(src.tensors, src.regions, None)
    assert digests.layout_digest(src.tensors, src.regions, src.cuda_ipc) != digests.layout_digest(src.tensors, src.regions)
