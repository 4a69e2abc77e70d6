"""A receiver's delta refits (``weight_sync.delta: auto``): whether it may pull a version's
delta instead of its bytes, what to read, and how the change lands in the arena.

**The proof of the base.** After every refit whose bytes were verified against the sources'
checksums, the receiver remembers (:class:`Held`) the version, each source's checksum digest,
its plan's layout key, and a fingerprint (block sums) of its arena as it left it. A version's
delta is used only when every source the plan reads carries one whose base is that version with
exactly those checksums, the layout is the same, and the arena still has that fingerprint (it
holds the base bytes, in the plan's coordinates). Otherwise the refit is a full pull.

**The pull.** WHOLE tensors are read through the plan's own reads, clipped to them (widened to
whole checksum blocks and verified, as a full pull is); the records region of each source that
has records is read whole into a staging area after those reads and checked against its
``record_sums``. Then all of a source's records are applied at once
(:func:`mx_refit.delta.batch.apply_batch`, equal to decoding each and writing it through the
plan's reads with :func:`mx_refit.delta.records.apply_changes`): exactly where a full pull
would put those source bytes. Tensors without an entry cost no read; HF tensors none of whose bytes changed are
not handed to the engine again.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mx_refit.delta import checksums_digest
from mx_refit.errors import ChecksumMismatch
from mx_refit.types import DeltaForm, SourceInfo, VersionInfo

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mx_refit.checksums import Verification

__all__ = ["DeltaCosts", "DeltaPull", "DeltaState", "Held"]

Requests = dict[str, list[tuple[int, int, int]]]
FINGERPRINT_BLOCK = 1 << 20


def fingerprint(arena: "torch.Tensor", nbytes: int) -> list[int]:
    from mx_refit.checksums import span_sums

    return span_sums(arena[:nbytes], FINGERPRINT_BLOCK).tolist()


@dataclass
class Held:
    """What a receiver's arena holds, as verified: see the module docstring."""

    version: int
    key: object
    digests: dict[str, str]
    fingerprint: list[int] | None  # None: not taken (DeltaState.remember's proof=False)


@dataclass
class DeltaPull:
    """One delta refit's reads: ``requests`` (the WHOLE tensors' reads, widened, plus every
    needed record region into ``records``: source -> (arena offset, nbytes))."""

    widening: "Verification"
    requests: Requests
    records: dict[str, tuple[int, int]]
    arena_bytes: int
    room: int = 0  # arena bytes that hold any delta of these sources (their record buffers' whole size)
    touched: list[tuple[int, int]] = field(default_factory=list)  # arena (offset, nbytes) changed
    bytes_changed: int = 0

    @property
    def record_bytes(self) -> int:
        return sum(n for _, n in self.records.values())

    @property
    def wire_bytes(self) -> int:
        return sum(n for reads in self.requests.values() for _, _, n in reads)


class DeltaState:
    """The receiver's :class:`Held` record and the delta decisions made from it."""

    def __init__(self, check_arena: bool = True) -> None:
        self.held: Held | None = None
        # False: the arena is trusted to hold what was verified into it (no fingerprint passes;
        # the base is still proved by its checksums' digest and the layout)
        self.check_arena = check_arena
        self.check_s = 0.0  # seconds of the last fingerprint pass over the arena

    def _fingerprint(self, arena: "torch.Tensor", nbytes: int) -> list[int]:
        start = time.perf_counter()
        sums = fingerprint(arena, nbytes)
        if arena.device.type == "cuda":
            import torch

            torch.cuda.synchronize(arena.device)
        self.check_s = time.perf_counter() - start
        return sums

    def remember(self, info: VersionInfo, key: object, arena: "torch.Tensor", nbytes: int, proof: bool = True) -> None:
        """After a refit whose bytes were verified: the arena holds ``info``'s bytes.
        ``proof=False``: no fingerprint is taken (a receiver whose full pulls are faster than its
        deltas skips the pass); the next delta is then refused once, and this one's bytes
        fingerprinted for the one after."""
        digests = {s.source_id: checksums_digest(s.checksums) for s in info.sources}
        if all(digests.values()):
            sums = self._fingerprint(arena, nbytes) if self.check_arena and proof else None
            self.held = Held(info.version, key, digests, sums if self.check_arena else [])

    def refusal(self, info: VersionInfo, key: object, plan_requests: Requests, arena: "torch.Tensor | None") -> str:
        """Why ``info`` cannot be applied as a delta onto what the arena holds ("" if it can),
        but for the arena's fingerprint (:meth:`arena_changed`, a pass over the arena)."""
        held = self.held
        if held is None or arena is None:
            return "no verified version held"
        if held.key != key:
            return "the layout changed"
        sources = {s.source_id: s for s in info.sources}
        for source_id in plan_requests:
            delta = sources[source_id].delta
            if delta is None:
                return f"source {source_id!r} published v{info.version} whole"
            if delta.base_version != held.version:
                return f"source {source_id!r}'s delta is against v{delta.base_version}, the arena holds v{held.version}"
            if delta.base_digest != held.digests.get(source_id):
                return f"source {source_id!r}'s base checksums differ from the ones v{held.version} was verified with"
        return ""

    def arena_changed(self, arena: "torch.Tensor", nbytes: int) -> str:
        """Why the arena cannot be proved to hold the base ("" if it can)."""
        assert self.held is not None
        if not self.check_arena:
            return ""
        if self.held.fingerprint is None:
            return "the arena was not fingerprinted (the last refit chose a full pull as faster)"
        if self._fingerprint(arena, nbytes) != self.held.fingerprint:
            return "the arena changed since it was verified"
        return ""


