"""Failover mid-pull: a source that fails during a pull has its ranges read from other holders.

A pull reads one batch per source (one NIXL request, or one set of device copies). A batch is
confirmed when its request reached DONE; nothing else counts. When a read fails, the transport's
:class:`~mx_refit.errors.TransferError` says which sources failed and which batches were
confirmed before it did. Then:

* confirmed batches are kept, every other batch is read again (nothing unconfirmed is trusted);
* each range a failed source owed is mapped back to the tensor it lies in and re-planned on a
  live source holding the same bytes (:class:`HolderIndex`); the failed source is forgotten
  (its connection closed) and never asked again in this pull;
* if some range has no live holder, the pull ends with a ``TransferError`` naming the failed
  sources and those ranges (``missing``), compactly; the receiver releases its lease and loads
  nothing, so the engine keeps its previous weights.

Everything happens under the refit's one lease, so bytes read from another holder are of the
same version. Pure Python (no torch, nixl or grpc): the transport is whatever the receiver uses.
"""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mx_refit.errors import TransferError
from mx_refit.ranges import coalesce, split_at
from mx_refit.types import ReadOp, SourceInfo, TensorDescriptor, VersionInfo

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.ranges import Range
    from mx_refit.transport.base import ReadReport

__all__ = [
    "FailoverPull", "HolderIndex", "describe_ranges", "in_source_space", "merged_pulls", "pull_with_failover", "reroute",
]

log = logging.getLogger(__name__)

# At most this many tensors are listed in an abort message; the rest are counted.
_LISTED = 8


def _same_bytes_key(d: TensorDescriptor) -> tuple[Any, ...]:
    """Descriptors with equal keys hold the same bytes of one version: the same tensor, dtype
    and shard (a TP-replicated tensor on another rank, or a replica mirroring a rank)."""
    return (d.name, d.dtype, tuple(d.global_shape), tuple(d.local_shape), d.role, d.shard_axis,
            d.shard_offset, d.nbytes)


class HolderIndex:
    """Where a version's bytes live: which descriptor a source's byte range belongs to, and
    which other sources hold the same bytes.

    This is the seam for replica sources: a replica that publishes the descriptors of the ranks
    it mirrors (same name, dtype, shape and shard) is a holder of their bytes with no further
    work here.
    """

    def __init__(self, info: VersionInfo) -> None:
        self._starts: dict[str, list[int]] = {}
        self._descs: dict[str, list[TensorDescriptor]] = {}
        self._holders: dict[tuple[Any, ...], list[tuple[str, TensorDescriptor]]] = defaultdict(list)
        for source in info.sources:
            descs = sorted(source.tensors, key=lambda d: d.addr)
            self._descs[source.source_id] = descs
            self._starts[source.source_id] = [d.addr for d in descs]
            for d in descs:
                self._holders[_same_bytes_key(d)].append((source.source_id, d))

    def pieces(self, source_id: str, remote_addr: int, nbytes: int) -> list[tuple[TensorDescriptor | None, int, int]]:
        """``[remote_addr, remote_addr + nbytes)`` of ``source_id`` cut at its tensors' edges:
        ``(descriptor or None for bytes outside every tensor, address, length)``."""
        starts, descs = self._starts.get(source_id, []), self._descs.get(source_id, [])
        out: list[tuple[TensorDescriptor | None, int, int]] = []
        addr, end = remote_addr, remote_addr + nbytes
        while addr < end:
            i = bisect.bisect_right(starts, addr) - 1
            d = descs[i] if i >= 0 and addr < descs[i].addr + descs[i].nbytes else None
            if d is not None:
                stop = min(end, d.addr + d.nbytes)
            else:
                nxt = bisect.bisect_right(starts, addr)
                stop = min(end, starts[nxt]) if nxt < len(starts) else end
            out.append((d, addr, stop - addr))
            addr = stop
        return out

    def holders(self, desc: TensorDescriptor, exclude: Iterable[str]) -> list[tuple[str, TensorDescriptor]]:
        """Live sources (not in ``exclude``) holding the same bytes as ``desc``."""
        excluded = set(exclude)
        return [(sid, d) for sid, d in self._holders.get(_same_bytes_key(desc), ()) if sid not in excluded]


def in_source_space(holder: SourceInfo, op: ReadOp, trainers: Iterable[str]) -> tuple[list[ReadOp], list[ReadOp]]:
    """A read ``op`` from ``holder``, as reads of the trainer sources whose bytes they are: the
    same read for a trainer source, through its mirrors for a replica. Returns those and the
    parts no mirror covers (in the replica's addresses)."""
    if holder.source_id in trainers or not holder.mirrors:
        return [op], []
    spans = sorted(holder.mirrors, key=lambda m: m.addr)
    starts = [m.addr for m in spans]
    mapped: list[ReadOp] = []
    unmapped: list[ReadOp] = []
    addr, local, left = op.remote_addr, op.local_offset, op.nbytes
    while left > 0:
        i = bisect.bisect_right(starts, addr) - 1
        m = spans[i] if i >= 0 and addr < spans[i].addr + spans[i].nbytes else None
        if m is None:
            nxt = bisect.bisect_right(starts, addr)
            take = min(left, starts[nxt] - addr) if nxt < len(starts) else left
            unmapped.append(ReadOp(holder.source_id, addr, take, local))
        else:
            take = min(left, m.addr + m.nbytes - addr)
            mapped.append(ReadOp(m.source_id, m.source_addr + (addr - m.addr), take, local))
        addr, local, left = addr + take, local + take, left - take
    return mapped, unmapped


