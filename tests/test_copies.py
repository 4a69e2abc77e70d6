"""The batched copy kernel's range table (mx_refit.copies), on CPU: every byte of every block
covered exactly once, per alignment class, no program over its chunk. The table is replayed
here the way the kernel reads it; the kernel itself runs in tests/transport (gpu)."""

from __future__ import annotations

import random

import pytest

from mx_refit import copies
from mx_refit.copies import FIELDS, Block, ChunkTable, chunk_table, ranges_as_blocks

BASE = 1 << 20  # where the replay's memory starts (16-byte aligned, like an arena)


def replay(tables: list[ChunkTable], memory: bytearray) -> list[int]:
    """Run the tables the kernel's way on ``memory`` (byte 0 is ``BASE``); returns each
    program's bytes."""
    work = []
    for t in tables:
        for p in range(t.programs):
            src, dst, rows, width, ss, ds = t.rows[p * FIELDS:(p + 1) * FIELDS]
            for r in range(rows):
                s, d = (src + r * ss) * t.elem, (dst + r * ds) * t.elem
                memory[d:d + width * t.elem] = memory[s:s + width * t.elem]
            work.append(rows * width * t.elem)
    return work


def direct(blocks: list[Block], memory: bytearray) -> None:
    for b in blocks:
        for r in range(b.rows):
            s, d = b.src - BASE + r * b.src_stride, b.dst - BASE + r * b.dst_stride
            memory[d:d + b.width] = memory[s:s + b.width]


def random_blocks(rng: random.Random, align: int, count: int) -> list[Block]:
    """Non-overlapping sources in the first half, destinations in the second half."""
    blocks, src, dst = [], BASE, BASE + (1 << 19)
    for _ in range(count):
        rows = rng.choice([1, 1, 3, 17])
        width = rng.randrange(1, 300) * align
        stride = width + rng.randrange(0, 4) * align
        blocks.append(Block(src, dst, rows, width, stride, stride + align * rng.randrange(0, 3)))
        src += rows * stride + align * rng.randrange(0, 5)
        dst += rows * (stride + 3 * align) + align * rng.randrange(0, 5)
    return blocks


@pytest.mark.parametrize("align", [16, 4, 2, 1])
@pytest.mark.parametrize("chunk", [16, 256, 4096])
def test_the_table_copies_every_byte_once_and_nothing_else(align: int, chunk: int) -> None:
    rng = random.Random(align * 1000 + chunk)
    blocks = random_blocks(rng, align, 40)
    memory = bytearray(rng.randbytes(1 << 20))
    want = bytearray(memory)
    direct(blocks, want)
    tables = chunk_table(blocks, BASE, chunk)
    work = replay(tables, memory)
    assert memory == want
    assert sum(work) == sum(b.rows * b.width for b in blocks)
    assert max(work) <= chunk  # no program does more than its chunk


def test_alignment_classes_follow_every_address_width_and_stride() -> None:
    a16 = Block(BASE, BASE + 4096, 1, 64, 64, 64)
    a4 = Block(BASE + 4, BASE + 4096 + 4, 1, 64, 64, 64)
    stride4 = Block(BASE, BASE + 4096, 2, 64, 68, 64)  # aligned rows, a 4-byte row stride
    a1 = Block(BASE, BASE + 4096, 1, 63, 63, 63)
    tables = {t.align: t for t in chunk_table([a16, a4, stride4, a1], BASE)}
    assert {a: t.programs for a, t in tables.items()} == {16: 1, 4: 2, 1: 1}
    assert (tables[16].elem, tables[16].vec) == (4, 4)  # 16-byte vectors of int32
    assert tables[16].rows == [0, 4096 // 4, 1, 16, 16, 16]
    # a single row's stride never matters: a 1-row block with an odd stride stays aligned
    assert chunk_table([Block(BASE, BASE + 16, 1, 32, 7, 9)], BASE)[0].align == 16


def test_wide_rows_are_cut_and_narrow_rows_grouped() -> None:
    wide = chunk_table([Block(BASE, BASE + (1 << 19), 2, 1000 * 16, 1000 * 16, 1000 * 16)], BASE, 4096)
    assert wide[0].programs == 2 * 4  # 16,000 bytes a row: 4096 + 4096 + 4096 + 3712
    narrow = chunk_table([Block(BASE, BASE + (1 << 19), 100, 48, 64, 48)], BASE, 4096)
    assert narrow[0].programs == 2  # 85 rows of 48 bytes, then 15
    assert narrow[0].rows[2] == 85 and narrow[0].rows[FIELDS + 2] == 15


def test_ranges_become_one_row_blocks_and_empty_ones_vanish() -> None:
    assert ranges_as_blocks([(BASE, BASE + 64, 32), (BASE, BASE, 0)]) == [Block(BASE, BASE + 64, 1, 32, 32, 32)]
    assert chunk_table([Block(BASE, BASE, 0, 16, 16, 16)], BASE) == []


def test_addresses_below_the_base_are_negative_offsets() -> None:
    """IPC mappings may lie below the arena: offsets are signed."""
    (t,) = chunk_table([Block(BASE - 4096, BASE, 1, 64, 64, 64)], BASE)
    assert t.rows[:2] == [-1024, 0]


@pytest.mark.parametrize("bad", [dict(base=BASE + 8), dict(chunk_bytes=24), dict(chunk_bytes=0)])
def test_bad_arguments_name_the_field(bad: dict) -> None:
    base = bad.get("base", BASE)
    chunk = bad.get("chunk_bytes", 4096)
    with pytest.raises(ValueError, match="base|chunk_bytes"):
        chunk_table([Block(BASE, BASE + 64, 1, 16, 16, 16)], base, chunk)


def test_auto_mode_batches_many_small_ranges_and_leaves_few_or_large_ones_to_copy_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decision only (the table is built on the arena's device; nothing is launched)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(copies, "available", lambda: True)
    arena = torch.empty(1 << 16, dtype=torch.uint8)
    base = arena.data_ptr()
    small = [(base + 64 * i, base + 32768 + 64 * i, 64) for i in range(20)]
    large = [(base, base, copies.KERNEL_MAX_MEAN_BYTES)] * 20
    batch = copies.batched_ranges(small, arena, 16)
    assert batch is not None and batch.blocks == 20 and batch.nbytes == 20 * 64
    assert copies.batched_ranges(small[:15], arena, 16) is None  # few: one call each
    assert copies.batched_ranges(large, arena, 16) is None  # large: they run at full speed alone
    monkeypatch.setenv("MX_REFIT_COPY_KERNEL", "always")
    assert copies.batched_ranges(small[:1], arena, 16) is not None
    monkeypatch.setenv("MX_REFIT_COPY_KERNEL", "never")
    assert copies.batched_ranges(small, arena, 16) is None
    monkeypatch.setenv("MX_REFIT_COPY_KERNEL", "sometimes")
    with pytest.raises(ValueError, match="MX_REFIT_COPY_KERNEL"):
        copies.batched_ranges(small, arena, 16)
