"""Real NIXL/UCX transfers between this (reader) process and spawned source processes.

No mocks: every read goes through a NIXL agent in another process. Process budget: one
module-scoped source serves most tests; the restart test spawns two more.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mx_refit.errors import InvalidArgument, NotFound, TransferError  # noqa: E402
from mx_refit.transport import coalesce, plan_row_slice  # noqa: E402


pytestmark = pytest.mark.timeout(120)

ARENA_BYTES = 8 << 20
MAIN_SEED = 11


def _u8(t: Any) -> Any:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def expected(patterns: Any) -> dict[str, Any]:
    return patterns.make_patterns(MAIN_SEED)


@pytest.fixture(scope="module")
def arena(reader: Any) -> Any:
    """The reader's receive arena: registered once, reused by every test."""
    buf = torch.zeros(ARENA_BYTES, dtype=torch.uint8)
    assert reader.register(buf) is True
    return buf


@pytest.fixture
def main(reader: Any, source: Any, arena: Any) -> Any:
    arena.zero_()
    reader.connect("main", source.agent, source.metadata)
    return source


def test_full_read_is_byte_exact(reader: Any, main: Any, arena: Any, expected: dict[str, Any]) -> None:
    blob = expected["blob"]
    n = blob.numel()
    before = (reader.transfers, reader.bytes_read)
    stats = reader.read("main", [(main.addr("blob"), arena.data_ptr(), n)])
    assert torch.equal(arena[:n], blob)
    assert not arena[n:].any()
    assert stats.nbytes == n and stats.descriptors == 1 and stats.attempts == 1
    assert stats.peer_key == "main" and stats.agent_name == main.agent
    assert (reader.transfers, reader.bytes_read) == (before[0] + 1, before[1] + n)
    print(f"\nfull 4 MiB READ: {stats.gbps:.2f} GB/s")


def test_offset_slice_lands_in_view_of_bigger_arena(reader: Any, main: Any, arena: Any,
                                                    expected: dict[str, Any]) -> None:
    off, n, local_off = 1234567, (1 << 20) + 3, 777
    view = arena[local_off : local_off + n]
    reader.read("main", [(main.addr("blob") + off, view.data_ptr(), n)])
    assert torch.equal(view, expected["blob"][off : off + n])
    assert not arena[:local_off].any() and not arena[local_off + n :].any()


def test_gather_is_one_transfer_with_coalesced_descriptors(reader: Any, main: Any, arena: Any,
                                                           expected: dict[str, Any]) -> None:
    base = arena.data_ptr()
    blob, matrix, small = main.addr("blob"), main.addr("matrix"), main.addr("small")
    ops = [
        (blob + 0, base + 0, 4096),
        (blob + 4096, base + 4096, 4096),  # adjacent on both sides of the previous one
        (blob + 100_000, base + 50_000, 65536),
        (blob + (4 << 20) - 12345, base + 200_000, 12345),  # the very end of the blob
        (matrix + 1536 * 7, base + 300_000, 1536 * 3),  # three whole matrix rows
        (small, base + 400_000, 4000),
        (small + 4000, base + 404_000, 4000),  # adjacent
        (blob + 8192, base + 8192, 1000),  # adjacent again, listed out of order
    ]
    merged = coalesce(ops)
    assert len(merged) == 5 < len(ops)
    before = (reader.transfers, reader.descriptors_posted)
    stats = reader.read("main", ops)
    assert reader.transfers - before[0] == 1
    assert reader.descriptors_posted - before[1] == len(merged) == stats.descriptors
    assert stats.requested_ops == len(ops)
    blob_t, mat_u8, small_u8 = expected["blob"], _u8(expected["matrix"]), _u8(expected["small"])
    assert torch.equal(arena[0:9192], blob_t[0:9192])
    assert torch.equal(arena[50_000:115_536], blob_t[100_000:165_536])
    assert torch.equal(arena[200_000:212_345], blob_t[-12345:])
    assert torch.equal(arena[300_000:304_608], mat_u8[1536 * 7 : 1536 * 10])
    assert torch.equal(arena[400_000:408_000], small_u8)


def test_coalescing_collapses_split_reads(reader: Any, main: Any, arena: Any,
                                          expected: dict[str, Any]) -> None:
    chunk, count = 4096, 256
    ops = [(main.addr("blob") + i * chunk, arena.data_ptr() + i * chunk, chunk) for i in range(count)]
    random.Random(3).shuffle(ops)
    before = reader.descriptors_posted
    stats = reader.read("main", ops)
    assert stats.descriptors == 1 and reader.descriptors_posted - before == 1
    assert torch.equal(arena[: chunk * count], expected["blob"][: chunk * count])


