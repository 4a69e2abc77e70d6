"""Tree fan-out: which sources hold which bytes, and where a reader reads them from. Pure.

A receiver's plan reads byte ranges of the trainer sources (``(source address, arena offset,
nbytes)`` per trainer source). A replica source publishes :class:`~mx_refit.types.Mirror` s:
exact copies of trainer-source bytes in its own arena. Any reader (any target layout) can
therefore read a range from a replica instead of the trainer source, whenever the range lies
inside mirrored bytes: :func:`translate` rewrites its addresses, :func:`holders` lists every
source that holds a set of ranges, :func:`choose_sources` picks one holder per trainer source
under a per-source reader cap, and :func:`replica_mirrors` is what a receiver publishes after a
complete pull. Imports only :mod:`mx_refit.types`.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from mx_refit.types import Mirror, SourceInfo, VersionInfo

__all__ = [
    "Choice",
    "Copies",
    "choose_sources",
    "holders",
    "replica_mirrors",
    "replica_tensor_ranges",
    "translate",
]

# (address in the source's memory, offset in the reader's arena, nbytes)
Range = tuple[int, int, int]


class _Spans:
    """One replica's mirrors of one trainer source, searchable by source address."""

    def __init__(self, mirrors: Iterable[Mirror], source_id: str) -> None:
        self.spans = sorted((m.source_addr, m.nbytes, m.addr) for m in mirrors if m.source_id == source_id)
        self.starts = [s[0] for s in self.spans]

    def move(self, addr: int, offset: int, nbytes: int, out: list[Range]) -> bool:
        """Append the replica-side reads of ``nbytes`` at ``addr``; False if any is unmirrored."""
        while nbytes > 0:
            i = bisect.bisect_right(self.starts, addr) - 1
            if i < 0:
                return False
            start, length, at = self.spans[i]
            if addr >= start + length:
                return False
            take = min(nbytes, start + length - addr)
            out.append((at + addr - start, offset, take))
            addr, offset, nbytes = addr + take, offset + take, nbytes - take
        return True


class Copies:
    """Where else the same bytes live: a replicated tensor (``shard_axis == -1``, the same name,
    dtype and size) is byte-identical on every trainer source that publishes it, so a mirror of
    one rank's copy serves a read of another rank's copy."""

    def __init__(self, info: VersionInfo) -> None:
        by_name: dict[tuple[str, str, int], list[tuple[str, int]]] = {}
        self._descs: dict[str, tuple[list[int], list[tuple[int, int, tuple[str, str, int]]]]] = {}
        for source in info.sources:
            rows = sorted(
                (d.addr, d.nbytes, (d.name, d.dtype, d.nbytes)) for d in source.tensors if d.shard_axis == -1
            )
            self._descs[source.source_id] = ([r[0] for r in rows], rows)
            for addr, _, key in rows:
                by_name.setdefault(key, []).append((source.source_id, addr))
        self._by_name = by_name

    def pieces(self, source_id: str, addr: int, nbytes: int) -> list[tuple[int, int, list[tuple[str, int]]]]:
        """``(addr, nbytes, [(other source, its addr)...])`` pieces of the range, cut at the
        replicated tensors' edges (a piece outside them has no other copy)."""
        starts, rows = self._descs.get(source_id, ([], []))
        out = []
        end = addr + nbytes
        while addr < end:
            i = bisect.bisect_right(starts, addr) - 1
            if i >= 0 and addr < rows[i][0] + rows[i][1]:
                d_addr, d_n, key = rows[i]
                take = min(end, d_addr + d_n) - addr
                others = [(sid, a + addr - d_addr) for sid, a in self._by_name[key] if sid != source_id]
                out.append((addr, take, others))
            else:
                nxt = starts[i + 1] if i + 1 < len(starts) else end
                take = min(end, nxt) - addr
                out.append((addr, take, []))
            addr += take
        return out


def translate(
    ops: Sequence[Range], mirrors: Iterable[Mirror], source_id: str, copies: Copies | None = None
) -> list[Range] | None:
    """``ops`` against trainer source ``source_id``, rewritten to read the same bytes from the
    replica whose ``mirrors`` are given (a range spanning several mirrors is split); with
    ``copies``, bytes of a replicated tensor may come from the replica's mirror of another
    rank's copy. None when any byte is not held."""
    mirrors = tuple(mirrors)
    own = _Spans(mirrors, source_id)
    others: dict[str, _Spans] = {}
    out: list[Range] = []
    for addr, offset, nbytes in ops:
        mark = len(out)
        if own.move(addr, offset, nbytes, out):
            continue
        del out[mark:]
        if copies is None:
            return None
        at = offset
        for piece, take, alternatives in copies.pieces(source_id, addr, nbytes):
            mark = len(out)
            if own.move(piece, at, take, out):
                at += take
                continue
            del out[mark:]
            for other, other_addr in alternatives:
                if other not in others:
                    others[other] = _Spans(mirrors, other)
                if others[other].move(other_addr, at, take, out):
                    break
                del out[mark:]
            else:
                return None
            at += take
    return out


