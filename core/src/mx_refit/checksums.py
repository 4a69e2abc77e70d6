"""End-to-end checksums (``weight_sync.checksums``).

**The function.** A tensor's bytes are cut into blocks of ``block_bytes`` from its first byte
(the last block may be shorter). A block of ``n`` bytes is read as ``m = n // 8`` little-endian
int64 words ``x_i`` plus ``n % 8`` tail bytes ``b_j``; its checksum is

    ( sum_i x_i * (2i + 1)  +  sum_j b_j * (2(m + j) + 1) )  mod 2**64

as a signed int64 (int64 multiplication and summation wrap modulo 2**64 on every CPU and GPU,
and a sum modulo 2**64 does not depend on the reduction order, so every device computes the
same number). The weights are odd, so flipping bit k of word i changes the sum by
``±(2i+1) * 2**k``, which is never 0 modulo 2**64: **every single bit flip changes the
checksum**, and so does moving a word to another position (different weights). It is an
error-detecting code, not a MAC. (Widening int32 products to an int64 sum was measured 4-5x
slower on CPU than this: torch's widening reductions are not vectorised there.)

It runs where the bytes live, and each implementation computes exactly that number:

- **CPU**: one int64 matrix-vector product of a span's whole blocks with the weights
  (``torch.mv``: one vectorised pass, about a copy's time; a multiply then a row-sum was
  ~10-50x slower on CPU).
- **GPU**: a Triton kernel (:mod:`mx_refit.checksum_kernels`), one program per block and one
  launch for every block of every tensor; without Triton, torch ops on the device.
- **Fused into the receiver's copy**: on the CUDA IPC path the kernel copies each whole block
  and sums it from the same loads (each byte read once); bytes that land by NIXL in a DRAM
  arena are summed batch by batch while the next batch transfers
  (:mod:`mx_refit.receive.overlap`), in VRAM by one launch after the pull.
- **Source side**: :func:`start_source_checksums` launches the publisher's sums on a side stream
  (after the writes of the weights) and the publisher collects them only just before it
  registers the version, so they overlap its registration work.

Only the sums (8 bytes per block) reach the host.

**Partial reads.** Receivers pull byte subranges of source tensors (TP resharding, row windows,
coalesced hulls), and a checksum can only vouch for a whole block. With checksums on, the
receiver widens its reads (:func:`widen`): a block wholly inside a planned read is read in place
and verified there; a block the plan touches only in part is read whole, once, into a staging
area after the plan's arena, verified, and the plan's bytes are copied out of it. So every byte
that reaches the engine lies in a verified block. The cost is at most one extra block per edge
of each planned range (``RefitStats.bytes_pulled`` counts it), one local copy of the partially
covered bytes, and the checksum pass itself.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mx_refit.errors import InvalidArgument, TransferError
from mx_refit.types import BlockChecksums, PackedSums, SourceInfo, TensorDescriptor

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

    from mx_refit.checksum_kernels import CopySums

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "KnownSums",
    "Verification",
    "block_count",
    "check_block_bytes",
    "source_checksums",
    "span_sums",
    "validate_checksums",
    "verify",
    "widen",
]

DEFAULT_BLOCK_BYTES = 1 << 20
MIN_BLOCK_BYTES = 4096
MAX_BLOCK_BYTES = 1 << 30
_CHUNK_BYTES = 64 << 20  # bounds the temporary of one multiply
_INT64 = (-(1 << 63), (1 << 63) - 1)


def check_block_bytes(value: object, field: str) -> int:
    """``value`` as a block size, or :class:`InvalidArgument` naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or not (
        MIN_BLOCK_BYTES <= value <= MAX_BLOCK_BYTES and value % 8 == 0
    ):
        raise InvalidArgument(
            f"{field}: must be a multiple of 8 in [{MIN_BLOCK_BYTES}, {MAX_BLOCK_BYTES}], got {value!r}"
        )
    return value


def block_count(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes)