def test_registration_is_cached_across_cycles(reader: Any, main: Any, arena: Any,
                                              expected: dict[str, Any]) -> None:
    # The source registered three tensors with one NIXL call.
    assert main.info["registrations"] == 1
    start = reader.registrations
    # Everything inside the arena is a cache hit (views, slices, the arena itself).
    assert reader.register(arena) is False
    assert reader.register(arena[123:4567]) is False
    assert reader.register(arena.view(torch.int32)[10:20]) is False
    assert reader.register_many([arena[:10], arena[-10:], arena]) == 0
    assert reader.registrations == start
    # Several new tensors: ONE NIXL call.
    fresh = [torch.zeros(4096, dtype=torch.uint8) for _ in range(3)]
    assert reader.register_many(fresh + [fresh[0][100:200]]) == 3
    assert reader.registrations == start + 1
    # Cycle 2 of a "refit" (register everything, read) adds zero registrations.
    for _ in range(2):
        assert reader.register_many([arena, *fresh]) == 0
        reader.read("main", [(main.addr("small"), fresh[1].data_ptr(), 4096)])
    assert reader.registrations == start + 1
    assert torch.equal(fresh[1], _u8(expected["small"])[:4096])


def test_metadata_refresh_after_new_source_registration(reader: Any, main: Any, arena: Any,
                                                        patterns: Any) -> None:
    loads = reader.remote_loads
    reader.connect("main", main.agent, main.metadata)  # same bytes: no reload
    assert reader.remote_loads == loads
    info = main.add_tensor()  # the source registers more memory -> new metadata
    assert info["registrations"] == 2
    reader.connect("main", main.agent, info["metadata"])
    assert reader.remote_loads == loads + 1
    extra = patterns.make_extra(MAIN_SEED)
    reader.read("main", [(main.addr("extra"), arena.data_ptr(), extra.numel())])
    assert torch.equal(arena[: extra.numel()], extra)


def test_unregistered_local_memory_is_rejected(reader: Any, main: Any, arena: Any) -> None:
    loose = torch.zeros(1024, dtype=torch.uint8)
    before = reader.transfers
    with pytest.raises(InvalidArgument, match="not inside memory registered") as info:
        reader.read("main", [(main.addr("blob"), loose.data_ptr(), 1024)])
    assert "main" in str(info.value)
    # Starts inside the arena but runs past its end.
    with pytest.raises(InvalidArgument, match="not inside memory registered"):
        reader.read("main", [(main.addr("blob"), arena.data_ptr() + ARENA_BYTES - 10, 20)])
    with pytest.raises(InvalidArgument, match="conflicting writes"):
        blob = main.addr("blob")
        reader.read("main", [(blob, arena.data_ptr(), 20), (blob + 100, arena.data_ptr(), 20)])
    assert reader.transfers == before  # nothing was posted


def test_unknown_peer_and_unregistered_remote_range(reader: Any, main: Any, arena: Any) -> None:
    with pytest.raises(NotFound, match="ghost"):
        reader.read("ghost", [(0, arena.data_ptr(), 8)])
    # A remote range outside the source's registered memory fails at once (no pointless retries).
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="main") as info:
        reader.read("main", [(main.addr("blob") + (64 << 20), arena.data_ptr(), 4096)])
    assert info.value.source_id == "main" and main.agent in str(info.value)
    assert "1 attempt" in str(info.value) and time.monotonic() - t0 < 5


def test_read_many_shares_one_agent_between_peer_keys(reader: Any, main: Any, arena: Any,
                                                     expected: dict[str, Any]) -> None:
    loads = reader.remote_loads
    reader.connect("main-alias", main.agent, main.metadata)  # same agent: nothing to load
    assert reader.remote_loads == loads
    blob, base, n = main.addr("blob"), arena.data_ptr(), 1 << 20
    with pytest.raises(InvalidArgument, match="same local bytes"):
        reader.read_many({"main": [(blob, base, n)], "main-alias": [(blob + n, base + n - 1, n)]})
    before = reader.transfers
    stats = reader.read_many({"main": [(blob, base, n)], "main-alias": [(blob + n, base + n, n)]})
    assert reader.transfers - before == 2 and {s.nbytes for s in stats.values()} == {n}
    assert torch.equal(arena[: 2 * n], expected["blob"][: 2 * n])
    reader.disconnect("main-alias")  # "main" still uses the agent: it stays loaded
    reader.read("main", [(blob, base, 16)])
    with pytest.raises(NotFound):
        reader.read("main-alias", [(blob, base, 16)])


@pytest.mark.parametrize("force", ["rows", "hull", None])
def test_row_slice_window_is_byte_exact(reader: Any, main: Any, arena: Any, expected: dict[str, Any],
                                        force: str | None) -> None:
    matrix = expected["matrix"]
    rows, cols = matrix.shape
    c0, c1 = 100, 164  # a dim-1 window, as for a row-parallel shard
    item = matrix.element_size()
    plan = plan_row_slice(main.addr("matrix"), rows, cols * item, c0 * item, c1 * item, force=force)
    if force is None:
        assert plan.mode == "hull"  # 512 descriptors cost more than the 767 KiB hull
    out = torch.empty(rows, c1 - c0, dtype=matrix.dtype)
    if plan.mode == "rows":
        landing = arena[: plan.landing_bytes]  # rows land directly in their final place
    else:
        landing = arena[4096 : 4096 + plan.landing_bytes]
    stats = reader.read("main", plan.local_ops(landing.data_ptr()))
    assert stats.descriptors == (rows if plan.mode == "rows" else 1)
    if plan.mode == "rows":
        out = landing.view(matrix.dtype).view(rows, c1 - c0)
    else:
        plan.extract(landing, out)
    assert torch.equal(out, matrix[:, c0:c1])


