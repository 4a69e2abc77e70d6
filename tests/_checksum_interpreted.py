"""Run by tests/test_checksum_kernels.py in a child pytest with TRITON_INTERPRET=1 (Triton's
interpreter must be chosen before Triton is first imported): the real checksum kernel and the
fused copy-and-checksum of the CUDA IPC path, interpreted on CPU tensors (the same source the
GPU compiles)."""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict

import pytest
import torch

from mx_refit import checksum_kernels as kernels
from mx_refit.checksums import source_checksums, span_sums, verify, widen
from mx_refit.errors import ChecksumMismatch
from mx_refit.layout.planner import plan_receive
from mx_refit.ranges import coalesce
from mx_refit.types import TargetLayout
from tests import test_checksums as base
from tests.layout._planner_harness import ModelSpec, SourceLayout, publish

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_checksum_kernels.py"
pytestmark = pytest.mark.timeout(300)

BLOCK = base.BLOCK
_reference_math = base._reference_math  # the fixture (Megatron globals from the reference math)


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.delenv("MX_REFIT_CHECKSUM_TRITON", raising=False)


def test_the_kernel_computes_the_documented_function_at_any_size(interpreted):
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (5 * BLOCK + 77,), dtype=torch.uint8, generator=g)
    assert kernels.available(data)
    for stop in (1, 7, 8, BLOCK, 3 * BLOCK + 5, 5 * BLOCK + 77):
        span = data[:stop]
        assert span_sums(span, BLOCK).tolist() == base.reference(span.numpy().tobytes(), BLOCK), stop
    unaligned = data[3 : 3 + 2 * BLOCK + 9]  # not 8-aligned: the torch path, same numbers
    assert span_sums(unaligned, BLOCK).tolist() == base.reference(unaligned.numpy().tobytes(), BLOCK)


def test_the_kernel_and_torchs_path_agree(interpreted, monkeypatch):
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(3001, generator=g).to(torch.bfloat16), torch.randn(4096, generator=g)]
    by_kernel = [span_sums(t.view(-1).view(torch.uint8), BLOCK).tolist() for t in tensors]
    monkeypatch.setenv("MX_REFIT_CHECKSUM_TRITON", "0")
    assert [span_sums(t.view(-1).view(torch.uint8), BLOCK).tolist() for t in tensors] == by_kernel


def _widened(tp, target):
    spec = ModelSpec("cover", **base.SPEC)
    published = publish(spec, SourceLayout(tp=tp))
    sources = base._sources_with_checksums(published)
    version = dataclasses.replace(published.version, sources=tuple(sources.values()))
    plan = plan_receive(version, target)
    grouped = defaultdict(list)
    for op in plan.reads:
        grouped[op.source_id].append((op.remote_addr, op.local_offset, op.nbytes))
    widening = widen({s: coalesce(o) for s, o in grouped.items()}, sources, plan.arena_bytes)
    return published, sources, plan, widening


def _device_copies(widening, memory, arena, split_first=False):
    """The requests as the CUDA IPC path's (src pointer, dst pointer, n) copies, in two groups
    (two streams); ``split_first`` cuts the first copy in two halves that are not whole blocks."""
    copies = []
    for sid, ops in widening.requests.items():
        base_addr, blob = memory[sid]
        for remote, local, n in ops:
            copies.append((blob.data_ptr() + remote - base_addr, arena.data_ptr() + local, n))
    if split_first:
        src, dst, n = copies[0]
        half = n // 2 + 1
        copies[:1] = [(src, dst, half), (src + half, dst + half, n - half)]
    return [copies[::2], copies[1::2]]


def _fused_pull(widening, memory, split_first=False):
    arena = torch.full((widening.arena_bytes,), 0xA5, dtype=torch.uint8)
    hook = kernels.CopySums(widening.blocks(), torch.empty(len(widening.blocks()[0]), dtype=torch.int64))
    left = hook.launch(_device_copies(widening, memory, arena, split_first), arena)
    for group in left:  # what the plain device copy would do
        for src, dst, n in group:
            arena[dst - arena.data_ptr() : dst - arena.data_ptr() + n] = _bytes_at(memory, src, n)
    return arena, hook, left


