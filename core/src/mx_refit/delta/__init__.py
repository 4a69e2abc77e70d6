"""Delta refits (``weight_sync.delta``): move only the bytes that changed since the version the
receiver holds.

A trainer that publishes version ``v`` after ``b`` may attach to each source a
:class:`~mx_refit.types.SourceDelta`: for every tensor whose bytes changed, a record of the change
in the source's own (native-shard) byte coordinates. Unchanged tensors have no entry. Each
changed tensor is recorded in the smallest of three forms:

- ``SPARSE``: elements cut into chunks of :data:`CHUNK` (255) elements. For the elements whose
  only changed byte is their first (the common case of a BF16 value moving by a rounding step
  or a few: the low byte holds the mantissa), a ``narrow`` list: one uint8 count per chunk, then
  each element's uint8 offset in its chunk, then its new first byte. For the other changed
  elements a ``wide`` list laid out the same way with every byte of the element. A list with no
  element is left out.
- ``BLOCKS``: the tensor's bytes cut into blocks of :data:`BLOCK` (256) bytes; a bitmap (LSB
  first) of the blocks holding a changed byte, then each such block's bytes.
- ``WHOLE``: the change is dense (a record would cost at least :data:`DENSE_FRACTION` of the
  tensor): the reader reads the tensor itself.

This module is pure (sizes, the catalog's checks, the digest of a base's checksums); the torch
parts are :mod:`mx_refit.delta.records` (encode on the trainer's device, apply on the reader's)
and :mod:`mx_refit.delta.tracker` (what the trainer keeps between versions).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from mx_refit.errors import InvalidArgument
from mx_refit.types import DTYPE_SIZES, BlockChecksums, DeltaForm, PackedSums, SourceDelta, TensorDelta, TensorDescriptor

__all__ = [
    "BLOCK",
    "CHUNK",
    "DENSE_FRACTION",
    "blocks_size",
    "checksums_digest",
    "sparse_size",
    "validate_delta",
]

CHUNK = 255  # elements per chunk: offsets and counts both fit a uint8
BLOCK = 256  # bytes per block of the BLOCKS form
DENSE_FRACTION = 0.5  # a record at least this fraction of the tensor: read the tensor whole


def sparse_size(numel: int, itemsize: int, changed: int, narrow: int) -> int:
    """Bytes of a SPARSE record of ``changed`` elements, ``narrow`` of them first-byte only."""
    chunks = -(-numel // CHUNK)
    wide = changed - narrow
    size = chunks + 2 * narrow if narrow else 0
    return size + (chunks + wide * (1 + itemsize) if wide else 0)


def blocks_size(nbytes: int, changed_block_bytes: int) -> int:
    """Bytes of a BLOCKS record whose changed blocks hold ``changed_block_bytes`` bytes."""
    blocks = -(-nbytes // BLOCK)
    return -(-blocks // 8) + changed_block_bytes


def checksums_digest(checksums: BlockChecksums | None) -> str:
    """A digest naming one version's checksums of one source (``SourceDelta.base_digest``):
    equal exactly when the block size and every sum are."""
    if checksums is None:
        return ""
    packed = struct.pack("<Q", checksums.block_bytes) + PackedSums.of(checksums.sums).packed
    return hashlib.sha256(packed).hexdigest()


def _check_entry(entry: object, index: int, tensors: Sequence[TensorDescriptor], records: int, last: int) -> int:
    field = f"source.delta.tensors[{index}]"
    if not isinstance(entry, TensorDelta):
        raise InvalidArgument(f"{field}: expected a TensorDelta, got {type(entry).__name__}")
    values = (entry.tensor, entry.offset, entry.nbytes, entry.changed, entry.narrow)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise InvalidArgument(f"{field}: tensor, offset, nbytes, changed and narrow must be integers >= 0, got {entry!r}")
    if not last < entry.tensor < len(tensors):
        raise InvalidArgument(
            f"{field}.tensor: {entry.tensor} must be above the previous entry's ({last}) and below the "
            f"source's {len(tensors)} tensors"
        )
    desc = tensors[entry.tensor]
    itemsize = DTYPE_SIZES[desc.dtype]
    numel = desc.nbytes // itemsize
    form = entry.form if isinstance(entry.form, DeltaForm) else None
    if form is None:
        raise InvalidArgument(f"{field}.form: {entry.form!r} is not one of {[f.value for f in DeltaForm]}")
    if not 1 <= entry.changed <= numel or entry.narrow > entry.changed:
        raise InvalidArgument(
            f"{field}: changed={entry.changed}, narrow={entry.narrow} for a tensor of {numel} elements "
            f"({desc.name!r}) needs 1 <= changed <= {numel} and narrow <= changed"
        )
    if form is DeltaForm.WHOLE:
        fits = entry.nbytes == 0 and entry.offset == 0
    elif form is DeltaForm.SPARSE:
        fits = entry.nbytes == sparse_size(numel, itemsize, entry.changed, entry.narrow)
    else:
        low = blocks_size(desc.nbytes, 0)
        fits = low < entry.nbytes <= low + desc.nbytes
    if not fits or entry.offset + entry.nbytes > records:
        raise InvalidArgument(
            f"{field}: a {form.value} record of {entry.nbytes} bytes at offset {entry.offset} does not fit "
            f"tensor {desc.name!r} ({desc.nbytes} bytes, {entry.changed} changed) inside the "
            f"{records} record bytes"
        )
    return entry.tensor


def validate_delta(
    delta: object,
    tensors: Sequence[TensorDescriptor],
    regions: Sequence[tuple[int, int]],
    checksums: BlockChecksums | None,
) -> SourceDelta | None:
    """The catalog's check of ``SourceInfo.delta`` against the source's (checked) tensors,
    regions and checksums: a delta needs checksums (readers verify what they apply)."""
    from mx_refit.checksums import block_count

    if delta is None:
        return None
    if not isinstance(delta, SourceDelta):
        raise InvalidArgument(f"source.delta: expected a SourceDelta, got {type(delta).__name__}")
    if checksums is None:
        raise InvalidArgument("source.delta: a delta needs source.checksums (weight_sync.checksums)")
    for name in ("base_version", "addr", "nbytes"):
        value = getattr(delta, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
            raise InvalidArgument(f"source.delta.{name}: must be an integer in [0, 2**63), got {value!r}")
    if not isinstance(delta.base_digest, str) or not 0 < len(delta.base_digest) <= 128:
        raise InvalidArgument(
            f"source.delta.base_digest: must be a non-empty string of at most 128 characters, got {delta.base_digest!r}"
        )
    if delta.nbytes and not any(a <= delta.addr and delta.addr + delta.nbytes <= a + n for a, n in regions):
        raise InvalidArgument(
            f"source.delta: records {delta.addr:#x}+{delta.nbytes} lie outside every region in source.regions"
        )
    last = -1
    for index, entry in enumerate(delta.tensors):
        last = _check_entry(entry, index, tensors, delta.nbytes, last)
    sums = tuple(delta.record_sums)
    expected = block_count(delta.nbytes, checksums.block_bytes)
    if len(sums) != expected or any(isinstance(v, bool) or not isinstance(v, int) or not -(2**63) <= v < 2**63 for v in sums):
        raise InvalidArgument(
            f"source.delta.record_sums: {len(sums)} values, but {delta.nbytes} record bytes in blocks of "
            f"{checksums.block_bytes} need {expected} int64 sums"
        )
    return SourceDelta(delta.base_version, delta.base_digest, delta.addr, delta.nbytes, tuple(delta.tensors), sums)
