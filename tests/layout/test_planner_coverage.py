"""The coverage gate and input validation: refuse loudly, list every gap, never plan partially."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from mx_refit.errors import CoverageError, InvalidArgument
from mx_refit.layout.planner import plan_receive
from mx_refit.types import Role, TargetLayout, VersionInfo

from tests.layout._planner_harness import ModelSpec, SourceLayout, check, publish

GQA = ModelSpec("gqa", heads=4, groups=2)  # head_dim 8: q rows 32, k/v rows 16
MOE = ModelSpec("moe", experts=4)
SLICE = {"full_tensors": False}


def with_sidecar(version: VersionInfo, **changes: object) -> VersionInfo:
    return dataclasses.replace(version, sidecar={**version.sidecar, **changes})


def test_missing_tp_rank_lists_every_gap_once() -> None:
    published = publish(GQA, SourceLayout(tp=2), drop_sources={"pp0-ep0-tp1"})
    with pytest.raises(CoverageError) as info:
        plan_receive(published.version, TargetLayout())
    gaps = dict(info.value.gaps)
    # Rank 1 held query group 1: q heads 2-3 and k/v head 1.
    assert gaps["model.layers.0.self_attn.q_proj.weight"].startswith("rows [16, 32)")
    assert gaps["model.layers.1.self_attn.k_proj.weight"].startswith("rows [8, 16)")
    assert gaps["model.layers.0.self_attn.o_proj.weight"] == "columns [16, 32)"
    assert gaps["model.layers.0.mlp.up_proj.weight"].startswith("rows [24, 48)")
    assert gaps["model.embed_tokens.weight"].startswith("rows [32, 50)")  # padding is not needed
    split = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    expected = {n for n in published.hf if any(s in n for s in split)} | {
        "model.embed_tokens.weight",
        "lm_head.weight",
    }
    assert set(gaps) == expected and len(info.value.gaps) == len(expected)
    assert "model.layers.1.mlp.down_proj.weight" in str(info.value)


def test_only_needed_bytes_are_gated() -> None:
    """A receiver whose window lies in the surviving shards plans fine; its neighbour does not."""
    published = publish(GQA, SourceLayout(tp=2), drop_sources={"pp0-ep0-tp1"})
    rank0 = TargetLayout(tp_rank=0, tp_size=2, **SLICE)
    check(plan_receive(published.version, rank0), published, GQA, rank0)
    with pytest.raises(CoverageError) as info:
        plan_receive(published.version, TargetLayout(tp_rank=1, tp_size=2, **SLICE))
    assert "model.layers.0.self_attn.q_proj.weight" in dict(info.value.gaps)


def test_kv_heads_below_tp_missing_rank() -> None:
    """8 q heads, 2 KV heads, TP 4: each rank's 12 fused rows cut through a 24-row query group.
    Source rank 2 held fused rows [24, 36) = q heads 4-6 of group 1 and nothing of k/v."""
    spec = ModelSpec("kv", heads=8, groups=2, head_dim=4)
    published = publish(spec, SourceLayout(tp=4), drop_sources={"pp0-ep0-tp2"})
    with pytest.raises(CoverageError) as info:
        plan_receive(published.version, TargetLayout())
    gaps = dict(info.value.gaps)
    assert gaps["model.layers.0.self_attn.q_proj.weight"].startswith("rows [16, 28) (Megatron rows [24, 36))")
    assert "model.layers.0.self_attn.k_proj.weight" not in gaps
    assert "model.layers.0.self_attn.v_proj.weight" not in gaps
    # TP-4 receivers 0 and 1 need only q heads 0-3 and their own column/row blocks: unaffected.
    for t in (0, 1):
        target = TargetLayout(tp_rank=t, tp_size=4, **SLICE)
        check(plan_receive(published.version, target), published, spec, target)
    for t in (2, 3):
        with pytest.raises(CoverageError, match="q_proj"):
            plan_receive(published.version, TargetLayout(tp_rank=t, tp_size=4, **SLICE))


def test_unpublished_tensor_is_a_gap() -> None:
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    published = publish(GQA, SourceLayout(tp=2, pp=2), drop={name})
    with pytest.raises(CoverageError) as info:
        plan_receive(published.version, TargetLayout(tp_rank=1, tp_size=2, **SLICE))
    assert [g[0] for g in info.value.gaps] == [f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv"]
    assert name in str(info.value)


def test_missing_ep_rank_detected_without_its_name_map() -> None:
    """An EP rank that never registered took its experts' name-map entries with it."""
    published = publish(MOE, SourceLayout(tp=2, ep=2), drop_sources={"pp0-ep1-tp0", "pp0-ep1-tp1"})
    with pytest.raises(CoverageError) as info:
        plan_receive(published.version, TargetLayout())
    missing = sorted(g[0] for g in info.value.gaps)
    assert missing == sorted(
        f"decoder.layers.{layer}.mlp.experts.linear_fc{fc}.weight{e}"
        for layer in (0, 1)
        for fc in (1, 2)
        for e in (2, 3)
    )
    owner_of_survivors = TargetLayout(ep_rank=0, ep_size=2)
    check(plan_receive(published.version, owner_of_survivors), published, MOE, owner_of_survivors)
    with pytest.raises(CoverageError):
        plan_receive(published.version, TargetLayout(ep_rank=1, ep_size=2))