def _bytes_at(memory, ptr, n):
    for _, blob in memory.values():
        if blob.data_ptr() <= ptr < blob.data_ptr() + blob.numel():
            at = ptr - blob.data_ptr()
            return blob[at : at + n]
    raise AssertionError(f"{ptr:#x} is in no source")


@pytest.mark.parametrize(("tp", "target"), base.CASES, ids=base.CASE_IDS)
def test_the_fused_copy_moves_every_byte_and_its_sums_verify(interpreted, tp, target):
    """Every widening case, partial blocks (staged and copied out after) included: the fused
    copy lands the same bytes as a plain copy, covers every block, and verifies."""
    published, sources, plan, widening = _widened(tp, target)
    arena, hook, left = _fused_pull(widening, published.memory)
    assert hook.launches == 1 and bool(hook.covered.all()) and not any(left)
    plain = base._execute(widening.requests, widening.arena_bytes, published.memory)
    assert torch.equal(arena, plain)
    expected = torch.cat([span_sums(plain[r.arena_offset : r.arena_offset + r.nbytes], BLOCK)
                          for r in widening.runs])
    assert torch.equal(hook.sums, expected)
    assert verify(arena, widening, sources, hook) == len(expected)
    plain_verified = plain.clone()
    verify(plain_verified, widening, sources)
    for op in plan.reads:  # the staged partial blocks were copied out into the plan's places
        assert torch.equal(arena[op.local_offset : op.local_offset + op.nbytes],
                           plain_verified[op.local_offset : op.local_offset + op.nbytes])


def test_a_flipped_byte_is_caught_through_the_fused_copy(interpreted):
    published, sources, _, widening = _widened(2, TargetLayout(tp_rank=1, tp_size=4, full_tensors=False))
    sid, (remote, _, n) = next((s, ops[0]) for s, ops in widening.requests.items() if ops)
    base_addr, blob = published.memory[sid]
    blob[remote - base_addr + n // 2] ^= 0x04  # after the sums were taken
    arena, hook, _ = _fused_pull(widening, published.memory)
    before = arena.clone()
    with pytest.raises(ChecksumMismatch, match="checksum mismatch in tensor"):
        verify(arena, widening, sources, hook)
    assert torch.equal(arena, before)  # nothing copied out of staging on a mismatch


def test_copies_the_kernel_cannot_take_are_copied_plainly_and_summed_after(interpreted):
    published, sources, _, widening = _widened(1, TargetLayout(full_tensors=True))
    arena, hook, left = _fused_pull(widening, published.memory, split_first=True)
    assert sum(len(g) for g in left) == 2 and not bool(hook.covered.all()) and bool(hook.covered.any())
    assert verify(arena, widening, sources, hook) == len(hook.covered)
    sid, (remote, local, n) = next((s, ops[0]) for s, ops in widening.requests.items() if ops)
    base_addr, blob = published.memory[sid]
    arena[local + 1] ^= 0x80  # in the plainly copied part: caught by the pass after the copy
    with pytest.raises(ChecksumMismatch):
        verify(arena, widening, sources, hook)
    hook.launches = 2  # a second read (failover) into the arena: the fused sums are not used
    arena[local + 1] ^= 0x80
    assert verify(arena, widening, sources, hook) == len(hook.covered)


def test_source_sums_by_the_kernel_equal_the_cpu_function(interpreted):
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(7001, generator=g), torch.randn(33, generator=g).to(torch.bfloat16), torch.empty(0)]
    want = [v for t in tensors if t.numel()
            for v in base.reference(t.view(-1).view(torch.uint8).numpy().tobytes(), BLOCK)]
    assert list(source_checksums(tensors, BLOCK).sums) == want


