"""Planner matrix: native shards of many source layouts -> every target layout, byte for byte.

Each case publishes a random model's native Megatron shards (built from HF reference tensors with
Megatron-Bridge's merge functions) into fake per-source memory, plans every rank of every target
layout, executes the reads as byte copies, materializes, and compares each HF tensor (or window)
to slicing the reference. Bytes pulled must equal bytes needed wherever the planner promises it.
"""

from __future__ import annotations

import pytest
import torch
from mx_refit.layout.planner import MegatronReceivePlan, describe_plan, plan_receive
from mx_refit.types import TargetLayout

from tests.layout._planner_harness import ModelSpec, SourceLayout, check, publish

SPECS = {
    "gqa": ModelSpec("gqa", heads=4, groups=2),
    "mha": ModelSpec("mha", heads=4, groups=4),
    "kv_lt_tp": ModelSpec("kv_lt_tp", heads=8, groups=2, head_dim=4),
    "qwen2_bias_tied_fp32": ModelSpec("qwen2", qkv_bias=True, tie=True, dtype=torch.float32),
    "qwen3_qknorm": ModelSpec("qwen3", heads=8, groups=4, head_dim=4, qk_norm=True),
    "moe4": ModelSpec("moe4", experts=4, qk_norm=True),
    "moe8_sequential": ModelSpec(
        "moe8", experts=8, moe_ffn=8, heads=8, groups=2, head_dim=4, sequential_experts=True
    ),
}
DENSE_LAYOUTS = [SourceLayout(tp=tp, pp=pp) for tp in (1, 2, 4) for pp in (1, 2)]
MOE_LAYOUTS = [
    SourceLayout(tp=tp, pp=pp, ep=ep, etp=etp)
    for tp in (1, 2, 4)
    for pp in (1, 2)
    for ep in (1, 2)
    for etp in sorted({1, tp})
]


def targets(spec: ModelSpec) -> list[TargetLayout]:
    """Every rank of: full tensors, and TP 1/2/4 slices; with EP 1 and (MoE) EP 2."""
    out = []
    for ep in (1, 2) if spec.experts else (1,):
        for e in range(ep):
            out.append(TargetLayout(ep_rank=e, ep_size=ep, full_tensors=True))
            for tp in (1, 2, 4):
                out.extend(
                    TargetLayout(tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep, full_tensors=False)
                    for t in range(tp)
                )
    return out


def assert_bytes(plan: MegatronReceivePlan, layout: SourceLayout, target: TargetLayout) -> None:
    """Pulled == needed for every role, except row-parallel column sub-blocks read as a hull."""
    sliced = not target.full_tensors
    sub_block = {
        "row": sliced and target.tp_size > layout.tp,
        "expert_row": sliced and target.ep_size == 1 and target.tp_size > layout.etp,
    }
    for role, (pulled, needed) in plan.bytes_by_role.items():
        if sub_block.get(role):
            assert pulled >= needed, role
        else:
            assert pulled == needed, (role, pulled, needed, target)
    assert plan.bytes_needed == sum(n for _, n in plan.bytes_by_role.values())


def run_matrix(spec: ModelSpec, layout: SourceLayout) -> None:
    published = publish(spec, layout)
    for target in targets(spec):
        plan = plan_receive(published.version, target)
        check(plan, published, spec, target)
        assert_bytes(plan, layout, target)
        if plan.bytes_pulled != plan.bytes_needed:
            # The per-row alternative moves exactly the needed bytes (and lands them in place).
            exact = plan_receive(published.version, target, row_slice_options={"force": "rows"})
            check(exact, published, spec, target)
            assert exact.bytes_pulled == exact.bytes_needed
            hull = plan_receive(published.version, target, row_slice_options={"force": "hull"})
            check(hull, published, spec, target)


@pytest.mark.parametrize("layout", DENSE_LAYOUTS, ids=lambda l: f"tp{l.tp}pp{l.pp}")
@pytest.mark.parametrize("spec", ["gqa", "mha", "kv_lt_tp", "qwen2_bias_tied_fp32", "qwen3_qknorm"])
def test_dense_matrix(spec: str, layout: SourceLayout) -> None:
    run_matrix(SPECS[spec], layout)


@pytest.mark.parametrize("layout", MOE_LAYOUTS, ids=lambda l: f"tp{l.tp}pp{l.pp}ep{l.ep}etp{l.etp}")
@pytest.mark.parametrize("spec", ["moe4", "moe8_sequential"])
def test_moe_matrix(spec: str, layout: SourceLayout) -> None:
    run_matrix(SPECS[spec], layout)


def test_unsplit_shards_published_on_axis_0() -> None:
    """A publisher may tag TP=1 shards with shard_axis 0 and tp_size 1 instead of -1."""
    run_matrix(SPECS["moe4"], SourceLayout(tp=1, ep=2, axis0_when_unsplit=True))


def test_matched_tp_is_all_views_and_one_read_per_shard() -> None:
    spec, layout = SPECS["gqa"], SourceLayout(tp=2)
    published = publish(spec, layout)
    target = TargetLayout(tp_rank=1, tp_size=2, full_tensors=False)
    plan = plan_receive(published.version, target)
    arena = torch.zeros(plan.arena_bytes, dtype=torch.uint8)
    assert all(s.copies == 0 for s in plan.tensor_specs())
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
    for _, tensor in plan.materialize(arena):
        assert lo <= tensor.data_ptr() < hi or tensor.numel() == 0  # a view of the arena
    # Every TP shard a matched rank needs is one contiguous read (QKV: q, k, v of one group).
    summary = describe_plan(plan)
    assert summary["staged_copies"] == 0 and summary["bytes_pulled"] == summary["bytes_needed"]