class DeltaCosts:
    """What earlier refits of this receiver measured, to pull a delta only where it wins
    (``delta: auto``). Warm full pulls (no memory registered, no handle opened) measure the
    transport's rate: bytes per second of pull and verify (on a colocated GPU, CUDA IPC at
    memory speed). Warm delta refits measure the seconds per record byte beyond that rate for
    their WHOLE tensors' reads: the records' wire time, their check and the apply. A version's
    delta is estimated as its WHOLE bytes at the full rate, its record bytes at that cost, plus
    one fingerprint pass when the arena is checked; its full pull as its bytes at the full rate.
    The latest measurement of each counts (the change pattern of a training run drifts slowly;
    every anchor is a full pull and refreshes the rate). Before a warm full pull was measured
    the version is pulled whole to measure one; before a delta was, the delta is tried."""

    def __init__(self) -> None:
        self.full_bps = 0.0
        self.record_s_per_byte = 0.0
        self.last_full_faster = False  # the last decision: a full pull, estimated faster

    def choose(self, full_bytes: int, pull: DeltaPull, check_s: float) -> tuple[str, tuple[float, float] | None]:
        """(why a full pull, "" for the delta; (full seconds, delta seconds) when estimated)."""
        if not self.full_bps:
            return "measuring a warm full pull first, to weigh deltas against", None
        if not self.record_s_per_byte:
            return "", None
        rate = self.full_bps
        full = full_bytes / rate
        delta = (pull.wire_bytes - pull.record_bytes) / rate + pull.record_bytes * self.record_s_per_byte + check_s
        if delta < full:
            return "", (full, delta)
        return (f"a full pull is faster on this transport: ~{full * 1e3:.2f} ms against ~{delta * 1e3:.2f} ms "
                f"for the delta ({pull.record_bytes} record bytes)"), (full, delta)

    def learn(self, seconds: float, bytes_pulled: int, pull: DeltaPull | None, warm: bool) -> None:
        """One refit's pull and verify ``seconds`` for ``bytes_pulled`` (``pull``: a delta's);
        ``warm``: it registered no memory and opened no handle (a cold one is not typical)."""
        if seconds <= 0 or bytes_pulled <= 0 or not warm:
            return
        if pull is None:
            self.full_bps = bytes_pulled / seconds
        elif pull.record_bytes and self.full_bps:
            beyond = seconds - (bytes_pulled - pull.record_bytes) / self.full_bps
            self.record_s_per_byte = max(beyond, seconds * 0.1) / pull.record_bytes  # noise never makes it free


def plan_delta(info: VersionInfo, plan_requests: Requests, plan_arena_bytes: int) -> DeltaPull:
    """The reads of a delta refit (see the module docstring)."""
    from mx_refit.checksums import widen

    sources = {s.source_id: s for s in info.sources}
    whole: Requests = {}
    record_sources: dict[str, None] = {}  # ordered set
    for source_id, reads in plan_requests.items():
        source = sources[source_id]
        assert source.delta is not None
        clipped = []
        for entry in source.delta.tensors:
            if entry.form is DeltaForm.WHOLE:
                clipped += _clip(reads, *_span(source, entry.tensor))
            elif _clip(reads, *_span(source, entry.tensor)):
                record_sources[source_id] = None
        if clipped:
            whole[source_id] = sorted(clipped)
    widening = widen(whole, sources, plan_arena_bytes)
    requests: Requests = {sid: list(ops) for sid, ops in widening.requests.items()}
    records: dict[str, tuple[int, int]] = {}
    at, room = widening.arena_bytes, widening.arena_bytes
    for source_id in record_sources:
        delta = sources[source_id].delta
        assert delta is not None
        requests.setdefault(source_id, []).append((delta.addr, at, delta.nbytes))
        records[source_id] = (at, delta.nbytes)
        at += delta.nbytes
        room += max([n for a, n in sources[source_id].regions if a <= delta.addr < a + n] or [delta.nbytes])
    return DeltaPull(widening, requests, records, at, max(at, room))