def test_missing_pipeline_stage_detected_without_its_name_map() -> None:
    published = publish(GQA, SourceLayout(pp=2), drop_sources={"pp1-ep0-tp0"})
    with pytest.raises(CoverageError) as info:
        plan_receive(published.version, TargetLayout())
    assert ("decoder.layers.1", "layer missing from every source") in info.value.gaps


def test_tied_output_layer_is_not_needed() -> None:
    tied = dataclasses.replace(GQA, tie=True)
    published = publish(tied, SourceLayout(tp=2))
    hf_map = {
        **published.version.sidecar["megatron.hf_map"],
        "output_layer.weight": {"hf": ["lm_head.weight"], "mapping": "AutoMapping"},
    }
    plan = plan_receive(with_sidecar(published.version, **{"megatron.hf_map": hf_map}), TargetLayout())
    assert "lm_head.weight" not in plan.hf_names
    untied_config = {**published.version.sidecar["megatron.config"], "tie_word_embeddings": False}
    version = with_sidecar(published.version, **{"megatron.hf_map": hf_map, "megatron.config": untied_config})
    with pytest.raises(CoverageError, match="lm_head.weight"):
        plan_receive(version, TargetLayout())


@pytest.mark.parametrize(
    "target, message",
    [
        (TargetLayout(tp_rank=0, tp_size=3, full_tensors=False), "divide by target TP size 3"),
        (TargetLayout(tp_rank=2, tp_size=2), "target.tp_rank"),
        (TargetLayout(ep_rank=0, ep_size=3), "target.ep_size"),
    ],
)
def test_unsupported_targets(target: TargetLayout, message: str) -> None:
    published = publish(MOE, SourceLayout(tp=2))
    with pytest.raises(InvalidArgument, match=message):
        plan_receive(published.version, target)


def test_malformed_inputs_are_refused() -> None:
    published = publish(GQA, SourceLayout(tp=2))
    version = published.version
    with pytest.raises(InvalidArgument, match="megatron.config"):
        plan_receive(dataclasses.replace(version, sidecar={"megatron.hf_map": {}}), TargetLayout())
    hf_map = dict(version.sidecar["megatron.hf_map"])
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    hf_map[qkv] = {"hf": hf_map[qkv]["hf"][:2], "mapping": "QKVMapping"}
    with pytest.raises(InvalidArgument, match="maps to 3 HF tensors"):
        plan_receive(with_sidecar(version, **{"megatron.hf_map": hf_map}), TargetLayout())
    hf_map[qkv] = {"hf": "model.layers.0.self_attn.q_proj.weight"}
    with pytest.raises(InvalidArgument, match="list of HF names"):
        plan_receive(with_sidecar(version, **{"megatron.hf_map": hf_map}), TargetLayout())
    # A gated shard whose extras claim a TP size its geometry contradicts.
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    sources = tuple(
        dataclasses.replace(
            s,
            tensors=tuple(
                dataclasses.replace(d, extras={**d.extras, "tp_size": 4}) if d.name == fc1 else d
                for d in s.tensors
            ),
        )
        for s in version.sources
    )
    with pytest.raises(InvalidArgument, match="tp_size=4 disagrees"):
        plan_receive(dataclasses.replace(version, sources=sources), TargetLayout())
    plan = plan_receive(version, TargetLayout())
    with pytest.raises(InvalidArgument, match="arena"):
        next(plan.materialize(torch.zeros(plan.arena_bytes - 1, dtype=torch.uint8)))


def test_roles_must_match_their_mapping() -> None:
    published = publish(GQA, SourceLayout(tp=1))
    version = published.version
    sources = tuple(
        dataclasses.replace(
            s,
            tensors=tuple(
                dataclasses.replace(d, role=Role.QKV_COLUMN)
                if d.name == "decoder.final_layernorm.weight"
                else d
                for d in s.tensors
            ),
        )
        for s in version.sources
    )
    with pytest.raises(InvalidArgument, match="qkv_column"):
        plan_receive(dataclasses.replace(version, sources=sources), TargetLayout())
