"""The checksum of :mod:`mx_refit.checksums` as one Triton kernel over many blocks, and the same
kernel fused into the receiver's device copy (each byte read once).

One program per block: it reads the block as int64 words (plus up to 7 tail bytes), multiplies
each by its odd weight ``2i + 1`` and sums modulo 2**64, exactly the documented function, and
with ``COPY`` it also stores every word it read to the destination. Blocks are given as a task
table (int64 rows ``src, dst, nbytes, slot``; the sum goes to ``out[slot]``), so one launch
covers every block of every tensor, wherever they lie. Word loads need 8-byte aligned starts;
an unaligned block is left to the torch path (:func:`aligned`).

Used only for CUDA tensors when Triton is importable (``MX_REFIT_CHECKSUM_TRITON=0`` turns it
off); the CPU path is torch's (:func:`mx_refit.checksums.span_sums`). Triton's interpreter
(``TRITON_INTERPRET=1``) runs the same kernel on CPU tensors, which the tests use.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

__all__ = ["CopySums", "aligned", "arena_tasks", "available", "block_tasks", "device_tasks", "launch"]

# Words one program reads per step (32 KiB) and its warps. A sweep on the H200 (8 GiB in 1 MiB
# blocks, copy + sums; BENCHMARKS.md "Checksums: the fused copy's launch"): 1,024 words x 8 warps
# 4.33 ms, 4,096 x 16 4.26 ms; a plain Triton copy 4.14, torch's copy 4.00. The checksum does
# not depend on them.
_CHUNK_WORDS = 4096
_WARPS = 16
_COLS = 4  # src, dst, nbytes, slot


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernel() -> Any:
    return _compiled(_interpreted())


@functools.lru_cache(maxsize=2)
def _compiled(interpreted: bool) -> Any:
    """The kernel, from :mod:`mx_refit._checksum_triton` loaded once per mode (``triton.jit``
    reads ``TRITON_INTERPRET`` when it decorates, and the interpreter patches module globals)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "_checksum_triton.py")
    spec = importlib.util.spec_from_file_location(f"mx_refit._checksum_triton_{int(interpreted)}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.checksum_blocks


def available(tensor: "torch.Tensor") -> bool:
    """Whether the kernel runs for ``tensor``: CUDA memory and Triton importable (or Triton's
    interpreter, for CPU tensors in tests), unless ``MX_REFIT_CHECKSUM_TRITON=0``."""
    if os.environ.get("MX_REFIT_CHECKSUM_TRITON", "1") == "0":
        return False
    if tensor.device.type != "cuda" and not _interpreted():
        return False
    try:
        _kernel()
    except Exception:  # no Triton (or no compiler for it): the torch path does the work
        return False
    return True


def block_tasks(spans: Sequence[tuple[int, int, int, int]], block: int) -> "np.ndarray":
    """Task rows for ``spans`` of ``(src, dst, nbytes, first_slot)``, each starting at a block
    boundary: one row per block (the last may be short), slots counting up from ``first_slot``."""
    import numpy as np

    if not spans:
        return np.zeros((0, _COLS), dtype=np.int64)
    table = np.asarray(spans, dtype=np.int64).reshape(-1, _COLS)
    counts = -(-table[:, 2] // block)
    which = np.repeat(np.arange(len(table)), counts)
    k = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    rel = k * block
    picked = table[which]
    return np.stack([picked[:, 0] + rel, picked[:, 1] + rel, np.minimum(block, picked[:, 2] - rel),
                     picked[:, 3] + k], axis=1)


_TABLES: dict[tuple[str, bool], tuple[tuple[Any, ...], "torch.Tensor"]] = {}


def device_tasks(spans: Sequence[tuple[int, int, int, int]], block: int, device: "torch.device") -> "torch.Tensor":
    """:func:`block_tasks` on ``device``; the last table per device is kept (a publisher sums
    the same buffers every version, a receiver verifies the same arena)."""
    import torch

    key = (block, tuple(spans))
    slot = (str(device), len(spans) > 1)
    kept = _TABLES.get(slot)
    if kept is not None and kept[0] == key:
        return kept[1]
    tasks = torch.from_numpy(block_tasks(spans, block)).to(device)
    _TABLES[slot] = (key, tasks)
    return tasks


def aligned(tasks: "np.ndarray") -> "np.ndarray":
    """Which task rows the kernel can take (8-byte aligned source and destination)."""
    return ((tasks[:, 0] % 8) == 0) & ((tasks[:, 1] % 8) == 0)


def arena_tasks(
    arena: "torch.Tensor", offsets: "np.ndarray", lengths: "np.ndarray", only: "np.ndarray | None"
) -> "tuple[torch.Tensor, list[int]]":
    """The sum-only tasks for blocks of ``arena`` at ``offsets`` (slot = index; all of them, or
    ``only`` those), on the arena's device, and the slots of the unaligned ones it cannot take."""
    import numpy as np
    import torch

    rows = np.stack([arena.data_ptr() + offsets, np.zeros_like(offsets), lengths,
                     np.arange(len(offsets), dtype=np.int64)], axis=1)
    if only is not None:
        rows = rows[only]
    ok = aligned(rows)
    tasks = torch.from_numpy(np.ascontiguousarray(rows[ok])).to(arena.device)
    return tasks, rows[~ok][:, 3].tolist()


def launch(tasks: "torch.Tensor", out: "torch.Tensor", *, copy: bool) -> None:
    """Run the kernel over ``tasks`` (an int64 ``[n, 4]`` tensor on ``out``'s device) on the
    current stream: ``out[slot]`` = checksum of each block (and the block copied when ``copy``)."""
    if tasks.shape[0]:
        _kernel()[(tasks.shape[0],)](tasks, out, COPY=copy, CHUNK=_CHUNK_WORDS, num_warps=_WARPS)


class CopySums:
    """The receiver's hook into the CUDA IPC copy (:attr:`CudaIpcTransport.copy_hook`): the
    device copies that carry whole verified blocks become one launch of the kernel with
    ``COPY``, which writes each block's checksum to :attr:`sums` (in the verification's block
    order) as it copies; the others stay plain copies and are summed by :func:`verify` after.

    ``blocks``: the verification's blocks as arena offsets, lengths and slots
    (:meth:`mx_refit.checksums.Verification.blocks`). The task table is made once per copy
    program (the transport hands the same group lists every steady cycle) and kept on the device.
    """

    def __init__(self, blocks: "tuple[np.ndarray, np.ndarray]", sums: "torch.Tensor") -> None:
        import numpy as np

        self.offsets, self.lengths = blocks
        self.sums = sums
        self.covered = np.zeros(len(self.offsets), dtype=bool)
        self.launches = 0
        self.widening: Any = None  # what the receiver made it for
        self._program: tuple[Any, int, Any, list[list[tuple[int, int, int]]], Any] | None = None

    def launch(
        self, groups: list[list[tuple[int, int, int]]], arena: "torch.Tensor", stream: Any = None,
    ) -> list[list[tuple[int, int, int]]]:
        """Launch the fused copy of what it can take on ``stream`` (default: the current one);
        return the copies left for the plain device copy (same grouping)."""
        import contextlib

        import torch

        program = self._program
        if program is None or program[0] is not groups or program[1] != arena.data_ptr():
            program = self._program = self._build(groups, arena)
        _, _, tasks, rest, covered = program
        self.covered = covered
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            launch(tasks, self.sums, copy=True)
        self.launches += 1
        return rest

    def _build(self, groups: list[list[tuple[int, int, int]]], arena: "torch.Tensor") -> tuple[Any, ...]:
        import numpy as np
        import torch

        base = arena.data_ptr()
        offsets, lengths = self.offsets, self.lengths
        covered = np.zeros(len(offsets), dtype=bool)
        rows: list[np.ndarray] = []
        rest: list[list[tuple[int, int, int]]] = []
        for group in groups:
            left = []
            for src, dst, n in group:
                first = int(np.searchsorted(offsets, dst - base))
                last = int(np.searchsorted(offsets, dst - base + n))  # exclusive
                ends = offsets[first:last] + lengths[first:last]
                whole = (
                    last > first and offsets[first] == dst - base and ends[-1] == dst - base + n
                    and bool(np.all(offsets[first + 1 : last] == ends[:-1]))
                )
                if whole:
                    rel = offsets[first:last] - (dst - base)
                    part = np.stack([src + rel, dst + rel, lengths[first:last],
                                     np.arange(first, last, dtype=np.int64)], axis=1)
                    if bool(np.all(aligned(part))):
                        rows.append(part)
                        covered[first:last] = True
                        continue
                left.append((src, dst, n))
            rest.append(left)
        table = np.concatenate(rows) if rows else np.zeros((0, _COLS), dtype=np.int64)
        tasks = torch.from_numpy(np.ascontiguousarray(table)).to(arena.device)
        return groups, base, tasks, rest, covered
