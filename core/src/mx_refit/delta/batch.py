"""Applying every record of a delta pull at once: a handful of vectorised torch ops per dtype
class, however many tensors changed (issue 24).

:func:`mx_refit.delta.records.decode` and :func:`~mx_refit.delta.records.apply_changes` are
the per-record reference; :func:`apply_batch` writes exactly the same bytes (the tests compare
them on every form, width and resharded read), but gathers the host's per-record numbers into
a few small tables first and then touches each changed element a fixed number of times:

- SPARSE lists are grouped by (bytes per entry, element size): the narrow lists of BF16
  tensors, their wide lists, the narrow lists of FP32 tensors, ... For each group the chunk
  counts of every list are read at once, each chunk's destination (the arena address of its
  first element when one read of the plan holds the whole tensor, else its source address) is
  spread over the chunk's entries by one ``repeat_interleave``, the entries' offsets are added,
  and the new bytes land with one ``index_put_``.
- BLOCKS records: every bitmap is unpacked at once, every changed block spread to its 256
  byte addresses at once, one ``index_put_``.
- Tensors that the plan reads in pieces (a TP slice, a row window) go through the plan's reads
  as in :func:`~mx_refit.delta.records.apply_changes`, all of a source's at once.

Malformed counts (a list whose chunk counts do not sum to its entries, a BLOCKS record whose
bitmap does not match its bytes) raise :class:`~mx_refit.errors.InvalidArgument`; records are
checksum-verified before this runs, so that means a publisher bug, not a bit flip.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mx_refit.delta import BLOCK, CHUNK
from mx_refit.errors import InvalidArgument
from mx_refit.types import DeltaForm

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Item", "apply_batch"]

Read = tuple[int, int, int]
Changes = tuple["torch.Tensor", "torch.Tensor", "torch.Tensor | None"]  # addresses, new bytes, in-arena flags


@dataclass(frozen=True)
class Item:
    """One changed tensor's record to apply: ``offset``/``nbytes`` of the record in ``data``
    (the source's records, as pulled), the tensor's source address ``lo``, size, element size
    and counts, and ``direct``: the arena address of the tensor's first byte when one read of
    the plan holds all of it (else None: its bytes go through the source's reads)."""

    form: DeltaForm
    offset: int
    nbytes: int
    lo: int
    size: int
    itemsize: int
    changed: int
    narrow: int
    direct: int | None


def direct_address(lo: int, size: int, mine: list[Read]) -> int | None:
    """The arena address of source byte ``lo`` when ``mine`` (the plan's reads clipped to
    [lo, lo + size)) is one read holding all of it, else None."""
    if len(mine) == 1 and mine[0][0] == lo and mine[0][2] == size:
        return mine[0][1]
    return None


def _spans(data: "torch.Tensor", starts: list[int], lengths: list[int]) -> "torch.Tensor":
    """``data[starts[i] : starts[i] + lengths[i]]`` for each i in turn, as one new tensor (one
    copy of the bytes, never a view of ``data``: the arena they are written into holds it)."""
    import torch

    if len(starts) == 1:
        return data[starts[0] : starts[0] + lengths[0]].clone()
    return torch.cat([data[a : a + n] for a, n in zip(starts, lengths)])


def _sparse_lists(items: list[Item]) -> dict[tuple[int, int], list[tuple[int, int, int, int, int | None]]]:
    """(width, element size) -> lists (record offset, chunks, entries, source address, direct)."""
    groups: dict[tuple[int, int], list[tuple[int, int, int, int, int | None]]] = defaultdict(list)
    for it in items:
        chunks = -(-(it.size // it.itemsize) // CHUNK)
        at = it.offset
        if it.narrow:
            groups[(1, it.itemsize)].append((at, chunks, it.narrow, it.lo, it.direct))
            at += chunks + 2 * it.narrow
        if it.changed - it.narrow:
            groups[(it.itemsize, it.itemsize)].append((at, chunks, it.changed - it.narrow, it.lo, it.direct))
    return groups


def _sparse_group(data: "torch.Tensor", width: int, itemsize: int, lists: list) -> "Changes":
    """(byte addresses, new bytes, whether each address is already in the arena) of one group."""
    import torch

    device = data.device
    at, chunks, counts, lo, direct = zip(*lists)
    n = sum(counts)
    per_chunk = _spans(data, list(at), list(chunks)).long()
    ends = per_chunk.cumsum(0)
    list_ends = torch.tensor(chunks, dtype=torch.int64, device=device).cumsum(0) - 1
    want = torch.tensor(counts, dtype=torch.int64, device=device).cumsum(0)
    if not torch.equal(ends[list_ends], want):
        raise InvalidArgument(f"delta records: the chunk counts of a width-{width} list do not sum to its entries")
    # each chunk's first element's address: the arena's where one read holds the tensor
    bases = torch.tensor([d if d is not None else s for d, s in zip(direct, lo)], dtype=torch.int64, device=device)
    sizes = torch.tensor(chunks, dtype=torch.int64, device=device)
    chunk_of_list = torch.repeat_interleave(torch.arange(len(lists), device=device), sizes, output_size=sum(chunks))
    local = torch.arange(chunk_of_list.numel(), device=device) - (sizes.cumsum(0) - sizes)[chunk_of_list]
    chunk_base = bases[chunk_of_list].add_(local, alpha=CHUNK * itemsize)
    address = torch.repeat_interleave(chunk_base, per_chunk, output_size=n)
    offsets = _spans(data, [a + c for a, c in zip(at, chunks)], list(counts))
    address.add_(offsets.long(), alpha=itemsize)
    values = _spans(data, [a + c + k for a, c, k in zip(at, chunks, counts)], [k * width for k in counts])
    in_arena = _flags([d is not None for d in direct], list(counts), device)
    if width > 1:
        address = (address.unsqueeze(1) + torch.arange(width, device=device)).reshape(-1)
        in_arena = None if in_arena is None else in_arena.repeat_interleave(width)
    return address, values, in_arena


def _flags(direct: list[bool], lengths: list[int], device: "torch.device") -> "torch.Tensor | None":
    """Per entry whether its address is the arena's; None when all are."""
    import torch

    if all(direct):
        return None
    return torch.repeat_interleave(torch.tensor(direct), torch.tensor(lengths)).to(device)


def _blocks(data: "torch.Tensor", items: list[Item]) -> "Changes":
    """(byte addresses, new bytes, in-arena flags) of every BLOCKS record."""
    import torch

    device = data.device
    nblocks = [-(-it.size // BLOCK) for it in items]
    maps = [-(-b // 8) for b in nblocks]
    bitmap = _spans(data, [it.offset for it in items], maps).long()
    bits = ((bitmap.unsqueeze(1) >> torch.arange(8, device=device)) & 1).reshape(-1).bool()
    owner = torch.repeat_interleave(torch.arange(len(items)), torch.tensor(maps) * 8).to(device)
    first_bit = (torch.tensor(maps, dtype=torch.int64).cumsum(0) - torch.tensor(maps)).to(device) * 8
    block = torch.arange(bits.numel(), device=device) - first_bit[owner]
    bits &= block < torch.tensor(nblocks, device=device)[owner]
    chosen = bits.nonzero().squeeze(1)
    owner, block = owner[chosen], block[chosen]
    bases = torch.tensor([it.direct if it.direct is not None else it.lo for it in items], dtype=torch.int64, device=device)
    sizes = torch.tensor([it.size for it in items], dtype=torch.int64, device=device)
    within = (block * BLOCK).unsqueeze(1) + torch.arange(BLOCK, device=device)
    keep = within < sizes[owner].unsqueeze(1)  # the last block of a tensor may be partial
    address = (within + bases[owner].unsqueeze(1))[keep]
    lengths = [it.nbytes - m for it, m in zip(items, maps)]
    got = torch.bincount(owner, weights=keep.sum(1).double(), minlength=len(items)).long()
    if not torch.equal(got.cpu(), torch.tensor(lengths)):
        raise InvalidArgument("delta records: a BLOCKS record's bitmap does not match its block bytes")
    values = _spans(data, [it.offset + m for it, m in zip(items, maps)], lengths)
    in_arena = None
    if any(it.direct is None for it in items):
        in_arena = torch.tensor([it.direct is not None for it in items], device=device)[owner]
        in_arena = in_arena.unsqueeze(1).expand_as(keep)[keep]
    return address, values, in_arena


def _through_reads(positions: "torch.Tensor", reads: list[Read]) -> "tuple[torch.Tensor, torch.Tensor]":
    """(arena addresses, index into ``positions``) of source byte addresses through ``reads``:
    every place the plan puts each byte (bytes no read holds are dropped)."""
    import torch

    from mx_refit.delta.records import _layers

    device = positions.device
    targets, which = [], []
    for layer in _layers(sorted(reads)):
        starts = torch.tensor([r[0] for r in layer], dtype=torch.int64, device=device)
        ends = starts + torch.tensor([r[2] for r in layer], dtype=torch.int64, device=device)
        offsets = torch.tensor([r[1] for r in layer], dtype=torch.int64, device=device)
        slot = (torch.searchsorted(starts, positions, right=True) - 1).clamp_(min=0)
        inside = (positions >= starts[slot]) & (positions < ends[slot])
        index = inside.nonzero().squeeze(1)
        targets.append(offsets[slot[index]] + positions[index] - starts[slot[index]])
        which.append(index)
    return torch.cat(targets), torch.cat(which)


def apply_batch(arena: "torch.Tensor", data: "torch.Tensor", items: list[Item], reads: list[Read]) -> int:
    """Writes every record of ``items`` (one source's, in ``data``) into ``arena``: directly at
    the arena address of items whose tensor one read holds whole, through the source's plan
    ``reads`` otherwise. Returns the bytes written."""
    parts = []
    sparse = [it for it in items if it.form is DeltaForm.SPARSE]
    for (width, itemsize), lists in sorted(_sparse_lists(sparse).items()):
        parts.append(_sparse_group(data, width, itemsize, lists))
    blocks = [it for it in items if it.form is DeltaForm.BLOCKS]
    if blocks:
        parts.append(_blocks(data, blocks))
    written = 0
    for address, values, in_arena in parts:
        if in_arena is not None:  # some tensors are held in pieces: their bytes go through the reads
            outside = (~in_arena).nonzero().squeeze(1)
            mapped, which = _through_reads(address[outside], reads)
            arena.index_put_((mapped,), values[outside[which]])
            written += mapped.numel()
            inside = in_arena.nonzero().squeeze(1)
            address, values = address[inside], values[inside]
        arena.index_put_((address,), values)
        written += address.numel()
    return written