def validate_checksums(
    checksums: object, tensors: Sequence[TensorDescriptor]
) -> BlockChecksums | None:
    """The catalog's check of ``SourceInfo.checksums``: block size, and one int64 per block."""
    if checksums is None:
        return None
    if not isinstance(checksums, BlockChecksums):
        raise InvalidArgument(f"source.checksums: expected a BlockChecksums, got {type(checksums).__name__}")
    block = check_block_bytes(checksums.block_bytes, "source.checksums.block_bytes")
    sums = checksums.sums
    packed = isinstance(sums, PackedSums)  # int64 by construction: no check per block
    if not packed and (isinstance(sums, (str, bytes)) or not isinstance(sums, Sequence)):
        raise InvalidArgument(f"source.checksums.sums: must be a sequence, got {type(sums).__name__}")
    expected = sum(block_count(d.nbytes, block) for d in tensors)
    if len(sums) != expected:
        raise InvalidArgument(
            f"source.checksums.sums: {len(sums)} values, but {len(tensors)} tensors in blocks of "
            f"{block} bytes make {expected} blocks"
        )
    if packed:
        return checksums if checksums.block_bytes is block else BlockChecksums(block, sums)
    for index, value in enumerate(sums):
        if isinstance(value, bool) or not isinstance(value, int) or not _INT64[0] <= value <= _INT64[1]:
            raise InvalidArgument(f"source.checksums.sums[{index}]: {value!r} is not an int64")
    return BlockChecksums(block, PackedSums.of(sums))


# --- the function --------------------------------------------------------------------------------

_WEIGHTS: dict[str, "torch.Tensor"] = {}


def _weights(device: "torch.device", words: int) -> "torch.Tensor":
    """Odd int64 weights 1, 3, 5, ... (at least ``words`` of them) on ``device``, made once."""
    import torch

    have = _WEIGHTS.get(str(device))
    if have is None or have.numel() < words:
        have = torch.arange(1, 2 * words + 1, 2, dtype=torch.int64, device=device)
        _WEIGHTS[str(device)] = have
    return have


def _words(data: "torch.Tensor") -> "torch.Tensor":
    import torch

    # An int64 view needs an 8-byte aligned start; a rare unaligned span is copied on its device.
    return (data if data.storage_offset() % 8 == 0 else data.clone()).view(torch.int64)


def _one_block(data: "torch.Tensor", weights: "torch.Tensor") -> "torch.Tensor":
    import torch

    n = data.numel()
    words = n // 8
    body = _words(data[: words * 8])
    if data.device.type == "cpu":  # a vectorised dot product (a multiply then a sum is ~50x slower here)
        total = torch.mv(body.view(1, words), weights[:words])[0]
    else:
        total = (body * weights[:words]).sum()
    if n % 8:
        total = total + (data[words * 8 :].to(torch.int64) * weights[words : words + n % 8]).sum()
    return total.reshape(1)


