"""What a publisher keeps between versions to publish deltas (``weight_sync.delta: auto``).

**Memory.** The change is found by comparing each published tensor with the bytes it held at
the previous publish, so the tracker keeps one copy of the published bytes on their own device
(``snapshot_bytes``: the BF16 model once, i.e. 2 bytes per parameter beside the optimizer's 16
of FP32 masters and Adam moments, ~12%), plus one record buffer of fixed capacity
(``capacity_fraction`` of the published bytes, 1/8 by default) registered once as a region of
the source, so that the layout readers plan against does not change from version to version.
Encoding needs per tensor a few temporaries of its size (byte comparisons, index lists), freed
before the next tensor.

A version is published whole (no delta) when it is the first, when the tensors or their
buffers changed, every ``anchor_every``-th version (an anchor), and when the records would not
fit the buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mx_refit.checks import check_count
from mx_refit.delta import checksums_digest
from mx_refit.types import BlockChecksums, SourceDelta, TensorDelta

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["DeltaTracker"]

log = logging.getLogger(__name__)


def _layout(tensors: Sequence["torch.Tensor"]) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), str(t.dtype), str(t.device)) for t in tensors)


class DeltaTracker:
    """Snapshot, record buffer and base of one publisher's delta versions."""

    def __init__(self, anchor_every: int = 10, capacity_fraction: float = 0.125) -> None:
        self.anchor_every = check_count(anchor_every, "delta_anchor_every", minimum=1)
        if not 0 < capacity_fraction <= 1:
            raise ValueError(f"capacity_fraction: must be in (0, 1], got {capacity_fraction!r}")
        self.capacity_fraction = capacity_fraction
        self._layout: tuple = ()
        self._snapshot: list[torch.Tensor] = []
        self.records: "torch.Tensor | None" = None
        self._base: tuple[int, str] | None = None  # (version, checksums digest) of the snapshot
        self._since_anchor = 0

    @property
    def snapshot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._snapshot)

    def buffer_for(self, tensors: Sequence["torch.Tensor"]) -> "torch.Tensor":
        """The record buffer (allocated once per layout, on the tensors' device): register and
        describe it with the tensors."""
        import torch

        layout = _layout(tensors)
        if self.records is None or layout != self._layout:
            total = sum(t.numel() * t.element_size() for t in tensors)
            device = tensors[0].device if tensors else torch.device("cpu")
            self.records = torch.zeros(max(1 << 16, int(total * self.capacity_fraction)), dtype=torch.uint8, device=device)
            self._layout, self._snapshot, self._base = layout, [], None
        return self.records

    def publish(
        self, version: int, tensors: Sequence["torch.Tensor"], checksums: BlockChecksums
    ) -> SourceDelta | None:
        """The delta of ``tensors`` (this version's bytes) against the previous publish, written
        into the record buffer, or None (publish whole); then this version becomes the base."""
        from mx_refit.checksums import source_checksums

        assert self.records is not None, "buffer_for first"
        delta, base = None, self._base
        if base is not None and self._since_anchor + 1 < self.anchor_every:
            delta = self._encode(tensors)
        if delta is not None and base is not None:
            entries, used = delta
            sums = source_checksums([self.records[:used]], checksums.block_bytes).sums if used else ()
            result: SourceDelta | None = SourceDelta(
                base[0], base[1], self.records.data_ptr(), used, tuple(entries), tuple(sums),
            )
            self._since_anchor += 1
        else:
            result, self._since_anchor = None, 0
        self._remember(tensors)
        self._base = (version, checksums_digest(checksums))
        return result

    def _encode(self, tensors: Sequence["torch.Tensor"]) -> tuple[list[TensorDelta], int] | None:
        from mx_refit.delta.records import encode

        assert self.records is not None
        entries: list[TensorDelta] = []
        used = 0
        for index, (old, new) in enumerate(zip(self._snapshot, tensors)):
            record = encode(old, new.detach())
            if record is None:
                continue
            size = record.data.numel()
            if used + size > self.records.numel():
                log.info("delta: records exceed the buffer's %d bytes: publishing whole", self.records.numel())
                return None
            if size:
                self.records[used : used + size] = record.data
            entries.append(TensorDelta(index, record.form, used if size else 0, size, record.changed, record.narrow))
            used += size
        return entries, used

    def _remember(self, tensors: Sequence["torch.Tensor"]) -> None:
        if not self._snapshot:
            self._snapshot = [t.detach().clone() for t in tensors]
            return
        for kept, t in zip(self._snapshot, tensors):
            kept.copy_(t.detach())
