"""The IPC read path's CPU-side parts without a GPU: the device-copy cost model of the
hull-or-rows choice, how a read's copies are spread over streams, and the once-per-list arena
bounds check."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mx_refit.errors import InvalidArgument
from mx_refit.ranges import DEVICE_COPY_COSTS, plan_row_slice
from mx_refit.transport.base import row_slice_costs
from mx_refit.transport.cuda_ipc import SPREAD_MIN_COPIES, CudaIpcTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_transport_routing import NODE, export, vram_source


def test_sources_on_this_node_over_ipc_are_costed_as_device_copies() -> None:
    here = vram_source(export())
    assert row_slice_costs([here, here], NODE) == DEVICE_COPY_COSTS
    assert row_slice_costs([here, vram_source(None)], NODE) == {}  # one source needs NIXL
    assert row_slice_costs([vram_source(export(boot="boot-b"))], NODE) == {}
    assert row_slice_costs([vram_source(export(host="host-b"))], NODE) == {}
    assert row_slice_costs([here], NODE.__class__("", "host-a", 1, "")) == {}  # no boot id, no IPC
    assert row_slice_costs([], NODE) == {}


def test_device_copy_costs_change_the_choice_where_nixl_descriptors_cost_more() -> None:
    """4 rows of 1 MiB, half of each: four NIXL descriptors cost more than moving the hull, four
    device copies do not. Either way exactly the window's bytes land in the output."""
    nixl = plan_row_slice(0, 4, 1 << 20, 0, 1 << 19)
    device = plan_row_slice(0, 4, 1 << 20, 0, 1 << 19, **DEVICE_COPY_COSTS)
    assert (nixl.mode, device.mode) == ("hull", "rows")
    assert device.cost_rows_s < nixl.cost_rows_s
    assert device.out_bytes == nixl.out_bytes == 4 << 19


def copies(sizes: list[int]) -> list[tuple[int, int, int]]:
    return [(0x10_0000 * i, 0x20_0000 * i, n) for i, n in enumerate(sizes)]


def test_few_copies_stay_on_one_stream() -> None:
    ipc = CudaIpcTransport(max_streams=4)
    part = copies([1 << 20] * (SPREAD_MIN_COPIES - 1))
    assert ipc._spread([part], 4) == [part]


def test_many_copies_are_balanced_over_the_streams_and_cached() -> None:
    ipc = CudaIpcTransport(max_streams=4)
    big, small = copies([1 << 30]), copies([4096] * 60)
    parts = [big, small]
    groups = ipc._spread(parts, 4)
    assert len(groups) == 4
    assert sorted(c for g in groups for c in g) == sorted(big + small)  # every copy exactly once
    assert groups[0] == big  # the large copy has a stream to itself; the small ones share the rest
    assert max(len(g) for g in groups[1:]) - min(len(g) for g in groups[1:]) <= 1
    assert ipc._spread(parts, 4) is groups  # same lists next cycle: no work
    assert ipc._spread([list(big), small], 4) is not groups  # a new translation: spread again
    assert ipc._spread(parts, 1) == [big + small]


def test_bad_stream_count_is_named() -> None:
    with pytest.raises(InvalidArgument, match="max_streams: 0"):
        CudaIpcTransport(max_streams=0)


def test_arena_bounds_are_checked_once_per_list_and_again_for_a_smaller_arena() -> None:
    from mx_refit.transport.routing import _check_in_arena

    ranges = [(0x1000, 0, 100), (0x2000, 100, 28)]
    assert _check_in_arena("s", ranges, 128) == 128
    with pytest.raises(InvalidArgument, match="read of 28 bytes at arena offset 100 exceeds the 127-byte arena"):
        _check_in_arena("s", ranges, 127)
