"""Comparing received block sums with the published ones on the receiver's device
(:func:`mx_refit.checksums.verify`): the published sums go to the device once per source and
version, the comparison is one ``torch.equal``, and only a mismatch brings sums to the host to
name the first bad block."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mx_refit.errors import ChecksumMismatch
from mx_refit.types import PackedSums, SourceInfo

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

__all__ = ["device_sums", "expected_sums", "raise_mismatch"]

# ``verification`` below is a mx_refit.checksums.Verification (not imported: checksums imports
# this module, and core modules import no cycle, not even for types).


def device_sums(sums: PackedSums, device: "torch.device") -> "torch.Tensor":
    """A source's published sums on ``device``: one host-to-device copy per source and version
    (kept on the :class:`PackedSums`, which a reader decodes once per version)."""
    import torch

    kept = sums.device.get(str(device))
    if kept is None:
        host = torch.from_numpy(sums.array().copy())  # the bytes object is read-only
        kept = sums.device[str(device)] = host.to(device)
    return kept  # type: ignore[no-any-return]


def expected_sums(
    verification: Any, sources: dict[str, SourceInfo], device: "torch.device"
) -> "torch.Tensor":
    """Every verified block's published sum in block order (:meth:`Verification.blocks`), built
    on ``device`` by one gather per source (the index tensors are kept per device)."""
    import torch

    indices = verification.device_indices(device)
    want = torch.empty(len(verification.blocks()[0]), dtype=torch.int64, device=device)
    for source_id, (slots, positions) in indices.items():
        checksums = sources[source_id].checksums
        assert checksums is not None  # widen() refused sources without checksums
        published = device_sums(PackedSums.of(checksums.sums), device)
        if slots is None:  # this source's blocks are every slot, in order
            torch.index_select(published, 0, positions, out=want)
        else:
            want[slots] = published[positions]
    return want


def raise_mismatch(got: "np.ndarray", want: "np.ndarray", verification: Any) -> None:
    """The first differing block (by arena slot) named: tensor, block, byte range, source."""
    import numpy as np

    bad = np.flatnonzero(got != want)
    slot = int(bad[0])
    run_slots = verification.run_slots()
    r = int(np.searchsorted(run_slots, slot, side="right")) - 1
    j = slot - int(run_slots[r])
    run = verification.runs[r]
    block = verification.block_bytes[run.source_id]
    k = run.first_block + j
    raise ChecksumMismatch(
        f"checksum mismatch in tensor {run.tensor!r} from source {run.source_id!r}: block {k} "
        f"(bytes [{k * block}, {k * block + min(block, run.nbytes - j * block)})) published "
        f"{int(want[slot])}, received {int(got[slot])}; {len(bad)} of {len(got)} pulled blocks differ; "
        "nothing was loaded",
        source_id=run.source_id, tensor=run.tensor, block=k,
    )
