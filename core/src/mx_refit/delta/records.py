"""Delta records with torch, on the tensors' own devices: encode (the trainer, previous bytes
against new), decode to (byte position, byte) pairs, and apply through a receiver's reads.

The layouts are described in :mod:`mx_refit.delta`. Every step is a handful of vectorised ops;
the host learns only the sizes (one synchronisation per changed tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mx_refit.delta import BLOCK, CHUNK, DENSE_FRACTION, blocks_size, sparse_size
from mx_refit.errors import InvalidArgument
from mx_refit.types import DeltaForm

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Record", "apply_changes", "decode", "encode"]


@dataclass
class Record:
    """One tensor's change: its form, counts and record bytes (uint8, on the tensor's device;
    empty for WHOLE)."""

    form: DeltaForm
    changed: int
    narrow: int
    data: "torch.Tensor"


def _element_bytes(t: "torch.Tensor") -> "torch.Tensor":
    import torch

    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8).view(flat.numel(), flat.element_size())


def _sparse_list(mask: "torch.Tensor", values: "torch.Tensor", chunks: int) -> "list[torch.Tensor]":
    import torch

    index = mask.nonzero().squeeze(1)
    counts = torch.bincount(torch.div(index, CHUNK, rounding_mode="floor"), minlength=chunks)
    return [counts.to(torch.uint8), (index % CHUNK).to(torch.uint8), values[index].reshape(-1)]


def _changed_blocks(changed_el: "torch.Tensor", itemsize: int) -> "torch.Tensor":
    """Per 256-byte block: whether any element in it changed (an element never straddles a
    block: sizes are powers of two up to 8)."""
    import torch

    per_block = BLOCK // itemsize
    blocks = -(-changed_el.numel() // per_block)
    if changed_el.numel() % per_block == 0:
        return changed_el.view(blocks, per_block).any(1)
    padded = torch.zeros(blocks * per_block, dtype=torch.bool, device=changed_el.device)
    padded[: changed_el.numel()] = changed_el
    return padded.view(blocks, per_block).any(1)


def _words(t: "torch.Tensor") -> "torch.Tensor":
    """The tensor's elements as signed integers of their own width (flat)."""
    import torch

    flat = t.detach().reshape(-1)
    return flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])


