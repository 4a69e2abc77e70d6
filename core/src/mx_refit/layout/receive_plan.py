"""The Megatron receive plan: what :func:`mx_refit.layout.planner.plan_receive` returns.

A :class:`MegatronReceivePlan` satisfies :class:`mx_refit.plan.ReceivePlan`: ``reads`` into an
arena of ``arena_bytes``, per-role byte accounting, and ``materialize`` turning the filled arena
into ``(hf_name, tensor)`` pairs (views of the arena; staged row-parallel blocks are copied into
place once). Each planned Megatron tensor is one entry ``[arena base, template, HF names, dtype,
role, (source, address) per slot]``; the template (see :mod:`mx_refit.layout.placement`) holds
every offset and shape relative to the base.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple

from mx_refit.copies import BatchedCopy, Block, copy_mode
from mx_refit.copies import available as copies_available
from mx_refit.errors import InvalidArgument
from mx_refit.plan import PlannedOutput, ViewMemo, place_column_blocks
from mx_refit.types import ReadOp

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["MegatronReceivePlan", "TensorSpec", "describe_plan", "gc_paused", "place_column_blocks", "read_ops"]


class TensorSpec(NamedTuple):
    """Where one HF tensor (or window) sits in the arena and how it is finished."""

    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    copies: int  # staged blocks placed with a local strided copy (0: a pure view)


# From this many staged blocks on, a GPU arena restages them with one batched kernel.
RESTAGE_KERNEL_MIN = 4

# One Megatron tensor in the plan: [arena base of its region, template, HF names, dtype, role,
# (source id, descriptor address) per shard slot]. A list: the base is set in the second pass.
Entry = list[Any]


@dataclass
class MegatronReceivePlan:
    """A :class:`mx_refit.plan.ReceivePlan` for Megatron-published shards (see module docs)."""

    reads: list[ReadOp]
    arena_bytes: int
    bytes_needed: int
    bytes_by_role: dict[str, tuple[int, int]]
    tensors: int  # how many HF tensors ``materialize`` yields
    unmapped: list[str] = field(default_factory=list)  # published names absent from the HF map
    _entries: list[Entry] = field(default_factory=list, repr=False)
    _memo: ViewMemo = field(default_factory=ViewMemo, repr=False, compare=False)

    @property
    def hf_names(self) -> list[str]:
        """Every HF name ``materialize`` yields, in its order."""
        return list(chain.from_iterable(map(itemgetter(2), self._entries)))

    @property
    def bytes_pulled(self) -> int:
        return sum(pulled for pulled, _ in self.bytes_by_role.values())

    def tensor_specs(self) -> list[TensorSpec]:
        """Every output's arena placement, in ``materialize`` order, without touching memory."""
        rows: list[tuple[Any, ...]] = []
        append = rows.append
        with gc_paused():
            for base, tpl, names, dtype, _, _ in self._entries:
                outs = tpl.spec_rows
                # One or two outputs (almost every tensor): unrolled, a per-tensor zip costs more.
                rel, nbytes, shape, copies = outs[0]
                append((names[0], base + rel, nbytes, shape, dtype, copies))
                if len(outs) == 2:
                    rel, nbytes, shape, copies = outs[1]
                    append((names[1], base + rel, nbytes, shape, dtype, copies))
                elif len(outs) > 2:
                    for name, (rel, nbytes, shape, copies) in zip(names[1:], outs[1:]):
                        append((name, base + rel, nbytes, shape, dtype, copies))
            # NamedTuples built in C (TensorSpec._make adds a Python-level length check).
            return list(map(tuple.__new__, repeat(TensorSpec), rows))

    def outputs(self) -> list[PlannedOutput]:
        """Every output's arena placement with its staged blocks (:class:`PlannedOutput`), in
        ``materialize`` order, without touching memory."""
        found = []
        for base, tpl, names, dtype, _, _ in self._entries:
            for name, out in zip(names, tpl.outs):
                copies = tuple((base + c.landing, c.row_stride, c.width, c.dst_col) for c in out.copies)
                found.append(PlannedOutput(name, base + out.rel, out.nbytes, out.shape, dtype, copies))
        return found

    def materialize(self, arena: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` for every planned tensor once the reads have landed.

        Tensors are views of ``arena`` (a 1-D uint8 tensor of at least ``arena_bytes``); staged
        row-parallel blocks are first copied into place, once. Called again on the same arena
        (the receiver's next cycle), it redoes only those copies and yields the same views.
        """
        import torch

        if arena.dtype != torch.uint8 or arena.dim() != 1 or arena.numel() < self.arena_bytes:
            raise InvalidArgument(
                f"arena: expected a 1-D uint8 tensor of >= {self.arena_bytes} bytes, got "
                f"{arena.dtype} {tuple(arena.shape)}"
            )
        remembered = self._memo.recall(arena)
        if remembered is None:
            remembered = self._build_views(arena)
        return iter(remembered)  # not `yield from`: list() of it copies at C speed (10,000 views: 0.07 vs 0.48 ms)

    def _build_views(self, arena: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        import torch

        views: list[tuple[str, torch.Tensor]] = []
        restage: list[Any] = []
        staged: list[Block] = []  # every staged block, for one batched kernel on a GPU
        dtypes: dict[str, torch.dtype] = {}
        origin = arena.storage_offset()
        start_ptr = arena.data_ptr()
        for entry in self._entries:
            base, tpl, names, dtype = entry[0], entry[1], entry[2], entry[3]
            tdtype = dtypes.get(dtype)
            if tdtype is None:
                tdtype = dtypes[dtype] = getattr(torch, dtype)
            for name, out in zip(names, tpl.outs):
                start = base + out.rel
                region = arena[start : start + out.nbytes]
                if out.copies:
                    rows = out.shape[0]
                    staged.extend(
                        Block(start_ptr + base + c.landing, start_ptr + start + c.dst_col, c.rows, c.width,
                              c.row_stride, out.nbytes // rows)
                        for c in out.copies
                    )
                    blocks = [
                        (
                            c.dst_col,
                            arena.as_strided((c.rows, c.width), (c.row_stride, 1), origin + base + c.landing),
                        )
                        for c in out.copies
                    ]
                    place = partial(place_column_blocks, region.view(rows, out.nbytes // rows), blocks)
                    restage.append(place)
                views.append((name, region.view(tdtype).view(out.shape)))
        if (staged and arena.is_cuda and len(restage) >= RESTAGE_KERNEL_MIN and start_ptr % 16 == 0
                and copy_mode() != "never" and copies_available()):
            # One launch for every staged block, every cycle (a torch copy per block costs a
            # launch each: thousands for a row-parallel merge of a MoE model).
            restage = [BatchedCopy(staged, arena).launch]
        for place in restage:
            place()
        self._memo.keep(arena, views, restage)
        return views


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building tens of thousands of small acyclic containers:
    otherwise its generational passes rescan the whole manifest several times over (measured:
    10-30% of planning time). Nothing built here forms reference cycles."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_ops(rows: "list[tuple[str, int, int, int]] | list[list[Any]]") -> list[ReadOp]:
    """``ReadOp(*row)`` for every ``[source_id, remote_addr, nbytes, local_offset]`` row, built
    in C (``ReadOp._make`` and the constructor add a Python-level call per row)."""
    return list(map(tuple.__new__, repeat(ReadOp), rows))


def describe_plan(plan: MegatronReceivePlan) -> dict[str, Any]:
    """A JSON-friendly summary (tensors, bytes, reads, copies) for logs and ``verify``."""
    return {
        "tensors": plan.tensors,
        "reads": len(plan.reads),
        "arena_bytes": plan.arena_bytes,
        "bytes_needed": plan.bytes_needed,
        "bytes_pulled": plan.bytes_pulled,
        "bytes_by_role": {role: list(v) for role, v in plan.bytes_by_role.items()},
        "staged_copies": sum(spec.copies for spec in plan.tensor_specs()),
        "sources": len({r.source_id for r in plan.reads}),
        "unmapped": len(plan.unmapped),
    }