def reroute(
    index: HolderIndex,
    info: VersionInfo,
    ops: Sequence[ReadOp],
    dead: Iterable[str],
    load: dict[str, int],
    replicas: Iterable[str] = (),
) -> tuple[list[tuple[str, ReadOp]], list[tuple[str, int, int]]]:
    """Reads ``ops`` of trainer sources (in their addresses) that a failed holder owed, given to
    live holders: the trainer source itself or a replica in ``replicas`` mirroring the bytes
    (only those the lease names: no other replica's arena is protected), else, piece by piece,
    another trainer source holding the same bytes (:class:`HolderIndex`).

    Each goes to the holder with the fewest bytes assigned so far (``load``, updated), so a
    dead rank's ranges spread over the survivors. Returns ``(holder id, read in the holder's
    addresses)`` pairs and the pieces no live source holds, as ``(tensor name, first byte, end
    byte)`` within the tensor (``<source S at ADDR>`` for bytes outside every tensor).
    """
    from mx_refit.receive.fanout import holders as mirrored_holders

    dead = set(dead)
    unnamed = {r.source_id for r in info.replicas} - set(replicas)
    given: list[tuple[str, ReadOp]] = []
    missing: list[tuple[str, int, int]] = []

    def give(options: list[tuple[str, list[tuple[int, int, int]]]]) -> None:
        holder, ranges = min(options, key=lambda o: load.get(o[0], 0))
        for remote, local, n in ranges:
            load[holder] = load.get(holder, 0) + n
            given.append((holder, ReadOp(holder, remote, n, local)))

    for op in ops:
        whole = mirrored_holders(info, op.source_id, [(op.remote_addr, op.local_offset, op.nbytes)], dead | unnamed)
        if whole:
            give([(h.source_id, ranges) for h, ranges in whole])
            continue
        local = op.local_offset
        for desc, addr, n in index.pieces(op.source_id, op.remote_addr, op.nbytes):
            others = index.holders(desc, dead) if desc is not None else []
            if not others:
                if desc is None:
                    missing.append((f"<source {op.source_id} at {addr:#x}>", 0, n))
                else:
                    missing.append((desc.name, addr - desc.addr, addr - desc.addr + n))
            else:
                assert desc is not None
                give([(sid, [(other.addr + (addr - desc.addr), local, n)]) for sid, other in others])
            local += n
    return given, missing


def describe_ranges(missing: Sequence[tuple[str, int, int]], sizes: Mapping[str, int] | None = None) -> str:
    """``t0 (all 1024 bytes), t1 bytes [0, 512)``: per tensor, its merged byte ranges; a tensor
    missing whole is said so; after 8 tensors the rest are counted."""
    by_name: dict[str, list[list[int]]] = {}
    for name, start, end in sorted(missing, key=lambda m: (m[0], m[1])):
        spans = by_name.setdefault(name, [])
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    parts = []
    for name, spans in by_name.items():
        size = (sizes or {}).get(name)
        if size is not None and spans == [[0, size]]:
            parts.append(f"{name} (all {size} bytes)")
        else:
            parts.append(f"{name} bytes " + ", ".join(f"[{a}, {b})" for a, b in spans))
    if len(parts) > _LISTED:
        rest = list(by_name)[_LISTED:]
        rest_bytes = sum(b - a for name in rest for a, b in by_name[name])
        parts = parts[:_LISTED] + [f"and {len(rest)} more tensors ({rest_bytes} bytes)"]
    return "; ".join(parts)


@dataclass(frozen=True)
class FailoverPull:
    """What a pull moved, and what failed over: ``failed_over`` are the sources that failed
    mid-pull (their ranges came from other holders); ``bytes_reread`` what was read again."""

    report: "ReadReport"
    failed_over: tuple[str, ...] = ()
    bytes_reread: int = 0