def _span(source: SourceInfo, index: int) -> tuple[int, int]:
    desc = source.tensors[index]
    return desc.addr, desc.addr + desc.nbytes


def _clip(reads: list[tuple[int, int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The parts of ``reads`` (sorted by source address, not overlapping) inside [lo, hi)."""
    starts = [r[0] for r in reads]
    out = []
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(reads) and reads[i][0] < hi:
        remote, local, n = reads[i]
        a, b = max(remote, lo), min(remote + n, hi)
        if a < b:
            out.append((a, local + a - remote, b - a))
        i += 1
    return out


def check_records(arena: "torch.Tensor", info: VersionInfo, pull: DeltaPull) -> None:
    """Every pulled record region against its published sums (ChecksumMismatch otherwise)."""
    from mx_refit.checksums import span_sums

    sources = {s.source_id: s for s in info.sources}
    for source_id, (offset, nbytes) in pull.records.items():
        source = sources[source_id]
        assert source.delta is not None and source.checksums is not None
        got = span_sums(arena[offset : offset + nbytes], source.checksums.block_bytes).tolist()
        if tuple(got) != tuple(source.delta.record_sums):
            bad = next(i for i, (g, w) in enumerate(zip(got, source.delta.record_sums)) if g != w)
            raise ChecksumMismatch(
                f"delta records of source {source_id!r} v{info.version}: block {bad} does not match its checksum",
                source_id=source_id, tensor="<delta records>", block=bad,
            )


def apply(arena: "torch.Tensor", info: VersionInfo, plan_requests: Requests, pull: DeltaPull) -> None:
    """Write every needed record through the plan's reads, all of a source's records at once
    (:func:`mx_refit.delta.batch.apply_batch`); fills ``pull.touched`` and ``pull.bytes_changed``."""
    from mx_refit.delta.batch import Item, apply_batch, direct_address
    from mx_refit.types import DTYPE_SIZES

    sources = {s.source_id: s for s in info.sources}
    for source_id, reads in plan_requests.items():
        source = sources[source_id]
        assert source.delta is not None
        items = []
        for entry in source.delta.tensors:
            lo, hi = _span(source, entry.tensor)
            mine = _clip(reads, lo, hi)
            if not mine:
                continue
            pull.touched += [(local, n) for _, local, n in mine]
            if entry.form is DeltaForm.WHOLE:
                pull.bytes_changed += sum(n for _, _, n in mine)
                continue
            desc = source.tensors[entry.tensor]
            items.append(Item(entry.form, entry.offset, entry.nbytes, lo, desc.nbytes, DTYPE_SIZES[desc.dtype],
                              entry.changed, entry.narrow, direct_address(lo, desc.nbytes, mine)))
        if items:
            at, nbytes = pull.records[source_id]
            pull.bytes_changed += apply_batch(arena, arena[at : at + nbytes], items, reads)


def _merged(ranges: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Sorted, merged ``(offset, nbytes)`` ranges as parallel lists of starts and ends."""
    starts: list[int] = []
    ends: list[int] = []
    for s, n in sorted(ranges):
        if starts and s <= ends[-1]:
            ends[-1] = max(ends[-1], s + n)
        else:
            starts.append(s)
            ends.append(s + n)
    return starts, ends


def changed_only(tensors: list, arena: "torch.Tensor", touched: list[tuple[int, int]], plan_requests: Requests) -> list:
    """The materialised ``(name, tensor)`` pairs that may hold a changed byte. Skipped are only
    views of the arena lying wholly in bytes the plan reads in place (not in staged copies that
    ``materialize`` makes) none of which the delta touched."""
    if not touched:
        return []
    t_starts, t_ends = _merged(touched)
    r_starts, r_ends = _merged([(local, n) for reads in plan_requests.values() for _, local, n in reads])
    base, size = arena.data_ptr(), arena.numel()
    keep = []
    for name, t in tensors:
        offset = t.data_ptr() - base
        last = sum((d - 1) * st for d, st in zip(t.shape, t.stride())) if t.numel() else 0
        end = offset + (last + 1) * t.element_size()  # the view's hull in the arena
        r = bisect.bisect_right(r_starts, offset) - 1
        in_place = 0 <= offset < size and r >= 0 and end <= r_ends[r]
        i = bisect.bisect_left(t_starts, end) - 1
        if not in_place or (i >= 0 and t_ends[i] > offset):
            keep.append((name, t))
    return keep
