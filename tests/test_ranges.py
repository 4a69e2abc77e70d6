"""Property-style tests of the pure range arithmetic against a byte-level reference.

Each random case builds a fake "remote memory" of random bytes, applies the original ranges and
the coalesced ranges to two local buffers, and requires identical bytes.
"""

from __future__ import annotations

import random

import pytest

from mx_refit.ranges import (
    RegionIndex,
    RowSlicePlan,
    check_local_disjoint,
    coalesce,
    plan_row_slice,
    total_bytes,
)

pytestmark = pytest.mark.timeout(60)

REMOTE_SIZE = 1 << 14
LOCAL_SIZE = 1 << 14


def _apply(ops, remote: bytes, local_size: int = LOCAL_SIZE, base_remote: int = 0, base_local: int = 0):
    """Byte-level reference: perform every READ one byte range at a time."""
    out = bytearray(local_size)
    for r, l, n in ops:
        r -= base_remote
        l -= base_local
        out[l : l + n] = remote[r : r + n]
    return out


def _random_ops(rng: random.Random) -> list[tuple[int, int, int]]:
    """Non-conflicting ranges: runs of adjacent chunks (mergeable), shuffled, with duplicates,
    same-displacement overlaps and unrelated ranges mixed in. Local targets never conflict."""
    ops: list[tuple[int, int, int]] = []
    used_local = bytearray(LOCAL_SIZE)  # 1 where a local byte is already targeted
    for _ in range(rng.randint(1, 12)):
        n_total = rng.randint(1, 1500)
        local = rng.randrange(0, LOCAL_SIZE - n_total)
        if any(used_local[local : local + n_total]):
            continue
        used_local[local : local + n_total] = b"\x01" * n_total
        remote = rng.randrange(0, REMOTE_SIZE - n_total)
        # split the run into adjacent pieces
        k = min(n_total - 1, rng.randint(0, 6))
        cuts = sorted(rng.sample(range(1, n_total), k=k)) if n_total > 1 else []
        bounds = [0, *cuts, n_total]
        for a, b in zip(bounds, bounds[1:]):
            ops.append((remote + a, local + a, b - a))
        if rng.random() < 0.3:  # exact duplicate
            ops.append(ops[-1])
        if rng.random() < 0.3 and n_total > 4:  # same-displacement overlap inside the run
            a = rng.randrange(0, n_total - 2)
            ops.append((remote + a, local + a, rng.randint(1, n_total - a)))
        if rng.random() < 0.2:
            ops.append((remote, local, 0))  # zero-length: dropped
    rng.shuffle(ops)
    return ops


@pytest.mark.parametrize("seed", range(300))
def test_coalesce_matches_byte_reference(seed: int) -> None:
    rng = random.Random(seed)
    remote = rng.randbytes(REMOTE_SIZE)
    ops = _random_ops(rng)
    merged = coalesce(ops)

    assert _apply(merged, remote) == _apply(ops, remote)
    assert len(merged) <= len([o for o in ops if o[2]])
    assert all(n > 0 for _, _, n in merged)
    assert [r for r, _, _ in merged] == sorted(r for r, _, _ in merged)
    # Maximal: no two results could still merge (same displacement and touching).
    for i, (r1, l1, n1) in enumerate(merged):
        for r2, l2, n2 in merged[i + 1 :]:
            if r1 - l1 == r2 - l2:
                assert r2 > r1 + n1 or r1 > r2 + n2
    # Coverage of local bytes is exactly the union of the requested ranges.
    want = {l + k for _, l, n in ops for k in range(n)}
    assert total_bytes(merged) == len(want)


def test_coalesce_rebuilds_split_run() -> None:
    ops = [(1000 + i * 64, 5000 + i * 64, 64) for i in range(256)]
    random.Random(1).shuffle(ops)
    assert coalesce(ops) == [(1000, 5000, 256 * 64)]


def test_coalesce_needs_adjacency_on_both_sides() -> None:
    # Adjacent remotely but not locally (and vice versa): must stay separate.
    assert coalesce([(0, 0, 10), (10, 20, 10)]) == [(0, 0, 10), (10, 20, 10)]
    assert coalesce([(0, 0, 10), (20, 10, 10)]) == [(0, 0, 10), (20, 10, 10)]
    # Interleaved in remote order but same displacement: merge across the other range.
    assert coalesce([(0, 0, 10), (5, 100, 1), (10, 10, 10)]) == [(0, 0, 20), (5, 100, 1)]


def test_coalesce_rejects_conflicting_local_writes() -> None:
    with pytest.raises(ValueError, match="conflicting writes"):
        coalesce([(0, 0, 10), (100, 5, 10)])
    with pytest.raises(ValueError, match="negative"):
        coalesce([(0, -1, 10)])
    assert coalesce([]) == []
    assert coalesce([(5, 5, 0)]) == []