def _blocks_record(new_bytes: "torch.Tensor", flags: "torch.Tensor") -> "torch.Tensor":
    import torch

    nbytes = new_bytes.numel()
    bits = torch.zeros(-(-flags.numel() // 8) * 8, dtype=torch.uint8, device=flags.device)
    bits[: flags.numel()] = flags.to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=flags.device)
    bitmap = (bits.view(-1, 8) * weights).sum(1, dtype=torch.uint8)
    padded = torch.zeros(flags.numel() * BLOCK, dtype=torch.uint8, device=flags.device)
    padded[:nbytes] = new_bytes
    blocks = padded.view(-1, BLOCK)[flags].reshape(-1)
    tail = flags.numel() * BLOCK - nbytes  # the last block's padding, when it changed
    if tail and bool(flags[-1]):
        blocks = blocks[: blocks.numel() - tail]
    return torch.cat([bitmap, blocks])


def encode(old: "torch.Tensor", new: "torch.Tensor") -> Record | None:
    """The change from ``old`` to ``new`` (same shape, dtype and device), or None when their
    bytes are equal. The smallest form wins; WHOLE when a record would cost at least
    :data:`~mx_refit.delta.DENSE_FRACTION` of the tensor."""
    import torch

    if old.shape != new.shape or old.dtype != new.dtype or old.device != new.device:
        raise InvalidArgument(f"delta: old {tuple(old.shape)} {old.dtype} and new {tuple(new.shape)} {new.dtype} differ")
    b = _element_bytes(new)
    numel, itemsize = b.shape
    x = _words(old) ^ _words(new)  # whole elements at a time: a pass per step, not per byte
    changed_el = x != 0
    # narrow: only the first (low, little-endian) byte differs
    narrow_el = changed_el & (x & -256 == 0) if itemsize > 1 else changed_el
    del x
    flags = _changed_blocks(changed_el, itemsize)
    sizes = torch.stack([torch.count_nonzero(m) for m in (changed_el, narrow_el, flags)]).tolist()  # one sync
    changed, narrow, blocks = (int(v) for v in sizes)
    if changed == 0:
        return None
    nbytes = numel * itemsize
    empty = torch.empty(0, dtype=torch.uint8, device=new.device)
    changed_block_bytes = blocks * BLOCK - (BLOCK * flags.numel() - nbytes if bool(flags[-1]) else 0)
    sparse = sparse_size(numel, itemsize, changed, narrow)
    blocked = blocks_size(nbytes, changed_block_bytes)
    if min(sparse, blocked) >= DENSE_FRACTION * nbytes:
        return Record(DeltaForm.WHOLE, numel, 0, empty)
    if blocked < sparse:
        return Record(DeltaForm.BLOCKS, changed, 0, _blocks_record(b.reshape(-1), flags))
    chunks = -(-numel // CHUNK)
    parts: list[torch.Tensor] = []
    if narrow:
        parts += _sparse_list(narrow_el, b[:, 0], chunks)
    if changed - narrow:
        parts += _sparse_list(changed_el & ~narrow_el, b, chunks)
    data = torch.cat(parts)
    assert data.numel() == sparse, (data.numel(), sparse)
    return Record(DeltaForm.SPARSE, changed, narrow, data)


def _decode_list(data: "torch.Tensor", chunks: int, count: int, width: int) -> "tuple[torch.Tensor, torch.Tensor, int]":
    """(element indices, their bytes [count, width], bytes consumed) of one SPARSE list."""
    import torch

    counts = data[:chunks].long()
    offsets = data[chunks : chunks + count].long()
    values = data[chunks + count : chunks + count + count * width].view(count, width)
    ends = counts.cumsum(0)
    if int(ends[-1]) != count:
        raise InvalidArgument(f"delta record: chunk counts sum to {int(ends[-1])}, expected {count}")
    # the chunk of entry j: the first chunk whose running count exceeds j (faster than
    # repeat_interleave on CPU)
    chunk_of = torch.searchsorted(ends, torch.arange(count, device=data.device), right=True)
    return chunk_of * CHUNK + offsets, values, chunks + count * (1 + width)


def decode(
    form: DeltaForm, data: "torch.Tensor", nbytes: int, itemsize: int, changed: int, narrow: int
) -> "tuple[torch.Tensor, torch.Tensor]":
    """A tensor's record -> (byte positions in the tensor (int64), new bytes (uint8)), on the
    record's device. WHOLE has no record: the caller reads the tensor."""
    import torch

    if form is DeltaForm.BLOCKS:
        count = -(-nbytes // BLOCK)
        bitmap = data[: -(-count // 8)]
        bits = (bitmap.long().unsqueeze(1) >> torch.arange(8, device=data.device)) & 1
        index = bits.reshape(-1)[:count].nonzero().squeeze(1)
        spread = (index.unsqueeze(1) * BLOCK + torch.arange(BLOCK, device=data.device)).reshape(-1)
        spread = spread[spread < nbytes]
        block_bytes = data[bitmap.numel() :]
        if block_bytes.numel() != spread.numel():
            raise InvalidArgument(f"delta record: {block_bytes.numel()} block bytes for {spread.numel()} positions")
        return spread, block_bytes
    if form is not DeltaForm.SPARSE:
        raise InvalidArgument(f"delta: a {form!r} tensor has no record to decode")
    chunks = -(-(nbytes // itemsize) // CHUNK)
    positions: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    at = 0
    if narrow:
        index, bytes_, used = _decode_list(data, chunks, narrow, 1)
        positions.append(index * itemsize)
        values.append(bytes_.reshape(-1))
        at += used
    if changed - narrow:
        index, bytes_, used = _decode_list(data[at:], chunks, changed - narrow, itemsize)
        positions.append((index.unsqueeze(1) * itemsize + torch.arange(itemsize, device=data.device)).reshape(-1))
        values.append(bytes_.reshape(-1))
    return torch.cat(positions), torch.cat(values)


def apply_changes(
    arena: "torch.Tensor", positions: "torch.Tensor", values: "torch.Tensor", reads: "list[tuple[int, int, int]]"
) -> int:
    """Writes ``values`` at ``positions`` (byte addresses in the source) into ``arena``
    wherever the receiver's ``reads`` ``(source address, arena offset, nbytes)`` put those
    source bytes: the same mapping a full pull uses, so a receiver's TP slice, row window or
    staged copy gets exactly its share. Bytes no read covers are not the receiver's and are
    dropped. Returns the bytes written."""
    import torch

    if not reads or positions.numel() == 0:
        return 0
    device = arena.device
    positions, values = positions.to(device), values.to(device)
    if len(reads) == 1 and reads[0][0] <= int(positions.min()) and int(positions.max()) < reads[0][0] + reads[0][2]:
        remote, local, _ = reads[0]  # the common case: the receiver holds the whole tensor, in one read
        arena[positions + (local - remote)] = values
        return positions.numel()
    written = 0
    for layer in _layers(sorted(reads)):  # reads within a layer do not overlap in the source
        starts = torch.tensor([r[0] for r in layer], dtype=torch.int64, device=device)
        ends = starts + torch.tensor([r[2] for r in layer], dtype=torch.int64, device=device)
        offsets = torch.tensor([r[1] for r in layer], dtype=torch.int64, device=device)
        slot = torch.searchsorted(starts, positions, right=True) - 1
        inside = slot >= 0
        slot = slot.clamp(min=0)
        inside &= positions < ends[slot]
        target = offsets[slot] + positions - starts[slot]
        arena[target[inside]] = values[inside]
        written += int(inside.sum())
    return written


def _layers(reads: "list[tuple[int, int, int]]") -> "list[list[tuple[int, int, int]]]":
    """Sorted reads split into layers of reads that do not overlap in source space (one layer
    unless the plan reads some source bytes into two places)."""
    layers: list[list[tuple[int, int, int]]] = []
    for read in reads:
        for layer in layers:
            last = layer[-1]
            if last[0] + last[2] <= read[0]:
                layer.append(read)
                break
        else:
            layers.append([read])
    return layers
