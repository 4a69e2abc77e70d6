"""Materialised views are built once per arena and reused; staged copies are redone each cycle.

The receiver pulls into the same arena with the same cached plan every cycle, so a plan hands
out the same views again, after placing the staged row-parallel blocks from the new bytes.
"""

from __future__ import annotations

import torch

from mx_refit.layout.planner import plan_receive
from mx_refit.plan import plan_full_tensors
from mx_refit.types import (
    MeshPosition,
    Role,
    SourceInfo,
    TargetLayout,
    TensorDescriptor,
    VersionInfo,
    VersionState,
)
from tests.layout._planner_harness import ModelSpec, SourceLayout, check, execute, publish


def _same_views(first: list[tuple[str, torch.Tensor]], second: list[tuple[str, torch.Tensor]]) -> bool:
    return [n for n, _ in first] == [n for n, _ in second] and all(a is b for (_, a), (_, b) in zip(first, second))


def test_megatron_views_reused_and_staged_blocks_placed_from_new_bytes() -> None:
    """TP4 -> full tensors: o_proj/down_proj are staged and copied; a second cycle on new bytes
    (the trainer rewrote its buffers in place) must show the new bytes through the same views."""
    spec, layout = ModelSpec("gqa", heads=4, groups=2), SourceLayout(tp=4)
    old, new = publish(spec, layout, seed=1), publish(spec, layout, seed=2)
    target = TargetLayout()
    plan = plan_receive(old.version, target)
    assert any(s.copies for s in plan.tensor_specs())  # the case under test has staged copies

    arena = execute(plan, old.memory)
    first = check(plan, old, spec, target)  # builds and checks views of its own arena
    cycle1 = list(plan.materialize(arena))
    for source_id, (_, mem) in old.memory.items():  # in-place rewrite, same layout
        mem.copy_(new.memory[source_id][1])
    arena.copy_(execute(plan, old.memory))  # the next pull lands in the same arena
    cycle2 = list(plan.materialize(arena))
    assert _same_views(cycle1, cycle2)
    got = dict(cycle2)
    for name in first:
        want = new.hf[name]
        assert torch.equal(got[name].contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), name


def test_megatron_views_follow_a_new_arena() -> None:
    spec, layout = ModelSpec("gqa", heads=4, groups=2), SourceLayout(tp=2)
    published = publish(spec, layout, seed=3)
    plan = plan_receive(published.version, TargetLayout(tp_rank=0, tp_size=2, full_tensors=False))
    one = execute(plan, published.memory)
    views_one = list(plan.materialize(one))
    two = execute(plan, published.memory)  # e.g. the receiver grew its arena
    views_two = list(plan.materialize(two))
    lo, hi = two.data_ptr(), two.data_ptr() + two.numel()
    assert all(lo <= t.data_ptr() < hi for _, t in views_two if t.numel())
    assert not any(a is b for (_, a), (_, b) in zip(views_one, views_two))
    # Back on the first arena: views of it again, not of the second.
    lo, hi = one.data_ptr(), one.data_ptr() + one.numel()
    assert all(lo <= t.data_ptr() < hi for _, t in plan.materialize(one) if t.numel())


def _dim1_sharded_version(base: int) -> VersionInfo:
    """Two sources holding the column halves of one [4, 6] float32 tensor (staged, copied)."""
    sources = []
    for rank in range(2):
        desc = TensorDescriptor(
            name="w", dtype="float32", global_shape=(4, 6), local_shape=(4, 3), addr=base + rank * 4096,
            nbytes=4 * 3 * 4, role=Role.ROW, shard_axis=1, shard_offset=3 * rank,
        )
        sources.append(SourceInfo(
            source_id=f"s{rank}", mesh=MeshPosition(tp_rank=rank, tp_size=2), agent_name=f"a{rank}",
            agent_metadata=b"md", tensors=(desc,),
        ))
    return VersionInfo(model="m", version=1, state=VersionState.READY, expected_sources=2, sources=tuple(sources))


def test_full_tensor_plan_reuses_views_and_redoes_staged_copies() -> None:
    plan = plan_full_tensors(_dim1_sharded_version(0x10000))
    assert plan.placements[0].staged  # dim-1 shards: staged then copied
    arena = torch.zeros(plan.arena_bytes, dtype=torch.uint8)

    def pull(seed: int) -> torch.Tensor:
        full = torch.arange(24, dtype=torch.float32).view(4, 6) + 100 * seed
        for op in plan.reads:
            half = 0 if op.source_id == "s0" else 1
            shard = full[:, 3 * half : 3 * half + 3].contiguous().view(-1).view(torch.uint8)
            arena[op.local_offset : op.local_offset + op.nbytes] = shard
        return full

    want1 = pull(1)
    (name1, got1), = plan.materialize(arena)
    assert torch.equal(got1, want1)
    want2 = pull(2)
    (name2, got2), = plan.materialize(arena)
    assert got2 is got1 and name2 == name1 == "w"
    assert torch.equal(got2, want2)