def test_narrower_target_places_row_parallel_with_one_copy() -> None:
    spec, layout = SPECS["gqa"], SourceLayout(tp=4)
    published = publish(spec, layout)
    plan = plan_receive(published.version, TargetLayout())
    copies = {s.name: s.copies for s in plan.tensor_specs()}
    assert copies["model.layers.0.self_attn.o_proj.weight"] == 4  # one strided copy per source shard
    assert copies["model.layers.0.self_attn.q_proj.weight"] == 0  # un-interleaved by placement
    assert sum(1 for c in copies.values() if c) == 2 * spec.layers  # only o_proj and down_proj
    check(plan, published, spec, TargetLayout())


def test_replicated_tensors_are_read_once_and_spread() -> None:
    spec, layout = SPECS["moe4"], SourceLayout(tp=4, ep=2)
    published = publish(spec, layout)
    plan = plan_receive(published.version, TargetLayout(), sticky_bytes=0)  # balance every tensor
    by_source: dict[str, int] = {}
    for op in plan.reads:
        by_source[op.source_id] = by_source.get(op.source_id, 0) + op.nbytes
    assert len(by_source) == 8  # every replica carries part of the load
    assert max(by_source.values()) < 2 * min(by_source.values())
    check(plan, published, spec, TargetLayout())
    # Different receivers start on different replicas of the same replicated tensor.
    norm_sources = set()
    for t in range(4):
        p = plan_receive(published.version, TargetLayout(tp_rank=t, tp_size=4, full_tensors=False))
        spec_ = next(s for s in p.tensor_specs() if s.name == "model.norm.weight")
        norm_sources.add(
            next(
                op.source_id
                for op in p.reads
                if op.local_offset <= spec_.offset < op.local_offset + op.nbytes
            )
        )
    assert len(norm_sources) > 1


def test_sticky_replicas_coalesce_reads() -> None:
    """Replicas are read in long same-source runs and the arena follows source address order, so
    neighbouring tensors of one source (packed back to back here, like a DDP parameter buffer)
    merge into one read."""
    spec, layout = SPECS["moe8_sequential"], SourceLayout(tp=2, ep=2)
    published = publish(spec, layout, gaps=False)
    balanced = plan_receive(published.version, TargetLayout(), sticky_bytes=0)
    sticky = plan_receive(published.version, TargetLayout())
    assert 3 * len(sticky.reads) < 2 * len(balanced.reads)
    check(sticky, published, spec, TargetLayout())
    pieces = sum(len(entry[1].pieces) for entry in sticky._entries)
    assert 2 * len(sticky.reads) < pieces


def test_plan_is_deterministic() -> None:
    published = publish(SPECS["moe4"], SourceLayout(tp=2, ep=2))
    target = TargetLayout(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2, full_tensors=False)
    a, b = plan_receive(published.version, target), plan_receive(published.version, target)
    assert a.reads == b.reads and a.hf_names == b.hf_names and a.arena_bytes == b.arena_bytes


def test_target_ep_receives_only_owned_experts_whole() -> None:
    spec = SPECS["moe8_sequential"]
    published = publish(spec, SourceLayout(tp=2, ep=2, etp=2))
    target = TargetLayout(tp_rank=0, tp_size=2, ep_rank=1, ep_size=4, full_tensors=False)
    plan = plan_receive(published.version, target)
    experts = {n.split(".experts.")[1].split(".")[0] for n in plan.hf_names if ".experts." in n}
    assert experts == {"2", "3"}
    shapes = {s.name: s.shape for s in plan.tensor_specs()}
    assert shapes["model.layers.1.mlp.experts.3.down_proj.weight"] == (spec.hidden, spec.moe_ffn)  # whole
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (spec.hidden, spec.heads * spec.head_dim // 2)
    check(plan, published, spec, target)


def test_unmapped_descriptors_are_reported_not_planned() -> None:
    published = publish(SPECS["gqa"], SourceLayout(tp=1))
    hf_map = dict(published.version.sidecar["megatron.hf_map"])
    del hf_map["decoder.final_layernorm.weight"]
    version = published.version.__class__(
        **{**published.version.__dict__, "sidecar": {**published.version.sidecar, "megatron.hf_map": hf_map}}
    )
    plan = plan_receive(version, TargetLayout())
    assert plan.unmapped == ["decoder.final_layernorm.weight"]
    assert "model.norm.weight" not in plan.hf_names


def test_benchmark_manifest_is_qwen3_30b_a3b_shaped() -> None:
    """The benchmark's synthetic manifest plans to the 18,867 HF tensors of Qwen3-30B-A3B with
    exactly the needed bytes (and the benchmark keeps working)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_planner.py"
    spec = importlib.util.spec_from_file_location("mx_refit_bench_planner", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    version = bench.manifest(tp=4, pp=1, dp=2, ep=8)
    plan = plan_receive(version, TargetLayout())
    assert plan.tensors == 18_867 and len(plan.tensor_specs()) == 18_867
    assert plan.bytes_pulled == plan.bytes_needed
    assert len(plan.reads) < plan.tensors // 10  # neighbouring tensors coalesce
    sliced = plan_receive(
        version, TargetLayout(tp_rank=3, tp_size=4, ep_rank=1, ep_size=2, full_tensors=False)
    )
    assert sliced.tensors == 3 + 48 * (9 + 64 * 3)
    assert sliced.bytes_pulled == sliced.bytes_needed  # experts whole under EP; rows windows exact
