"""Checksums of a DRAM arena summed batch by batch while the next batch transfers
(mx_refit.receive.overlap): the batches cover every widened byte once in whole blocks, and a
refit in many batches over real NIXL verifies, catches a flipped byte and leaves the engine's
previous weights intact."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch

from mx_refit.checksums import span_sums, widen
from mx_refit.errors import ChecksumMismatch
from mx_refit.layout.planner import plan_receive
from mx_refit.publisher import Publisher
from mx_refit.ranges import coalesce
from mx_refit.receive import overlap
from mx_refit.receive.receiver import Receiver
from mx_refit.types import PublishedTensor
from tests import test_checksums as base
from tests.layout._planner_harness import ModelSpec, SourceLayout, publish

pytestmark = pytest.mark.timeout(300)
BLOCK = base.BLOCK
_reference_math = base._reference_math  # the fixture


@pytest.mark.parametrize(("tp", "target"), base.CASES, ids=base.CASE_IDS)
@pytest.mark.parametrize("batch_bytes", [BLOCK, 3 * BLOCK + 1, 1 << 30])
def test_batches_cover_every_widened_byte_once_in_whole_blocks(tp, target, batch_bytes):
    published = publish(ModelSpec("cover", **base.SPEC), SourceLayout(tp=tp))
    sources = base._sources_with_checksums(published)
    version = dataclasses.replace(published.version, sources=tuple(sources.values()))
    plan = plan_receive(version, target)
    grouped = defaultdict(list)
    for op in plan.reads:
        grouped[op.source_id].append((op.remote_addr, op.local_offset, op.nbytes))
    widening = widen({s: coalesce(o) for s, o in grouped.items()}, sources, plan.arena_bytes)
    cut = overlap.batches(widening, batch_bytes)
    assert len(cut) > 1 or batch_bytes == 1 << 30
    offsets, lengths = widening.blocks()
    assert [b.first for b in cut] == [0] + [b.stop for b in cut[:-1]] and cut[-1].stop == len(offsets)
    # The batches' reads are the widened reads, cut only at block starts.
    want = torch.zeros(widening.arena_bytes, dtype=torch.int32)
    got = torch.zeros(widening.arena_bytes, dtype=torch.int32)
    for ops in widening.requests.values():
        for _, local, n in ops:
            want[local : local + n] += 1
    for batch in cut:
        lo = int(offsets[batch.first])
        hi = int(offsets[batch.stop - 1] + lengths[batch.stop - 1])
        for sid, ops in batch.requests.items():
            for remote, local, n in ops:
                assert lo <= local and local + n <= hi  # a batch reads only its own blocks
                assert (remote, local, n) in _pieces(widening.requests[sid], local, n)
                got[local : local + n] += 1
        # Its spans sum exactly its blocks, in order.
        arena = torch.randint(0, 256, (widening.arena_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        sums = torch.cat([span_sums(arena[s : s + n], b) for s, n, b in batch.spans])
        each = torch.cat([span_sums(arena[int(o) : int(o + n)], BLOCK)
                          for o, n in zip(offsets[batch.first : batch.stop], lengths[batch.first : batch.stop])])
        assert torch.equal(sums, each)
    assert torch.equal(got, want)


def _pieces(ops, local, n):
    """The piece of a widened read that covers [local, local + n), as a batch would read it."""
    for remote, at, size in ops:
        if at <= local and local + n <= at + size:
            return [(remote + local - at, local, n)]
    return []


def test_a_refit_in_batches_verifies_catches_a_flip_and_keeps_the_previous_weights(mx_catalog, mx_model_name, monkeypatch):
    monkeypatch.setattr(overlap, "BATCH_BYTES", 2 * BLOCK)  # ~17 batches of a 140 KB model
    made = []
    real = overlap.batches
    monkeypatch.setattr(overlap, "batches", lambda *a: made.append(real(*a)) or made[-1])
    weights = {f"w{i}": torch.randn(4000 + 37 * i) for i in range(8)}
    published = [PublishedTensor(n, t) for n, t in weights.items()]

    class Engine:
        def __init__(self) -> None:
            self.params: dict[str, torch.Tensor] = {}

        def load_weights(self, batch):
            for name, tensor in batch:
                self.params[name] = tensor.clone()

    engine = Engine()
    with Publisher(mx_catalog, mx_model_name, checksums=True, checksum_block_bytes=BLOCK) as pub, \
            Receiver(mx_catalog, mx_model_name, checksums=True, engine=engine) as rec:
        pub.publish(1, published)
        first = rec.refit(1)
        assert first.stats.blocks_verified == sum(-(-t.numel() * 4 // BLOCK) for t in weights.values())
        assert all(torch.equal(engine.params[n], t) for n, t in weights.items())
        assert len(made) == 1 and len(made[0]) > 10  # pulled and summed in batches
        kept = {n: t.clone() for n, t in engine.params.items()}
        pub.wait_drained(1, timeout_s=30)
        for t in weights.values():
            t.add_(1.0)  # version 2's bytes
        pub.publish(2, published)
        raw = weights["w6"].view(torch.uint8)
        raw[1234] ^= 0x01  # after the sums were taken: in a late batch
        with pytest.raises(ChecksumMismatch, match="tensor 'w6'"):
            rec.refit(2)
        assert all(torch.equal(engine.params[n], kept[n]) for n in weights)  # nothing was loaded
        raw[1234] ^= 0x01
        rec.refit(2)
        assert all(torch.equal(engine.params[n], t) for n, t in weights.items())