def test_source_death_then_restart_with_same_peer_key(reader: Any, main: Any, arena: Any, patterns: Any,
                                                      expected: dict[str, Any], spawn_source: Any) -> None:
    n = 1 << 20
    first = spawn_source("src-restart", seed=21)
    # The "restarted" process boots concurrently (same agent name, new addresses and metadata);
    # the reader only learns about it through connect() below.
    second = spawn_source("src-restart", seed=22)
    try:
        reader.connect("rank0", first.agent, first.metadata)
        reader.read("rank0", [(first.addr("blob"), arena.data_ptr(), n)])
        assert torch.equal(arena[:n], patterns.make_patterns(21)["blob"][:n])

        first.kill()
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            reader.read("rank0", [(first.addr("blob"), arena.data_ptr(), n)], timeout_s=3.0)
        elapsed = time.monotonic() - t0
        assert info.value.source_id == "rank0"
        assert "rank0" in str(info.value) and "src-restart" in str(info.value)
        assert elapsed < 3 * 3.0 + 5, elapsed  # bounded by retries x timeout (+ backoff)
        print(f"\ndead source detected in {elapsed:.2f} s: {info.value}")

        loads = reader.remote_loads
        reader.connect("rank0", second.agent, second.metadata)
        assert reader.remote_loads == loads + 1
        arena.zero_()
        before = reader.transfers
        results = reader.read_many(
            {
                "rank0": [(second.addr("blob"), arena.data_ptr(), n)],
                "main": [(main.addr("blob"), arena.data_ptr() + n, n)],
            }
        )
        assert reader.transfers - before == 2
        assert set(results) == {"rank0", "main"}
        assert torch.equal(arena[:n], patterns.make_patterns(22)["blob"][:n])
        assert torch.equal(arena[n : 2 * n], expected["blob"][:n])
    finally:
        first.stop()
        second.stop()


def test_deregister_and_close() -> None:
    from mx_refit.transport.nixl import NixlTransport

    with NixlTransport("closer") as t:
        buf = torch.zeros(4096, dtype=torch.uint8)
        assert t.register(buf) and t.is_registered(buf.data_ptr(), 4096)
        assert len(t.metadata()) > 0
        t.deregister_all()
        assert not t.is_registered(buf.data_ptr(), 4096)
        assert t.register(buf) and t.registrations == 2
        # Deregister one region out of a batch; the others stay registered.
        a, b, c = (torch.zeros(1024, dtype=torch.uint8) for _ in range(3))
        assert t.register_many([a, b, c]) == 3 and t.registrations == 3
        assert t.deregister(b[10:20]) == 1
        assert not t.is_registered(b.data_ptr(), 1024)
        assert t.is_registered(a.data_ptr(), 1024) and t.is_registered(c.data_ptr(), 1024)
        assert t.deregister(b) == 0
        assert t.register(b) and t.registrations == 4
    with pytest.raises(TransferError, match="closed"):
        t.metadata()
    t.close()  # idempotent


def test_a_repeated_read_of_the_same_ranges_reuses_its_checked_descriptors(
    reader: Any, main: Any, expected: dict[str, Any]
) -> None:
    """Receivers hand the same ranges list every steady cycle: its checks and NIXL descriptor
    lists are built once, and rebuilt for another list or when the local registrations change
    (a deregistered destination is refused again, never written)."""
    blob = expected["blob"]
    dest = torch.zeros(1 << 20, dtype=torch.uint8)
    assert reader.register(dest) is True
    ops = [(main.addr("blob") + i * 8192, dest.data_ptr() + i * 4096, 4096) for i in range(200)]  # scattered
    want = torch.cat([blob[i * 8192 : i * 8192 + 4096] for i in range(200)])

    def read(ranges: list[tuple[int, int, int]]) -> int:
        dest.zero_()
        built = reader.descs_built
        stats = reader.read_many({"main": ranges}, merge=False)["main"]
        assert stats.nbytes == len(ranges) * 4096 and stats.descriptors == len(ranges)
        assert torch.equal(dest[: 200 * 4096], want)
        return reader.descs_built - built

    assert read(ops) == 1
    assert read(ops) == 0  # the same list: nothing checked or built again
    assert read(list(ops)) == 1  # an equal but new list is checked afresh
    assert reader.deregister(dest) == 1
    with pytest.raises(InvalidArgument, match="not inside memory registered"):
        reader.read_many({"main": ops}, merge=False)
    assert reader.register(dest) is True
    assert read(ops) == 1  # registrations changed: checked and built again
    assert reader.deregister(dest) == 1