def holders(
    info: VersionInfo,
    source_id: str,
    ops: Sequence[Range],
    exclude: Iterable[str] = (),
    copies: Copies | None = None,
) -> list[tuple[SourceInfo, list[Range]]]:
    """Every source of ``info`` that holds all bytes of ``ops`` (ranges of trainer source
    ``source_id``), with the ranges as that holder reads them: the trainer source itself first
    (unless excluded), then each ready replica that mirrors them (replicated tensors from any
    rank's copy). ``exclude``: source ids known dead or busy. This is what failover re-plans a
    dead source's ranges with."""
    skip = set(exclude)
    if copies is None and info.replicas:
        copies = Copies(info)
    found: list[tuple[SourceInfo, list[Range]]] = []
    for source in info.sources:
        if source.source_id == source_id and source_id not in skip:
            found.append((source, list(ops)))
    for replica in info.replicas:
        if replica.source_id in skip or not replica.ready:
            continue
        moved = translate(ops, replica.mirrors, source_id, copies)
        if moved is not None:
            found.append((replica, moved))
    return found


@dataclass(frozen=True)
class Choice:
    """Where one reader reads each trainer source's ranges from."""

    sources: dict[str, SourceInfo]  # holder id -> the holder (trainer source or replica)
    requests: dict[str, list[Range]]  # holder id -> ranges in the holder's memory
    via: dict[str, str]  # trainer source id -> holder id

    @property
    def replicas_used(self) -> int:
        return sum(1 for trainer, holder in self.via.items() if trainer != holder)


def choose_sources(
    info: VersionInfo,
    requests: Mapping[str, Sequence[Range]],
    *,
    reader_id: str,
    max_readers: int = 0,
    exclude: Iterable[str] = (),
) -> Choice | None:
    """One holder per trainer source of ``requests``: the least read one (``info.readers``),
    ties spread by a hash of the reader and holder ids so that readers joining together pick
    different holders. ``max_readers`` > 0 leaves out holders that already serve that many
    readers; None when some trainer source then has no holder (wait for a replica)."""
    load = dict(info.readers)
    chosen: dict[str, str] = {}
    sources: dict[str, SourceInfo] = {}
    out: dict[str, list[Range]] = {}
    skip = set(exclude)
    copies = Copies(info) if info.replicas else None
    for trainer_id in sorted(requests):
        ops = requests[trainer_id]
        options = [
            (source, moved)
            for source, moved in holders(info, trainer_id, ops, skip, copies)
            # a holder this reader already chose counts once: it is still one reader
            if source.source_id in sources or not max_readers or load.get(source.source_id, 0) < max_readers
        ]
        if not options:
            return None
        source, moved = min(
            options,
            key=lambda o: (
                o[0].source_id not in sources,  # reuse a holder already chosen: fewer peers
                load.get(o[0].source_id, 0),
                _spread(reader_id, o[0].source_id),
            ),
        )
        sid = source.source_id
        if sid not in sources:
            load[sid] = load.get(sid, 0) + 1
            sources[sid] = source
        out.setdefault(sid, []).extend(moved)
        chosen[trainer_id] = sid
    return Choice(sources=sources, requests=out, via=chosen)


def _spread(reader_id: str, source_id: str) -> bytes:
    return hashlib.blake2b(f"{reader_id}\0{source_id}".encode(), digest_size=8).digest()


def replica_mirrors(requests: Mapping[str, Sequence[Range]], arena_addr: int) -> tuple[Mirror, ...]:
    """The mirrors a receiver holds after pulling ``requests`` (per trainer source, in that
    source's addresses) into an arena at ``arena_addr``; adjacent ranges merge."""
    mirrors: list[Mirror] = []
    for source_id in sorted(requests):
        last: Mirror | None = None
        for addr, offset, nbytes in sorted(requests[source_id]):
            at = arena_addr + offset
            if last is not None and last.source_addr + last.nbytes == addr and last.addr + last.nbytes == at:
                last = Mirror(source_id, last.source_addr, last.nbytes + nbytes, last.addr)
                mirrors[-1] = last
                continue
            last = Mirror(source_id, addr, nbytes, at)
            mirrors.append(last)
    return tuple(mirrors)


def replica_tensor_ranges(
    info: VersionInfo, replica: SourceInfo
) -> dict[str, dict[str, list[tuple[int, int]]]]:
    """Which bytes of which published tensors ``replica`` holds: trainer source id -> tensor
    name -> sorted, merged ``[(start, end)]`` byte offsets inside that source's shard of the tensor
    (names as the trainer published them; the sidecar's ``hf_name_map`` maps them to HF)."""
    by_id = {s.source_id: s for s in info.sources}
    held: dict[str, dict[str, list[tuple[int, int]]]] = {}
    for mirror in replica.mirrors:
        source = by_id.get(mirror.source_id)
        if source is None:
            continue
        lo, hi = mirror.source_addr, mirror.source_addr + mirror.nbytes
        for desc in source.tensors:
            start, end = max(lo, desc.addr), min(hi, desc.addr + desc.nbytes)
            if start < end:
                ranges = held.setdefault(source.source_id, {}).setdefault(desc.name, [])
                ranges.append((start - desc.addr, end - desc.addr))
    for names in held.values():
        for name, ranges in names.items():
            merged: list[tuple[int, int]] = []
            for start, end in sorted(ranges):  # touching or overlapping ranges merge
                if merged and start <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
                else:
                    merged.append((start, end))
            names[name] = merged
    return held
