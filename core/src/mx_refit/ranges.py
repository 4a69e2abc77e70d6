"""Pure byte-range arithmetic for the transport: coalescing, registered-region lookup and
row-slice planning.

Nothing here touches NIXL, and torch is only imported inside :meth:`RowSlicePlan.extract`; the
rest works on plain integers so it can be tested exhaustively against a byte-level reference.

Why it matters (measured with nixl 1.5.1/UCX on 2xH200): every descriptor costs about 5 us, so
10,000 x 256 KiB descriptors ran at 46 GB/s where 64 large ones reached 354 GB/s. Merging ranges
that are adjacent on both sides is therefore free bandwidth, and a column window of a row-major
tensor is often better fetched as one contiguous "hull" plus a local strided copy than as one
descriptor per row (8,192 rows x 8 KiB per-row ran at 1.6 GB/s; with this module on 2xH200 the
dim-1 half of a [8192, 8192] bf16 tensor took 66 ms per-row vs 0.72 ms as hull + copy). Strided
NIXL descriptors are never an option: they report DONE but move the wrong bytes.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "DEFAULT_DESCRIPTOR_OVERHEAD_S",
    "DEFAULT_LOCAL_COPY_BANDWIDTH",
    "DEFAULT_TRANSFER_BANDWIDTH",
    "DEVICE_COPY_COSTS",
    "Range",
    "RegionIndex",
    "RowSlicePlan",
    "check_local_disjoint",
    "coalesce",
    "plan_row_slice",
    "total_bytes",
]

# (remote_addr, local_addr, nbytes): nbytes at remote_addr of a peer land at local_addr.
Range = tuple[int, int, int]

# Cost-model defaults from the 2xH200 NVLink measurements (feasibility.md section 11).
DEFAULT_DESCRIPTOR_OVERHEAD_S = 5e-6  # per-descriptor cost inside one NIXL request
DEFAULT_TRANSFER_BANDWIDTH = 354e9  # bytes/s of a NIXL READ with large descriptors
DEFAULT_LOCAL_COPY_BANDWIDTH = 284e9  # bytes/s of a local strided copy (dim-1 half, bf16)

# The same model for a CUDA IPC read (one device copy per range, one H200, BENCHMARKS.md
# "Colocated"): ~2.5 us per copy on top of its bytes (370 copies took 3.8 ms against 2.9 ms as
# one flat copy of the same bytes) and ~2.1 TB/s for large copies. The local strided copy that a
# hull needs runs on the same GPU whichever path brought the bytes.
DEVICE_COPY_COSTS: dict[str, float] = {
    "descriptor_overhead_s": 2.5e-6,
    "transfer_bandwidth": 2.1e12,
    "local_copy_bandwidth": DEFAULT_LOCAL_COPY_BANDWIDTH,
}


def total_bytes(ops: Iterable[Range]) -> int:
    """Sum of ``nbytes`` over ``ops``."""
    return sum(n for _, _, n in ops)


def coalesce(ops: Iterable[Range]) -> list[Range]:
    """Merge ranges that are contiguous on BOTH the remote and the local side.

    Two ranges merge only when they share the same remote-to-local displacement
    (``remote_addr - local_addr``) and touch or overlap; with the same displacement an overlapping
    byte is mapped identically by both, so the union is exactly the same set of writes. Exact
    duplicates collapse as a consequence. Zero-length ranges are dropped.

    Ranges whose LOCAL bytes overlap with different displacements would write the same bytes from
    two places (the result would depend on transfer order); they are rejected with ``ValueError``.

    The result is sorted by remote address (sequential reads on the source side).

    Raises:
        ValueError: a negative address or length, or conflicting overlapping local writes.
    """
    items: list[Range] = []
    for i, (remote, local, n) in enumerate(ops):
        if n < 0 or remote < 0 or local < 0:
            raise ValueError(f"ops[{i}]: negative field in (remote={remote}, local={local}, nbytes={n})")
        if n:
            items.append((int(remote), int(local), int(n)))
    if not items:
        return []
    # Group by displacement so ranges that can merge are neighbours even when other ranges
    # interleave with them in remote order.
    items.sort(key=lambda r: (r[0] - r[1], r[0]))
    merged: list[list[int]] = []
    for remote, local, n in items:
        if merged:
            last = merged[-1]
            if last[0] - last[1] == remote - local and remote <= last[0] + last[2]:
                last[2] = max(last[2], remote + n - last[0])
                continue
        merged.append([remote, local, n])
    check_local_disjoint(merged)
    merged.sort(key=lambda r: r[0])
    return [(r, l, n) for r, l, n in merged]


def split_at(ops: Sequence[Range], boundaries: Sequence[int]) -> list[Range]:
    """Cut ranges wherever they cross a remote ``boundary`` (sorted addresses).

    NIXL descriptors must stay inside one registered region; coalescing ranges that are adjacent
    in memory can cross from one region into the next, so merged ranges are cut back at region
    edges.
    """
    out: list[Range] = []
    for remote, local, n in ops:
        end = remote + n
        i = bisect.bisect_right(boundaries, remote)
        while i < len(boundaries) and boundaries[i] < end:
            cut = boundaries[i]
            out.append((remote, local, cut - remote))
            local += cut - remote
            remote = cut
            i += 1
        out.append((remote, local, end - remote))
    return out


def check_local_disjoint(ranges: Iterable[Sequence[int]]) -> None:
    """Raise ValueError if two ``(remote, local, nbytes)`` ranges write the same local byte
    (run it on coalesced ranges: same-displacement overlaps are merged there, not conflicts)."""
    by_local = sorted(ranges, key=lambda r: r[1])
    for prev, cur in zip(by_local, by_local[1:]):
        if cur[1] < prev[1] + prev[2]:
            raise ValueError(
                "conflicting writes: local bytes "
                f"[{cur[1]:#x}, {min(prev[1] + prev[2], cur[1] + cur[2]):#x}) are targeted by "
                f"remote {prev[0]:#x}+{prev[2]} and remote {cur[0]:#x}+{cur[2]}"
            )


@dataclass
class RegionIndex:
    """Registered memory regions of one (memory type, device): sorted starts plus a running
    maximum of ends, so "is [a, a+n) inside some region" is one bisect even when regions overlap
    (the region with the furthest end among those starting at or before ``a`` decides)."""

    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    prefix_max_end: list[int] = field(default_factory=list)

    def add(self, addr: int, nbytes: int) -> None:
        i = bisect.bisect_right(self.starts, addr)
        self.starts.insert(i, addr)
        self.ends.insert(i, addr + nbytes)
        self.prefix_max_end = list(itertools.accumulate(self.ends, max))

    def remove(self, addr: int, nbytes: int) -> bool:
        """Remove one region equal to ``[addr, addr + nbytes)``; False if there is none."""
        for i in range(bisect.bisect_left(self.starts, addr), len(self.starts)):
            if self.starts[i] != addr:
                break
            if self.ends[i] == addr + nbytes:
                del self.starts[i], self.ends[i]
                self.prefix_max_end = list(itertools.accumulate(self.ends, max))
                return True
        return False

    def contains(self, addr: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self.starts, addr) - 1
        return i >= 0 and self.prefix_max_end[i] >= addr + nbytes

    def find(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        """A region ``(start, nbytes)`` containing ``[addr, addr + nbytes)``, or ``None``."""
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0 or self.prefix_max_end[i] < addr + nbytes:
            return None
        while self.ends[i] < addr + nbytes:  # prefix_max_end guarantees one exists at or before i
            i -= 1
        return self.starts[i], self.ends[i] - self.starts[i]

    def __len__(self) -> int:
        return len(self.starts)


@dataclass(frozen=True)
class RowSlicePlan:
    """How to fetch the column byte window ``[col_begin, col_end)`` of every row of a remote
    row-major tensor into a dense ``[rows, width]`` local block.

    ``reads`` are ``(remote_addr, landing_offset, nbytes)`` relative to a local *landing* buffer of
    ``landing_bytes`` bytes:

    * ``mode == "rows"``: one range per row (coalesced when the window covers whole rows); the
      landing buffer IS the output, no copy is needed.
    * ``mode == "hull"``: a single contiguous read of everything from the window start of the
      first row to the window end of the last row; the output is then the strided view
      ``landing.as_strided((rows, width), (row_bytes, 1))`` copied into place (:meth:`extract`).

    ``cost_rows_s`` / ``cost_hull_s`` are the model estimates the choice was made from.
    """

    mode: Literal["rows", "hull"]
    rows: int
    row_bytes: int
    col_begin: int
    col_end: int
    reads: tuple[Range, ...]
    landing_bytes: int
    cost_rows_s: float
    cost_hull_s: float

    @property
    def width(self) -> int:
        """Bytes of the window in each row."""
        return self.col_end - self.col_begin

    @property
    def out_bytes(self) -> int:
        """Bytes of the dense ``[rows, width]`` result."""
        return self.rows * self.width

    @property
    def needs_copy(self) -> bool:
        """Whether the landing buffer must be copied into the output (hull mode)."""
        return self.mode == "hull"

    def local_ops(self, landing_addr: int) -> list[Range]:
        """``reads`` with landing offsets turned into absolute local addresses."""
        return [(r, landing_addr + off, n) for r, off, n in self.reads]

    def extract(self, landing: "torch.Tensor", out: "torch.Tensor") -> "torch.Tensor":
        """Copy the window out of ``landing`` (a uint8 tensor of >= ``landing_bytes``) into ``out``
        (a contiguous tensor of ``out_bytes`` bytes, any dtype); returns ``out``.

        In rows mode ``landing`` normally *is* ``out`` (then nothing is copied). The copy uses a
        local strided view, which is exact, unlike strided NIXL descriptors.
        """
        import torch  # only callers that already hold tensors get here

        if landing.dtype != torch.uint8 or landing.dim() != 1 or not landing.is_contiguous():
            raise ValueError("landing must be a contiguous 1-D uint8 tensor")
        out_u8 = out.view(-1).view(torch.uint8)
        if out_u8.numel() != self.out_bytes:
            raise ValueError(f"out has {out_u8.numel()} bytes, plan produces {self.out_bytes}")
        if landing.numel() < self.landing_bytes:
            raise ValueError(f"landing has {landing.numel()} bytes, plan needs {self.landing_bytes}")
        if self.mode == "rows":
            if landing.data_ptr() != out_u8.data_ptr():
                out_u8.copy_(landing[: self.out_bytes])
            return out
        window = landing.as_strided((self.rows, self.width), (self.row_bytes, 1), landing.storage_offset())
        out_u8.view(self.rows, self.width).copy_(window)
        return out


def plan_row_slice(
    remote_addr: int,
    rows: int,
    row_bytes: int,
    col_begin: int,
    col_end: int,
    *,
    descriptor_overhead_s: float = DEFAULT_DESCRIPTOR_OVERHEAD_S,
    transfer_bandwidth: float = DEFAULT_TRANSFER_BANDWIDTH,
    local_copy_bandwidth: float = DEFAULT_LOCAL_COPY_BANDWIDTH,
    max_hull_bytes: int | None = None,
    force: Literal["rows", "hull"] | None = None,
) -> RowSlicePlan:
    """Plan fetching bytes ``[col_begin, col_end)`` of each of ``rows`` rows (``row_bytes`` apart,
    the first at ``remote_addr``) of a remote row-major tensor.

    Cost model (seconds, all constants are parameters):

    * per-row: ``rows * descriptor_overhead_s + rows * width / transfer_bandwidth``
    * hull: ``descriptor_overhead_s + hull_bytes / transfer_bandwidth
      + rows * width / local_copy_bandwidth`` where
      ``hull_bytes = (rows - 1) * row_bytes + width``.

    With the H200 defaults, 8,192 rows x 8 KiB of 16 KiB rows costs ~41 ms per-row (matching the
    measured 1.6 GB/s) against ~0.6 ms for the hull. Per-row wins when few rows carry a narrow
    window of very wide rows, where the hull would move mostly unwanted bytes. When the window is
    the whole row both modes collapse to one contiguous read and "rows" is returned (no copy).

    Args:
        max_hull_bytes: refuse the hull (use per-row) when it would need more landing memory.
        force: pick a mode regardless of cost (tests, or callers that know better).

    Raises:
        ValueError: an empty or out-of-row window, or non-positive geometry.
    """
    if rows <= 0 or row_bytes <= 0:
        raise ValueError(f"rows and row_bytes must be positive, got rows={rows} row_bytes={row_bytes}")
    if not 0 <= col_begin < col_end <= row_bytes:
        raise ValueError(f"column window [{col_begin}, {col_end}) must be non-empty inside [0, {row_bytes})")
    if remote_addr < 0:
        raise ValueError(f"remote_addr must be >= 0, got {remote_addr}")
    if descriptor_overhead_s < 0 or transfer_bandwidth <= 0 or local_copy_bandwidth <= 0:
        raise ValueError("cost constants must be positive")

    width = col_end - col_begin
    out_bytes = rows * width
    hull_bytes = (rows - 1) * row_bytes + width
    cost_rows = rows * descriptor_overhead_s + out_bytes / transfer_bandwidth
    cost_hull = descriptor_overhead_s + hull_bytes / transfer_bandwidth + out_bytes / local_copy_bandwidth

    if width == row_bytes or rows == 1:
        mode: Literal["rows", "hull"] = "rows"  # already contiguous: one descriptor, no copy
    elif force is not None:
        if force not in ("rows", "hull"):
            raise ValueError(f"force must be 'rows', 'hull' or None, got {force!r}")
        mode = force
    elif max_hull_bytes is not None and hull_bytes > max_hull_bytes:
        mode = "rows"
    else:
        mode = "hull" if cost_hull < cost_rows else "rows"

    first = remote_addr + col_begin
    if mode == "rows":
        reads = tuple(coalesce((first + r * row_bytes, r * width, width) for r in range(rows)))
        landing = out_bytes
    else:
        reads = ((first, 0, hull_bytes),)
        landing = hull_bytes
    return RowSlicePlan(
        mode=mode,
        rows=rows,
        row_bytes=row_bytes,
        col_begin=col_begin,
        col_end=col_end,
        reads=reads,
        landing_bytes=landing,
        cost_rows_s=cost_rows,
        cost_hull_s=cost_hull,
    )
