"""The transport seam without a GPU: per-source path choice, the IPC handle cache, range
translation, the catalog's CUDA IPC fields (real catalog service, real protobuf round trip), and
a package import that loads neither torch nor nixl."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mx_refit.errors import InvalidArgument
from mx_refit.transport.base import CUDA_IPC, NIXL, LocalNode, ReadReport, select_path
from mx_refit.transport.cuda_ipc import HandleCache, translate
from mx_refit.types import CudaIpcExport, IpcRegion, MemType, MeshPosition, SourceInfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "catalog"))
from catalog_factories import desc  # noqa: E402

GPU0, GPU1, GPU2 = b"\x00" * 15 + b"\x01", b"\x00" * 15 + b"\x02", b"\x00" * 15 + b"\x03"
NODE = LocalNode("boot-a", "host-a", 4242, "pid:[4026531836]")


def export(*regions: IpcRegion, boot: str = "boot-a", host: str = "host-a", uuid: bytes = GPU0,
           pid: int = 777) -> CudaIpcExport:
    regions = regions or (IpcRegion(0x1000, 4096, b"h" * 64, 0),)
    return CudaIpcExport(boot, host, pid, NODE.pid_namespace, uuid, regions)


# ------------------------------------------------------------------ selection
@pytest.mark.parametrize(
    ("mode", "exp", "local", "peers", "path", "reason"),
    [
        ("auto", export(), GPU0, (), CUDA_IPC, "same GPU"),
        ("auto", export(uuid=GPU1), GPU0, (GPU1,), CUDA_IPC, "peer GPU"),
        ("auto", export(uuid=GPU2), GPU0, (GPU1,), NIXL, "not reachable by peer access"),
        ("auto", export(boot="boot-b"), GPU0, (), NIXL, "another node"),
        ("auto", export(host="host-b"), GPU0, (), NIXL, "another node"),
        ("auto", None, GPU0, (), NIXL, "exports no CUDA IPC"),
        ("auto", export(), None, (), NIXL, "not in CUDA memory"),
        ("nixl", export(), GPU0, (), NIXL, "'nixl'"),
        ("cuda_ipc", export(uuid=GPU1), GPU0, (GPU1,), CUDA_IPC, "peer GPU"),
    ],
)
def test_select_path(mode, exp, local, peers, path, reason) -> None:
    choice = select_path(mode, exp, NODE, local, peers)
    assert choice.path == path
    assert reason in choice.reason


def test_forced_cuda_ipc_names_why_it_is_impossible() -> None:
    with pytest.raises(InvalidArgument, match="cuda_ipc.*another node"):
        select_path("cuda_ipc", export(boot="other"), NODE, GPU0)
    with pytest.raises(InvalidArgument, match="transport: 'grpc'"):
        select_path("grpc", export(), NODE, GPU0)


def test_a_node_without_a_boot_id_never_uses_ipc() -> None:
    blind = LocalNode("", "host-a", 1, "")
    assert select_path("auto", export(boot=""), blind, GPU0).path == NIXL


def test_read_report_names_one_path_or_mixed() -> None:
    assert ReadReport({"a": 1}, {"a": CUDA_IPC}, 1).path == CUDA_IPC
    assert ReadReport({"a": 1, "b": 2}, {"a": CUDA_IPC, "b": NIXL}, 2).path == "mixed"


# ------------------------------------------------------------------ handle cache
class Mapper:
    """Stands for the process's address space: hands out distinct mapping addresses per open
    and records closes (the bookkeeping under test is HandleCache's, not CUDA's)."""

    def __init__(self) -> None:
        self.next = 0x7F00_0000_0000
        self.live: dict[int, bytes] = {}

    def open(self, handle: bytes) -> int:
        assert handle not in self.live.values(), "a handle was opened twice"
        self.next += 1 << 30
        self.live[self.next] = handle
        return self.next

    def close(self, ptr: int) -> None:
        del self.live[ptr]


def test_handles_open_once_and_are_reused() -> None:
    m = Mapper()
    cache = HandleCache(m.open, m.close)
    a = IpcRegion(0x1000, 100, b"A" * 64, 16)
    first = cache.bases("src0", [a])
    assert cache.bases("src0", [a]) == first
    assert cache.opened == 1 and len(m.live) == 1
    assert first[0x1000] == next(iter(m.live)) + 16  # mapping base + the region's offset


def test_regions_of_one_allocation_share_one_mapping() -> None:
    m = Mapper()
    cache = HandleCache(m.open, m.close)
    a, b = IpcRegion(0x1000, 100, b"A" * 64, 0), IpcRegion(0x2000, 100, b"A" * 64, 0x1000)
    bases = cache.bases("src0", [a, b])
    assert cache.opened == 1 and bases[0x2000] - bases[0x1000] == 0x1000
    cache.bases("src0", [b])  # region a dropped: the allocation stays mapped for b
    assert len(m.live) == 1 and cache.closed == 0
    cache.forget("src0")
    assert not m.live and cache.closed == 1


def test_changed_handle_is_reopened_and_the_old_one_closed() -> None:
    m = Mapper()
    cache = HandleCache(m.open, m.close)
    old = cache.bases("src0", [IpcRegion(0x1000, 100, b"A" * 64, 0)])
    # The trainer reallocated after a drain: the same address may come back in a new allocation.
    new = cache.bases("src0", [IpcRegion(0x1000, 100, b"B" * 64, 0)])
    assert cache.opened == 2 and cache.closed == 1
    assert list(m.live.values()) == [b"B" * 64] and new != old


def test_sources_are_independent_and_close_releases_all() -> None:
    m = Mapper()
    cache = HandleCache(m.open, m.close)
    cache.bases("src0", [IpcRegion(0x1000, 100, b"A" * 64, 0)])
    cache.bases("src1", [IpcRegion(0x1000, 100, b"C" * 64, 0)])
    assert cache.sources() == {"src0", "src1"} and len(cache) == 2
    cache.forget("src1")
    assert cache.sources() == {"src0"}
    cache.close()
    assert not m.live and cache.opened == 2 and cache.closed == 2


def test_a_failing_close_does_not_keep_the_entry() -> None:
    def refuse(ptr: int) -> None:
        raise RuntimeError("exporter is gone")

    cache = HandleCache(lambda h: 0x1000, refuse)
    cache.bases("s", [IpcRegion(0x1, 1, b"A" * 64, 0)])
    cache.close()
    assert len(cache) == 0 and cache.closed == 1


def test_translate_maps_remote_ranges_into_the_mapping() -> None:
    regions = [IpcRegion(0x1000, 0x100, b"A" * 64, 0), IpcRegion(0x5000, 0x100, b"A" * 64, 0x4000)]
    bases = {0x1000: 0x9000, 0x5000: 0xD000}
    got = translate([(0x1010, 0, 16), (0x5080, 64, 32)], regions, bases, arena_base=0x100000)
    assert got == [(0x9010, 0x100000, 16), (0xD080, 0x100040, 32)]
    with pytest.raises(InvalidArgument, match="no exported CUDA IPC region"):
        translate([(0x10F0, 0, 32)], regions, bases, arena_base=0)  # crosses the region's end


# ------------------------------------------------------------------ catalog fields
@pytest.fixture
def service():
    from mx_refit.catalog import CatalogService

    return CatalogService()


def vram_source(cuda_ipc: CudaIpcExport | None, *, mem: MemType = MemType.VRAM) -> SourceInfo:
    d = desc("w", addr=0x1000, global_shape=(4, 8), mem_type=mem)
    return SourceInfo("src0", MeshPosition(), "agent", b"", (d,), regions=((0x1000, 4096),), cuda_ipc=cuda_ipc)


def test_catalog_keeps_the_export_through_protobuf() -> None:
    from mx_refit.catalog.convert import source_from_proto, source_to_proto

    exp = export()
    assert source_from_proto(source_to_proto(vram_source(exp))).cuda_ipc == exp
    assert source_from_proto(source_to_proto(vram_source(None))).cuda_ipc is None


def test_new_handles_reach_a_reader_whose_layout_is_unchanged() -> None:
    """Over real gRPC: the second GetVersion leaves the (unchanged) tensors out, yet carries the
    export, so a trainer that reallocated at the same addresses is noticed."""
    from mx_refit.catalog.client import CatalogClient
    from mx_refit.catalog.server import start_embedded

    server = start_embedded()
    try:
        pub, reader = CatalogClient(server.address), CatalogClient(server.address)
        for version, handle in ((1, b"A" * 64), (2, b"B" * 64)):
            exp = export(IpcRegion(0x1000, 4096, handle, 0))
            pub.register_source(model="m", version=version, expected_sources=1, source=vram_source(exp),
                                sidecar={}, ttl_s=30.0)
            pub.mark_ready(model="m", version=version, source_id="src0")
            info = reader.get_version(model="m", version=version)
            assert info.sources[0].cuda_ipc == exp
            assert info.sources[0].tensors[0].name == "w"
        assert info.sources[0].layout_digest  # same layout both times: v2's tensors came from the cache
    finally:
        server.stop(0)


@pytest.mark.parametrize(
    ("exp", "match"),
    [
        (export(IpcRegion(0x1000, 4096, b"h" * 63, 0)), r"regions\[0\]\.handle: must be 64 bytes, got 63"),
        (export(uuid=b"x" * 15), r"device_uuid: must be 16 bytes, got 15"),
        (export(IpcRegion(0x2000, 4096, b"h" * 64, 0)), r"regions\[0\]: \(0x2000, 4096\) is not one of source.regions"),
        (export(IpcRegion(0x1000, 4096, b"h" * 64, -1)), r"regions\[0\]\.offset"),
        (export(boot=""), r"cuda_ipc\.boot_id"),
        (export(host="h" * 300), r"cuda_ipc\.host_name"),
        (export(pid=0), r"cuda_ipc\.pid"),
        (export(IpcRegion(0x1000, 4096, b"h" * 64, 0), IpcRegion(0x1000, 4096, b"g" * 64, 0)), "exported twice"),
    ],
)
def test_catalog_rejects_malformed_exports_and_stays_consistent(service, exp, match) -> None:
    from mx_refit.errors import NotFound

    with pytest.raises(InvalidArgument, match=match):
        service.register_source(model="m", version=1, expected_sources=1, source=vram_source(exp))
    with pytest.raises(NotFound):
        service.get_version(model="m", version=1)  # nothing half-registered


def test_catalog_rejects_an_export_of_host_memory(service) -> None:
    with pytest.raises(InvalidArgument, match="host memory"):
        service.register_source(model="m", version=1, expected_sources=1,
                                 source=vram_source(export(), mem=MemType.DRAM))


def test_local_node_identity_is_this_process() -> None:
    from mx_refit.transport.base import local_node

    node = local_node()
    assert node.pid == os.getpid() and node.host_name


def test_config_names_a_bad_transport() -> None:
    from mx_refit.config import WeightSyncConfig, validate

    assert validate(WeightSyncConfig()).transport == "auto"
    with pytest.raises(InvalidArgument, match=r"weight_sync.transport: 'grpc'"):
        validate(WeightSyncConfig(transport="grpc"))


def test_a_steady_program_serves_only_the_same_lists_exports_and_arena() -> None:
    from dataclasses import replace
    from types import SimpleNamespace

    from mx_refit.transport.cuda_ipc import _Program

    class Arena:
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

        def data_ptr(self) -> int:
            return self.ptr

    ranges = [(0x1000, 0, 4096)]
    source = SimpleNamespace(cuda_ipc=export())
    program = _Program({"s": ranges}, {"s": export()}, 0x9000, None, [[(1, 2, 4096)]], {"s": 4096})  # type: ignore[arg-type]
    assert program.serves({"s": source}, {"s": ranges}, Arena(0x9000))  # an equal export (decoded anew)
    assert not program.serves({"s": source}, {"s": list(ranges)}, Arena(0x9000))  # a new plan's list
    assert not program.serves({"s": source}, {"s": ranges}, Arena(0xA000))  # a new arena
    moved = SimpleNamespace(cuda_ipc=export(IpcRegion(0x1000, 4096, b"n" * 64, 0)))  # reallocated
    assert not program.serves({"s": moved}, {"s": ranges}, Arena(0x9000))
    restarted = SimpleNamespace(cuda_ipc=replace(export(), pid=778))
    assert not program.serves({"s": restarted}, {"s": ranges}, Arena(0x9000))
    assert not program.serves({"s": source, "t": source}, {"s": ranges, "t": ranges}, Arena(0x9000))

    # Forgetting a source the program does not read keeps it; forgetting one it reads drops it.
    from mx_refit.transport.cuda_ipc import CudaIpcTransport

    transport = CudaIpcTransport()
    transport._program = program
    transport.forget("replica-that-left")
    assert transport._program is program
    transport.forget("s")
    assert transport._program is None


def test_a_path_choice_is_remembered_until_the_export_changes(monkeypatch) -> None:
    from types import SimpleNamespace

    from mx_refit.transport.routing import RoutingTransport

    transport = RoutingTransport.__new__(RoutingTransport)  # no NIXL agent or GPU needed here
    transport.mode, transport._node, transport._choices = "auto", NODE, {}
    calls = []

    def identity(arena):
        calls.append(arena)
        return GPU0, ()

    monkeypatch.setattr(transport, "_device_identity", identity)
    arena = SimpleNamespace(device="cuda:0")
    first = SimpleNamespace(source_id="s", cuda_ipc=export())
    assert transport.choose(first, arena).path == CUDA_IPC
    again = SimpleNamespace(source_id="s", cuda_ipc=export())  # next cycle: an equal export
    assert transport.choose(again, arena).path == CUDA_IPC and len(calls) == 1
    elsewhere = SimpleNamespace(source_id="s", cuda_ipc=export(boot="boot-b"))  # the source moved
    assert transport.choose(elsewhere, arena).path == NIXL and len(calls) == 2
    assert transport.choose(elsewhere, SimpleNamespace(device="cuda:1")).path == NIXL and len(calls) == 3


def test_transport_package_import_is_lazy() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    import mx_refit

    src = str(Path(mx_refit.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    code = (
        "import sys, mx_refit.transport as t, mx_refit.transport.nixl;"
        "assert 'torch' not in sys.modules and 'nixl' not in sys.modules, sorted(sys.modules);"
        "assert t.NixlTransport.__name__ == 'NixlTransport';"
        "assert 'nixl' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30, env=env)
