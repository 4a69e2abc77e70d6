"""``receive_mode: direct``: the bytes go into the engine's parameters through one registered
buffer of at most ``receive_buffer_bytes``, chunk by chunk.

A direct refit has no receive arena. The plan's outputs (:class:`~mx_refit.plan.PlannedOutput`:
where each tensor's bytes, and its staged column blocks, sit in the arena the plan was made for)
are cut into *chunks* that fit the buffer: whole tensors while they fit, and a tensor larger
than the buffer into pieces of whole rows (dim 0), each with the same rows of its staged blocks.
For each chunk the plan's reads are intersected with the chunk's arena intervals and shifted
into the buffer, pulled, the staged blocks placed, and the tensors handed to the engine: whole
ones through ``mx_refit_load_weights``, row pieces through the writers the engine gave in
``mx_refit_direct_targets``. Then the next chunk reuses the buffer.

Failure semantics. Everything that can refuse the version runs before the first byte is
written: discovery, plan and compile targets, the lease, the engine's own check
(``mx_refit_direct_targets``), the chunking (a tensor the engine takes only whole must fit; one
row of every tensor must fit) and the buffer's allocation (the free-memory check). After the
first write the engine holds a mix of versions: any failure (a source lost, the lease lost, the
engine refusing a tensor) raises :class:`~mx_refit.errors.PartiallyUpdated` naming the model
and the version; the engine must refit again before it serves.

The smallest buffer accepted is :data:`~mx_refit.checks.MIN_RECEIVE_BUFFER_BYTES`; a plan also
needs one row of its widest tensor (with that row of its staged blocks, plus 16 bytes of
alignment per interval) to fit, checked here before the first byte.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mx_refit.errors import FailedPrecondition, InvalidArgument, PartiallyUpdated
from mx_refit.plan import place_column_blocks
from mx_refit.receive.failover import merged_pulls

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    import torch

    from mx_refit.plan import PlannedOutput, ReceivePlan
    from mx_refit.receive.failover import FailoverPull
    from mx_refit.receive.lease_order import Leased, Requests
    from mx_refit.types import RefitStats

__all__ = ["Chunk", "DirectRefit", "Piece", "chunk_outputs", "chunk_requests"]

log = logging.getLogger(__name__)

ALIGN = 16  # every interval starts 16-byte aligned in the buffer (dtype-aligned views)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _rows(out: "PlannedOutput") -> int:
    return out.shape[0] if out.shape and out.shape[0] else 1  # a scalar or an empty tensor: one row


@dataclass
class Piece:
    """Rows ``first .. first + rows`` of one output, at buffer offset ``at`` (its staged
    blocks' same rows at ``blocks``)."""

    out: "PlannedOutput"
    first: int
    rows: int
    at: int
    blocks: list[int]

    @property
    def whole(self) -> bool:
        return self.first == 0 and self.rows == _rows(self.out)


@dataclass
class Chunk:
    """What one pull brings into the buffer: pieces, and the arena intervals they come from as
    ``(arena lo, arena hi, buffer offset)``; ``nbytes`` of the buffer used."""

    pieces: list[Piece] = field(default_factory=list)
    intervals: list[tuple[int, int, int]] = field(default_factory=list)
    nbytes: int = 0

    def add(self, out: "PlannedOutput", first: int, rows: int) -> None:
        row = out.nbytes // _rows(out)
        at = _align(self.nbytes)
        lo = out.offset + first * row
        self.intervals.append((lo, lo + rows * row, at))
        end = at + rows * row
        blocks = []
        for landing, stride, width, _ in out.copies:
            b_at = _align(end)
            lo = landing + first * out.sub * stride
            hi = lo + (rows * out.sub - 1) * stride + width
            self.intervals.append((lo, hi, b_at))
            blocks.append(b_at)
            end = b_at + hi - lo
        self.nbytes = end
        self.pieces.append(Piece(out, first, rows, at, blocks))


def _need(out: "PlannedOutput", rows: int) -> int:
    """Buffer bytes ``rows`` rows of ``out`` take at most (with their staged blocks' rows)."""
    row = out.nbytes // _rows(out) + sum(out.sub * stride for _, stride, _, _ in out.copies)
    return rows * row + ALIGN * (1 + len(out.copies))


def chunk_outputs(outputs: "list[PlannedOutput]", buffer_bytes: int, splittable: "set[str]") -> list[Chunk]:
    """The outputs cut into chunks of at most ``buffer_bytes``: whole tensors while they fit,
    row pieces of a larger one (only those named in ``splittable``: the engine can write them
    in pieces). Raises before anything is pulled when a tensor cannot be received."""
    chunks: list[Chunk] = []
    cur = Chunk()
    for out in outputs:
        rows = _rows(out)
        whole = _need(out, rows)
        if whole <= buffer_bytes:
            if _align(cur.nbytes) + whole > buffer_bytes:
                chunks.append(cur)
                cur = Chunk()
            cur.add(out, 0, rows)
            continue
        if out.name not in splittable:
            raise FailedPrecondition(
                f"receive_buffer_bytes: tensor {out.name!r} ({out.nbytes} bytes) does not fit the "
                f"{buffer_bytes}-byte receive buffer and the engine loads it only whole (it gave no row "
                f"writer for it); use receive_buffer_bytes >= {whole} or receive_mode 'staged'"
            )
        one = _need(out, 1)
        if one > buffer_bytes:
            raise InvalidArgument(
                f"receive_buffer_bytes: {buffer_bytes} cannot hold one row of tensor {out.name!r} "
                f"({one} bytes with its staged blocks); use at least {one}"
            )
        first = 0
        while first < rows:
            room = buffer_bytes - _align(cur.nbytes)
            n = min(rows - first, max(0, room - _need(out, 0)) // (_need(out, 1) - _need(out, 0)))
            if n == 0:
                chunks.append(cur)
                cur = Chunk()
                continue
            cur.add(out, first, n)
            first += n
    if cur.pieces:
        chunks.append(cur)
    return chunks


def chunk_requests(requests: "Requests", chunks: list[Chunk]) -> "list[Requests]":
    """Per chunk, the reads (``(holder address, arena offset, nbytes)`` per holder) cut to the
    chunk's arena intervals and shifted into the buffer."""
    spans = sorted((lo, hi, at, i) for i, c in enumerate(chunks) for lo, hi, at in c.intervals if hi > lo)
    los = [s[0] for s in spans]
    per: list[Requests] = [{} for _ in chunks]
    for sid, ranges in requests.items():
        for addr, local, n in ranges:
            j = max(0, bisect.bisect_right(los, local) - 1)
            while j < len(spans) and spans[j][0] < local + n:
                lo, hi, at, i = spans[j]
                a, b = max(lo, local), min(hi, local + n)
                if a < b:
                    per[i].setdefault(sid, []).append((addr + a - local, at + a - lo, b - a))
                j += 1
    return per


def _place(buffer: "torch.Tensor", piece: Piece) -> "torch.Tensor":
    """The piece's rows as a tensor (a view of the buffer), its staged blocks copied in."""
    import torch

    out = piece.out
    row = out.nbytes // _rows(out)
    region = buffer[piece.at : piece.at + piece.rows * row]
    if out.copies:
        place_column_blocks(region.view(piece.rows * out.sub, row // out.sub), [
            (col, buffer.as_strided((piece.rows * out.sub, width), (stride, 1), buffer.storage_offset() + b_at))
            for (_, stride, width, col), b_at in zip(out.copies, piece.blocks)
        ])
    shape = out.shape if piece.whole else (piece.rows, *out.shape[1:])
    return region.view(getattr(torch, out.dtype)).view(shape)


class DirectRefit:
    """One direct refit on a :class:`~mx_refit.receive.cycle.RefitCycle` (``cycle``; ``watch``
    its refit's stopwatch; neither imported here: the cycle imports this module): built (every check,
    the buffer) before the first byte; :meth:`write` pulls and loads chunk by chunk;
    :meth:`finish` confirms the lease and reports."""

    def __init__(self, cycle: Any, leased: "Leased", plan: "ReceivePlan") -> None:
        opts = cycle.options
        self.cycle, self.leased, self.plan = cycle, leased, plan
        self.what = f"refit of model {opts.model!r} version {leased.info.version}"
        if cycle.engine is None:
            raise FailedPrecondition(
                f"receiver {opts.reader_id!r}: receive_mode 'direct' writes into an engine's parameters; "
                f"give the Receiver an engine (or use receive_mode 'staged')"
            )
        outputs_of = getattr(plan, "outputs", None)
        if outputs_of is None:
            raise FailedPrecondition(
                f"receive_mode 'direct': the {type(plan).__name__} plan does not describe its tensors' "
                f"bytes (no outputs()); use receive_mode 'staged'"
            )
        self.outputs: list[PlannedOutput] = outputs_of()
        self.writers: dict[str, Callable[[int, torch.Tensor], None]] = cycle.hooks.direct_targets(
            cycle.engine, [(o.name, tuple(o.shape), o.dtype) for o in self.outputs])
        self.chunks = chunk_outputs(self.outputs, opts.receive_buffer_bytes, set(self.writers))
        self.requests = chunk_requests(leased.requests, self.chunks)
        self.buffer = cycle.direct_buffer(max((c.nbytes for c in self.chunks), default=0))
        self.written = 0  # chunks handed to the engine (or being handed)
        self.pulls: list[FailoverPull] = []

    def write(self, watch: Any) -> None:
        """Every chunk: pull into the buffer, place the staged blocks, load into the engine."""
        pull_s = load_s = 0.0
        try:
            for chunk, requests in zip(self.chunks, self.requests):
                began = time.perf_counter()
                self.pulls.append(self.cycle.pull(self.leased, self.buffer, requests))
                placed = [(piece, _place(self.buffer, piece)) for piece in chunk.pieces]
                loaded = time.perf_counter()
                pull_s += loaded - began
                self.written += 1
                self._load(placed)
                if self.buffer.is_cuda:  # the copies out of the buffer finish before the next pull rewrites it
                    import torch

                    torch.cuda.synchronize(self.buffer.device)
                load_s += time.perf_counter() - loaded
        except BaseException as exc:
            if self.written:
                raise self.partial(exc) from exc
            raise
        finally:
            watch.seconds["pull"], watch.seconds["load"] = pull_s, load_s

    def _load(self, placed: "list[tuple[Piece, torch.Tensor]]") -> None:
        whole: list[tuple[str, torch.Tensor]] = []
        for piece, tensor in placed:
            if piece.whole:
                whole.append((piece.out.name, tensor))
                continue
            if whole:
                self.cycle.load(whole)
                whole = []
            self.writers[piece.out.name](piece.first, tensor)
        if whole:
            self.cycle.load(whole)

    def partial(self, exc: BaseException) -> PartiallyUpdated:
        info = self.leased.info
        return PartiallyUpdated(
            f"{self.what} failed after {self.written} of {len(self.chunks)} chunks were written into the "
            f"engine's parameters (receive_mode 'direct'): they hold part of version {info.version} and "
            f"part of the previous weights; do not serve them, refit again: {exc}",
            model=info.model, version=info.version,
        )

    def finish(self, watch: Any, notify: bool, registrations_before: int) -> "RefitStats":
        """Confirm the lease was held for the whole pull (else the bytes written may have been
        mutated under it: :class:`PartiallyUpdated`), then the stats (``refit_done`` with ``notify``)."""
        import dataclasses

        began = time.perf_counter()
        try:
            confirmed_by = self.cycle.release(self.leased)
        except BaseException as exc:
            raise self.partial(exc) from exc
        watch.seconds["release"] = time.perf_counter() - began
        cycle = self.cycle
        stats = cycle._stats(self.leased, self.plan, self.outputs, merged_pulls(self.pulls), 0, confirmed_by,
                             watch.seconds, cycle.transport.registrations - registrations_before)
        stats = dataclasses.replace(stats, receive_mode="direct", chunks=len(self.chunks),
                                    receive_memory_bytes=self.buffer.numel())
        if notify:
            cycle.hooks.refit_done(stats)
        log.info("%s: %d tensors, %.1f MB in %d chunks through a %d-byte buffer in %.3fs", self.what,
                 stats.tensors, stats.bytes_pulled / 1e6, len(self.chunks), self.buffer.numel(), stats.seconds)
        return stats