def pull_with_failover(
    transport: Any,
    info: VersionInfo,
    chosen: Mapping[str, SourceInfo],
    requests: "Mapping[str, Sequence[Range]]",
    arena: Any,
    *,
    timeout_s: float,
    abort_check: Callable[[], None] | None,
    edges: Callable[[SourceInfo], list[int]],
    label: str,
    gone: Callable[[], Collection[str]] | None = None,
) -> FailoverPull:
    """Read ``requests`` (per holder in ``chosen``, a trainer source or a replica the lease
    names: ``(holder address, arena offset, nbytes)``) into ``arena``; when a holder fails, fail
    over as the module says. ``edges`` gives a source's region edges (reads are cut
    there); ``label`` (``refit of model 'm' version 3``) starts an abort's message; ``gone``
    (the sources the catalog expired) fails a frozen holder's reads at once. Errors that
    name no source (a lost lease, bad input) propagate unchanged."""
    from mx_refit.transport.base import ReadReport

    try:  # the steady path: one read of the cached requests, nothing else computed
        return FailoverPull(transport.read(chosen, requests, arena, timeout_s=timeout_s, abort_check=abort_check, gone=gone))
    except TransferError as exc:
        error = exc
    trainers = {s.source_id for s in info.sources}
    sources = {**{s.source_id: s for s in info.sources}, **chosen}
    named = [sid for sid in chosen if sid not in trainers]  # replicas this lease protects

    index = HolderIndex(info)
    owes: dict[str, list[ReadOp]] = defaultdict(list)  # holder -> reads (in their source's addresses)
    for sid, ranges in requests.items():
        owes[sid].extend(ReadOp(sid, remote, n, local) for remote, local, n in ranges)
    dead: dict[str, str] = {}
    confirmed: dict[str, int] = defaultdict(int)
    reread = 0
    load = {sid: sum(o.nbytes for o in ops) for sid, ops in owes.items()}
    while True:
        newly_dead = [s for s in error.failed_sources if s in owes and s not in dead]
        if not newly_dead:
            raise error  # no source to blame (or one already given up on): nothing to fail over to
        for sid in error.completed_sources:
            if sid in owes and sid not in newly_dead:
                confirmed[sid] += sum(o.nbytes for o in owes.pop(sid))
        owed: list[ReadOp] = []
        missing: list[tuple[str, int, int]] = []
        for sid in newly_dead:
            dead[sid] = str(error)
            for op in owes.pop(sid):
                mapped, unmapped = in_source_space(sources[sid], op, trainers)
                owed.extend(mapped)
                missing.extend((f"<replica {sid} at {o.remote_addr:#x}>", 0, o.nbytes) for o in unmapped)
            load.pop(sid, None)
            transport.forget(sid)  # most likely dead: close what we hold of it
        given, unheld = reroute(index, info, owed, dead, load, named)
        missing.extend(unheld)
        if missing:
            raise _unheld(label, info, dead, newly_dead[0], confirmed, missing, error) from error
        log.warning(
            "%s: source %s failed mid-pull (%s); reading its %d bytes from %s", label, ", ".join(newly_dead),
            error, sum(o.nbytes for o in owed), sorted({holder for holder, _ in given}),
        )
        reread += sum(op.nbytes for _, op in given)
        for holder, op in given:
            owes[holder].append(op)
        requests = {
            sid: split_at(coalesce((o.remote_addr, o.local_offset, o.nbytes) for o in ops), edges(sources[sid]))
            for sid, ops in owes.items()
        }
        try:
            report = transport.read(sources, requests, arena, timeout_s=timeout_s, abort_check=abort_check, gone=gone)
        except TransferError as exc:
            error = exc
            continue
        for sid, n in report.nbytes.items():
            confirmed[sid] += n
        final = ReadReport(dict(confirmed), dict(report.paths), report.descriptors, report.handles_opened)
        return FailoverPull(final, tuple(dead), reread)


def _unheld(
    label: str, info: VersionInfo, dead: Mapping[str, str], first: str, confirmed: Mapping[str, int],
    missing: Sequence[tuple[str, int, int]], error: TransferError,
) -> TransferError:
    """The abort when no live source holds some range the ``dead`` sources owed (``first``:
    the one this round found dead first)."""
    names = ", ".join(repr(s) for s in dead)
    sizes = {d.name: d.nbytes for s in info.sources if s.source_id in dead for d in s.tensors}
    return TransferError(
        f"{label}: source {names} failed mid-pull and no live source holds {len(missing)} of its "
        f"range(s): {describe_ranges(missing, sizes)}; nothing was loaded (the engine keeps its "
        f"previous weights). The failure: {error}",
        source_id=first, failed_sources=tuple(dead),
        completed_sources=frozenset(confirmed), missing=tuple(_named(missing)),
    )


def _named(missing: Sequence[tuple[str, int, int]]) -> list[tuple[str, str]]:
    return [(name, f"bytes [{a}, {b})") for name, a, b in missing]


def merged_pulls(pulls: "list[FailoverPull]") -> "FailoverPull":
    """The batches' pulls as one (bytes, descriptors and handles added up; paths and failovers
    joined)."""
    from mx_refit.transport.base import ReadReport

    nbytes: dict[str, int] = {}
    paths: dict[str, str] = {}
    for p in pulls:
        for sid, n in p.report.nbytes.items():
            nbytes[sid] = nbytes.get(sid, 0) + n
        paths.update(p.report.paths)
    report = ReadReport(nbytes, paths, sum(p.report.descriptors for p in pulls),
                        sum(p.report.handles_opened for p in pulls))
    failed = tuple(dict.fromkeys(s for p in pulls for s in p.failed_over))
    return FailoverPull(report, failed, sum(p.bytes_reread for p in pulls))