def span_sums(data: "torch.Tensor", block_bytes: int) -> "torch.Tensor":
    """Checksums (an int64 tensor on ``data``'s device) of the consecutive blocks of a flat
    uint8 span that starts at a block boundary; every block but the last is whole.

    CUDA (with Triton): one kernel launch (:mod:`mx_refit.checksum_kernels`). CPU: one int64
    matrix-vector product of the whole blocks with the weights (a single vectorised pass, about
    a copy's time; a multiply then a sum read the bytes three times), the short last block alone.
    """
    import torch

    n = data.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=data.device)
    if data.data_ptr() % 8 == 0:
        from mx_refit import checksum_kernels as kernels

        if kernels.available(data):
            tasks = kernels.device_tasks([(data.data_ptr(), 0, n, 0)], block_bytes, data.device)
            out = torch.empty(tasks.shape[0], dtype=torch.int64, device=data.device)
            kernels.launch(tasks, out, copy=False)
            return out
    weights = _weights(data.device, block_bytes // 8 + 8)
    full = n // block_bytes
    parts = []
    if full:
        body = _words(data[: full * block_bytes]).view(full, block_bytes // 8)
        w = weights[: block_bytes // 8]
        if data.device.type == "cpu":
            parts.append(torch.mv(body, w))
        else:  # no Triton: one multiply and one row-sum per chunk of blocks
            per_chunk = max(1, _CHUNK_BYTES // block_bytes)
            for start in range(0, full, per_chunk):
                parts.append((body[start : start + per_chunk] * w).sum(dim=1))
    if n > full * block_bytes:
        parts.append(_one_block(data[full * block_bytes :], weights))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _flat_bytes(tensor: "torch.Tensor") -> "torch.Tensor":
    import torch

    return tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)


def source_checksums(tensors: Sequence["torch.Tensor"], block_bytes: int) -> BlockChecksums:
    """The checksums a publisher attaches to its source: every block of every tensor, computed
    on the tensors' devices; one host transfer of the sums per device at the end."""
    return start_source_checksums(tensors, block_bytes).result()


class PendingSums:
    """Source checksums under way on the tensors' devices (:func:`start_source_checksums`):
    :meth:`result` waits for them and brings the sums to the host (one transfer per launch)."""

    def __init__(self, block_bytes: int, parts: "list[Any]", events: "list[Any]") -> None:
        self.block_bytes = block_bytes
        # In the tensors' order: a tensor of sums, or (launch output, first slot, count).
        self._parts = parts
        self._events = events

    def result(self) -> BlockChecksums:
        for event in self._events:
            event.synchronize()
        import numpy as np

        host: dict[int, np.ndarray] = {}
        flat: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        for part in self._parts:
            if isinstance(part, tuple):
                out, first, count = part
                values = host.get(id(out))
                if values is None:
                    values = host[id(out)] = out.cpu().numpy()
                flat.append(values[first : first + count])
            else:
                flat.append(part.cpu().numpy())
        packed = np.concatenate(flat).astype("<i8", copy=False).tobytes()  # no Python int per block
        return BlockChecksums(self.block_bytes, PackedSums(packed))


def start_source_checksums(tensors: Sequence["torch.Tensor"], block_bytes: int) -> PendingSums:
    """Start the source checksums and return at once: on a GPU the kernel runs on a side stream
    (ordered after the work queued so far on the current stream, i.e. after the writes of the
    weights) while the publisher describes and registers; :meth:`PendingSums.result` collects
    them. All the aligned CUDA tensors of one device are summed in one kernel launch."""
    import torch

    check_block_bytes(block_bytes, "checksum_block_bytes")
    from mx_refit import checksum_kernels as kernels

    parts: list[Any] = []
    # device -> (src, dst, nbytes, first slot) per tensor, and where each goes in parts
    spans: dict[torch.device, list[tuple[int, int, int, int]]] = {}
    places: dict[torch.device, list[int]] = {}
    slots: dict[torch.device, int] = {}
    for tensor in tensors:
        if not tensor.numel():
            continue
        flat = _flat_bytes(tensor)
        if tensor.is_cuda and flat.data_ptr() % 8 == 0 and kernels.available(flat):
            slot = slots.get(tensor.device, 0)
            spans.setdefault(tensor.device, []).append((flat.data_ptr(), 0, flat.numel(), slot))
            places.setdefault(tensor.device, []).append(len(parts))
            slots[tensor.device] = slot + block_count(flat.numel(), block_bytes)
            parts.append(None)  # filled in below
        else:
            parts.append(span_sums(flat, block_bytes))
    events: list[Any] = []
    for device, device_spans in spans.items():
        tasks = kernels.device_tasks(device_spans, block_bytes, device)
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            out = torch.empty(tasks.shape[0], dtype=torch.int64, device=device)
            kernels.launch(tasks, out, copy=False)
            done = torch.cuda.Event()
            done.record(side)
        events.append(done)
        for index, (_, _, nbytes, slot) in zip(places[device], device_spans):
            parts[index] = (out, slot, block_count(nbytes, block_bytes))
    return PendingSums(block_bytes, parts, events)


_SIDE_STREAMS: dict[str, Any] = {}


def _side_stream(device: "torch.device") -> Any:
    import torch

    stream = _SIDE_STREAMS.get(str(device))
    if stream is None:
        stream = _SIDE_STREAMS[str(device)] = torch.cuda.Stream(device=device)
    return stream


# --- receiving: widen the reads, verify the blocks ---------------------------------------------


@dataclass(frozen=True)
class _Run:
    """Consecutive blocks of one source tensor lying back to back in the arena."""

    source_id: str
    tensor: str
    first_block: int  # block index within the tensor
    first_sum: int  # index into the source's BlockChecksums.sums
    arena_offset: int
    nbytes: int


@dataclass
class Verification:
    """How a plan's reads are widened to whole blocks, and which arena bytes to verify.

    ``requests``: per source, ``(remote_addr, arena_offset, nbytes)`` to pull instead of the
    plan's; ``arena_bytes``: the arena size including the staging area; ``runs``: what to
    verify; ``copies``: ``(staging_offset, plan_offset, nbytes)`` local copies out of verified
    staged blocks into the plan's places, done only after every block verified.
    """

    requests: dict[str, list[tuple[int, int, int]]]
    arena_bytes: int
    block_bytes: dict[str, int]
    runs: list[_Run]
    copies: list[tuple[int, int, int]]
    staged_bytes: int

    def blocks(self) -> "tuple[np.ndarray, np.ndarray]":
        """Every verified block's arena offset and length (int64 arrays) in block order: the
        runs' order (by arena offset), each run's blocks in turn. Made once per widening."""
        kept = self.__dict__.get("_blocks")
        if kept is None:
            import numpy as np

            offsets, lengths = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
            for run in self.runs:
                block = self.block_bytes[run.source_id]
                rel = np.arange(block_count(run.nbytes, block), dtype=np.int64) * block
                offsets.append(run.arena_offset + rel)
                lengths.append(np.minimum(block, run.nbytes - rel))
            kept = self.__dict__["_blocks"] = (np.concatenate(offsets), np.concatenate(lengths))
        return kept  # type: ignore[no-any-return]

    def run_slots(self) -> "np.ndarray":
        """The block slot of each run's first block (ascending)."""
        kept = self.__dict__.get("_run_slots")
        if kept is None:
            import numpy as np

            counts = [block_count(r.nbytes, self.block_bytes[r.source_id]) for r in self.runs]
            kept = self.__dict__["_run_slots"] = np.cumsum([0, *counts[:-1]], dtype=np.int64)
        return kept  # type: ignore[no-any-return]

    def sum_indices(self) -> "dict[str, tuple[np.ndarray, np.ndarray]]":
        """Per source: its blocks' slots, and where each block's sum lies in the source's
        published ``sums`` (so one gather and one comparison check a source). Made once."""
        kept = self.__dict__.get("_sum_indices")
        if kept is None:
            import numpy as np

            parts: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
            for run, first in zip(self.runs, self.run_slots().tolist()):
                n = block_count(run.nbytes, self.block_bytes[run.source_id])
                slots, indices = parts.setdefault(run.source_id, ([], []))
                slots.append(np.arange(first, first + n, dtype=np.int64))
                indices.append(np.arange(run.first_sum, run.first_sum + n, dtype=np.int64))
            kept = self.__dict__["_sum_indices"] = {sid: (np.concatenate(a), np.concatenate(b))
                                                    for sid, (a, b) in parts.items()}
        return kept  # type: ignore[no-any-return]

    def device_indices(self, device: "torch.device") -> "dict[str, tuple[torch.Tensor | None, torch.Tensor]]":
        """:meth:`sum_indices` on ``device`` (made once per device); the slots are None when one
        source's blocks fill every slot in order."""
        kept = self.__dict__.setdefault("_device_indices", {})
        got = kept.get(str(device))
        if got is None:
            import numpy as np
            import torch

            total = len(self.blocks()[0])
            got = {}
            for sid, (slots, positions) in self.sum_indices().items():
                whole = len(slots) == total and bool((slots == np.arange(total)).all())
                got[sid] = (None if whole else torch.from_numpy(slots).to(device),
                            torch.from_numpy(positions).to(device))
            kept[str(device)] = got
        return got  # type: ignore[no-any-return]


@dataclass
class KnownSums:
    """Block sums taken while the bytes came in (every block, in :meth:`Verification.blocks`
    order; ``covered`` marks those present): what :func:`verify` takes from a pull that summed
    as it went (:mod:`mx_refit.receive.overlap`); a fused copy has the same shape."""

    sums: "torch.Tensor"
    covered: "np.ndarray"
    launches: int = 1
    batches: int = 0


def _align(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


def widen(
    plan_requests: dict[str, list[tuple[int, int, int]]],
    sources: dict[str, SourceInfo],
    plan_arena_bytes: int,
) -> Verification:
    """Widen ``plan_requests`` (per source, ``(remote_addr, arena_offset, nbytes)``) so that every
    byte lies in a whole block that is read and verified; see the module docstring.

    :raises TransferError: a source published no checksums, or a planned byte lies in no tensor.
    """
    requests: dict[str, list[tuple[int, int, int]]] = {}
    runs: list[_Run] = []
    copies: list[tuple[int, int, int]] = []
    staging_cursor = _align(plan_arena_bytes)
    block_sizes: dict[str, int] = {}
    for source_id, ops in plan_requests.items():
        source = sources[source_id]
        if source.checksums is None:
            raise TransferError(
                f"source {source_id!r} published no checksums, but this receiver verifies every "
                "byte (weight_sync.checksums: true on the receiver; turn it on for the trainers too)",
                source_id=source_id,
            )
        block = source.checksums.block_bytes
        block_sizes[source_id] = block
        index = _TensorIndex(source.tensors, block)
        direct: list[tuple[int, int, int]] = []
        staged: dict[tuple[int, int], int] = {}  # (tensor index, block) -> staging offset
        for remote, local, nbytes in ops:
            pos, end = remote, remote + nbytes
            while pos < end:
                t = index.containing(pos)
                if t is None:
                    raise TransferError(
                        f"source {source_id!r}: planned byte at {pos:#x} lies in no published tensor, "
                        "so no checksum covers it", source_id=source_id,
                    )
                desc = source.tensors[t]
                stop = min(end, desc.addr + desc.nbytes)
                first, last = (pos - desc.addr) // block, (stop - 1 - desc.addr) // block
                for k in range(first, last + 1):
                    b_start = desc.addr + k * block
                    b_end = min(b_start + block, desc.addr + desc.nbytes)
                    lo, hi = max(pos, b_start), min(stop, b_end)
                    plan_offset = local + (lo - remote)
                    if lo == b_start and hi == b_end:  # the plan reads this block whole: in place
                        direct.append((b_start, plan_offset, b_end - b_start))
                        runs.append(_Run(source_id, desc.name, k, index.first_sum[t] + k, plan_offset,
                                         b_end - b_start))
                        continue
                    at = staged.get((t, k))
                    if at is None:
                        at = staged[(t, k)] = staging_cursor
                        staging_cursor = _align(staging_cursor + (b_end - b_start))
                        direct.append((b_start, at, b_end - b_start))
                        runs.append(_Run(source_id, desc.name, k, index.first_sum[t] + k, at,
                                         b_end - b_start))
                    copies.append((at + (lo - b_start), plan_offset, hi - lo))
                pos = stop
        requests[source_id] = direct
    from mx_refit.ranges import coalesce

    return Verification(
        requests={sid: _cut(coalesce(ops), sources[sid]) for sid, ops in requests.items()},
        arena_bytes=max(staging_cursor, 1),
        block_bytes=block_sizes,
        runs=_merge_runs(runs, block_sizes),
        copies=copies,
        staged_bytes=staging_cursor - _align(plan_arena_bytes),
    )


def _cut(ops: list[tuple[int, int, int]], source: SourceInfo) -> list[tuple[int, int, int]]:
    from mx_refit.ranges import split_at

    spans = source.regions or tuple((d.addr, d.nbytes) for d in source.tensors)
    return split_at(ops, sorted({e for a, n in spans for e in (a, a + n)}))


class _TensorIndex:
    """Which published tensor holds a remote address (bisect over sorted starts)."""

    def __init__(self, tensors: Sequence[TensorDescriptor], block: int) -> None:
        self.order = sorted((d.addr, i) for i, d in enumerate(tensors) if d.nbytes)
        self.starts = [a for a, _ in self.order]
        self.tensors = tensors
        self.longest = max((d.nbytes for d in tensors), default=0)
        self.first_sum: list[int] = []
        cursor = 0
        for d in tensors:
            self.first_sum.append(cursor)
            cursor += block_count(d.nbytes, block)

    def containing(self, addr: int) -> int | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        while i >= 0:  # aliasing tensors may overlap: the nearest start that still holds addr
            _, t = self.order[i]
            d = self.tensors[t]
            if d.addr <= addr < d.addr + d.nbytes:
                return t
            i -= 1
            if i >= 0 and self.order[i][0] + self.longest <= addr:
                break
        return None


def _merge_runs(runs: list[_Run], block_sizes: dict[str, int]) -> list[_Run]:
    """Join runs of the same tensor's consecutive whole blocks that sit back to back."""
    merged: list[_Run] = []
    for run in sorted(runs, key=lambda r: r.arena_offset):
        prev = merged[-1] if merged else None
        block = block_sizes[run.source_id]
        if (
            prev is not None and prev.source_id == run.source_id and prev.tensor == run.tensor
            and prev.nbytes % block == 0
            and prev.arena_offset + prev.nbytes == run.arena_offset
            and run.first_block == prev.first_block + prev.nbytes // block
        ):
            merged[-1] = _Run(prev.source_id, prev.tensor, prev.first_block, prev.first_sum,
                              prev.arena_offset, prev.nbytes + run.nbytes)
        else:
            merged.append(run)
    return merged


def verify(
    arena: "torch.Tensor", verification: Verification, sources: dict[str, SourceInfo],
    fused: "CopySums | KnownSums | None" = None,
) -> int:
    """Check every pulled block against its source's published checksum, then copy the staged
    bytes into the plan's places. Returns the number of blocks verified.

    ``fused``: sums taken during the pull: by the copy itself
    (:class:`~mx_refit.checksum_kernels.CopySums`, valid for exactly one read of these requests
    into ``arena``) or batch by batch (:class:`~mx_refit.receive.overlap.KnownSums`); blocks
    not ``covered`` are summed here, in one kernel launch on a GPU.

    :raises ChecksumMismatch: naming the first bad block's tensor, block, byte range and source
        (and how many blocks mismatched); the plan's places are left as pulled.
    """
    import torch

    from mx_refit.checksum_compare import expected_sums, raise_mismatch

    got = _block_sums(arena, verification, fused)  # on the arena's device
    want = expected_sums(verification, sources, got.device)
    if not torch.equal(got, want):  # one comparison on the device; only a mismatch comes to the host
        raise_mismatch(got.cpu().numpy(), want.cpu().numpy(), verification)
    for staged, place, nbytes in verification.copies:
        arena[place : place + nbytes].copy_(arena[staged : staged + nbytes])
    return int(got.numel())


def _block_sums(
    arena: "torch.Tensor", verification: Verification, fused: "CopySums | KnownSums | None",
) -> "torch.Tensor":
    """Every verified block's checksum in block order (:meth:`Verification.blocks`): the fused
    copy's where it covered the block, the rest computed from the arena now."""
    import numpy as np
    import torch

    from mx_refit import checksum_kernels as kernels

    usable = fused is not None and fused.launches == 1  # one read: the sums match the bytes
    if usable and bool(fused.covered.all()):  # type: ignore[union-attr]
        return fused.sums  # type: ignore[union-attr]
    if not kernels.available(arena):
        parts = [span_sums(arena[r.arena_offset : r.arena_offset + r.nbytes], verification.block_bytes[r.source_id])
                 for r in verification.runs]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    offsets, lengths = verification.blocks()
    if usable:
        assert fused is not None
        out = fused.sums
        tasks, rows = kernels.arena_tasks(arena, offsets, lengths, np.flatnonzero(~fused.covered))
    else:
        out = torch.empty(len(offsets), dtype=torch.int64, device=arena.device)
        kept = verification.__dict__.get("_tasks")
        if kept is None or kept[0] != arena.data_ptr():  # kept for the next refit of this plan
            kept = verification.__dict__["_tasks"] = (arena.data_ptr(), *kernels.arena_tasks(arena, offsets, lengths, None))
        tasks, rows = kept[1], kept[2]
    kernels.launch(tasks, out, copy=False)
    for slot in rows:  # unaligned blocks (rare): torch's path
        data = arena[offsets[slot] : offsets[slot] + lengths[slot]]
        out[slot : slot + 1] = _one_block(data, _weights(arena.device, data.numel() // 8 + 8))
    return out