@pytest.mark.parametrize("seed", range(50))
def test_region_index_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    index, regions = RegionIndex(), []
    for step in range(60):
        if regions and rng.random() < 0.25:
            a, n = regions.pop(rng.randrange(len(regions)))
            assert index.remove(a, n)
        else:
            a, n = rng.randrange(0, 4000), rng.randint(1, 500)  # overlaps and nesting allowed
            regions.append((a, n))
            index.add(a, n)
        assert len(index) == len(regions)
        for _ in range(20):
            q, m = rng.randrange(0, 4600), rng.randint(1, 300)
            want = any(a <= q and q + m <= a + n for a, n in regions)
            assert index.contains(q, m) == want, (step, q, m, regions)
    assert not index.remove(10**9, 1)


def test_check_local_disjoint() -> None:
    check_local_disjoint([(0, 0, 10), (50, 10, 10)])
    with pytest.raises(ValueError, match="conflicting writes"):
        check_local_disjoint([(0, 0, 10), (50, 9, 10)])


def _reference_window(remote: bytes, base: int, rows: int, row_bytes: int, c0: int, c1: int) -> bytes:
    return b"".join(remote[base + r * row_bytes + c0 : base + r * row_bytes + c1] for r in range(rows))


@pytest.mark.parametrize("seed", range(200))
def test_row_slice_plans_match_byte_reference(seed: int) -> None:
    torch = pytest.importorskip("torch")
    rng = random.Random(seed)
    rows = rng.randint(1, 40)
    row_bytes = rng.randint(1, 300)
    c0 = rng.randrange(0, row_bytes)
    c1 = rng.randint(c0 + 1, row_bytes)
    base = rng.randrange(0, 64)
    remote = rng.randbytes(base + rows * row_bytes + 64)
    want = _reference_window(remote, base, rows, row_bytes, c0, c1)
    remote_base_addr = 1 << 20  # pretend address of remote[0]

    for force in ("rows", "hull", None):
        plan = plan_row_slice(remote_base_addr + base, rows, row_bytes, c0, c1, force=force)
        assert plan.out_bytes == len(want)
        landing_addr = 1 << 30
        local_ops = plan.local_ops(landing_addr)
        landing = _apply(local_ops, remote, plan.landing_bytes, remote_base_addr, landing_addr)
        landing_t = torch.tensor(list(landing), dtype=torch.uint8)
        out = torch.zeros(plan.out_bytes, dtype=torch.uint8)
        plan.extract(landing_t, out)
        assert bytes(out.numpy()) == want, (force, plan.mode)
        if plan.mode == "hull":
            assert len(plan.reads) == 1
        else:
            assert total_bytes(plan.reads) == plan.out_bytes


def test_row_slice_cost_model_matches_measurements() -> None:
    # 8,192 rows x 8 KiB window of 16 KiB rows: per-row ~41 ms (measured 1.6 GB/s), hull wins.
    plan = plan_row_slice(0, 8192, 16384, 0, 8192)
    assert plan.mode == "hull"
    assert plan.cost_rows_s == pytest.approx(8192 * 5e-6 + 8192 * 8192 / 354e9)
    assert 0.040 < plan.cost_rows_s < 0.043
    assert plan.cost_hull_s < 0.001
    # Few rows, narrow window of huge rows: the hull would drag 192 MiB for 4 MiB; per-row wins.
    plan = plan_row_slice(0, 4, 64 << 20, 0, 1 << 20)
    assert plan.mode == "rows" and len(plan.reads) == 4
    # Whole rows: one contiguous read, no copy.
    plan = plan_row_slice(0, 100, 256, 0, 256)
    assert plan.mode == "rows" and plan.reads == ((0, 0, 25600),) and not plan.needs_copy
    # Constants are parameters: free descriptors make per-row win.
    assert plan_row_slice(0, 8192, 16384, 0, 8192, descriptor_overhead_s=0.0).mode == "rows"
    # A memory cap on the landing buffer forces per-row.
    assert plan_row_slice(0, 8192, 16384, 0, 8192, max_hull_bytes=1 << 20).mode == "rows"


def test_row_slice_rejects_bad_geometry() -> None:
    for args in [(0, 0, 10, 0, 1), (0, 4, 10, 5, 5), (0, 4, 10, 0, 11), (-1, 4, 10, 0, 1)]:
        with pytest.raises(ValueError):
            plan_row_slice(*args)
    assert isinstance(plan_row_slice(0, 2, 8, 2, 4), RowSlicePlan)
