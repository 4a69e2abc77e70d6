"""Checksums of a CPU arena overlapped with the pull: the widened reads are pulled in batches of
whole blocks, and each batch is summed on a worker thread while the next one transfers (torch's
matrix-vector product releases the GIL; NIXL/UCX moves the next batch meanwhile). Only the sums
are computed here; :func:`mx_refit.checksums.verify` compares them (all at once, after the last
batch) and copies the staged partial blocks out.

Used where bytes land by NIXL with no copy of ours to fuse into (a DRAM arena). A GPU arena
gets its sums from the device copy itself or one kernel launch after the pull.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mx_refit.checksums import KnownSums, Verification
    from mx_refit.receive.failover import FailoverPull

__all__ = ["BATCH_BYTES", "batches", "pull_and_sum"]

BATCH_BYTES = 64 << 20  # per batch: small enough to overlap, large enough that a transfer's setup is noise
Requests = dict[str, list[tuple[int, int, int]]]


@dataclass
class _Batch:
    requests: Requests
    first: int  # block slots [first, stop)
    stop: int
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (arena offset, nbytes, block)


def batches(verification: "Verification", batch_bytes: int | None = None) -> list[_Batch]:
    """The widened requests cut into batches of whole blocks (about ``batch_bytes``, default
    :data:`BATCH_BYTES`), in arena order; each with the arena spans of its blocks (per run,
    contiguous) to sum. Kept on the widening."""
    batch_bytes = batch_bytes or BATCH_BYTES
    kept = verification.__dict__.get("_batches")
    if kept is not None and kept[0] == batch_bytes:
        return kept[1]  # type: ignore[no-any-return]
    offsets, lengths = verification.blocks()
    cuts = [0]
    run_bytes = 0
    for slot, n in enumerate(lengths.tolist()):
        run_bytes += n
        if run_bytes >= batch_bytes and slot + 1 < len(lengths):
            cuts.append(slot + 1)
            run_bytes = 0
    cuts.append(len(lengths))
    edges = [int(offsets[c]) for c in cuts[1:-1]]  # arena offsets where a new batch starts
    out = [_Batch({}, a, b) for a, b in zip(cuts, cuts[1:]) if b > a] or [_Batch({}, 0, 0)]
    for source_id, ops in verification.requests.items():
        for remote, local, n in ops:
            pos, end = local, local + n
            while pos < end:
                i = bisect.bisect_right(edges, pos)
                stop = min(end, edges[i]) if i < len(edges) else end
                out[i].requests.setdefault(source_id, []).append((remote + pos - local, pos, stop - pos))
                pos = stop
    slot_of = {int(o): s for s, o in enumerate(offsets.tolist())}
    for run in verification.runs:
        block = verification.block_bytes[run.source_id]
        first = slot_of[run.arena_offset]
        for k in range(len(out)):  # the part of the run in each batch
            lo, hi = max(first, out[k].first), min(first + -(-run.nbytes // block), out[k].stop)
            if lo < hi:
                start = run.arena_offset + (lo - first) * block
                out[k].spans.append((start, min(run.arena_offset + run.nbytes, start + (hi - lo) * block) - start, block))
    verification.__dict__["_batches"] = (batch_bytes, out)
    return out


def pull_and_sum(
    verification: "Verification",
    arena: "torch.Tensor",
    pull: Callable[[Requests], "FailoverPull"],
    worker: ThreadPoolExecutor,
) -> "tuple[list[FailoverPull], KnownSums]":
    """Pull batch after batch (``pull`` reads one batch's requests), summing each pulled batch
    on ``worker`` while the next transfers. Returns every batch's pull and the sums."""
    import numpy as np
    import torch

    from mx_refit.checksums import KnownSums, span_sums

    plan = batches(verification)
    sums = torch.empty(len(verification.blocks()[0]), dtype=torch.int64)

    def sum_batch(batch: _Batch) -> None:
        at = batch.first
        for start, nbytes, block in batch.spans:
            got = span_sums(arena[start : start + nbytes], block)
            sums[at : at + got.numel()] = got
            at += got.numel()

    pulls: list[FailoverPull] = []
    pending: list[Future[Any]] = []
    try:
        for batch in plan:
            pulls.append(pull(batch.requests))
            pending.append(worker.submit(sum_batch, batch))
    finally:
        wait(pending)  # no worker still reads the arena once this returns or raises
    for future in pending:
        future.result()  # raises what a sum raised
    return pulls, KnownSums(sums, np.ones(len(sums), dtype=bool), batches=len(plan))
