"""Classifier units that need no process group: override registry semantics, and classification
of TransformerEngine-style modules by class name (TE cannot be installed on CPU machines, so the
modules here carry TE's class names and parameter layout: fused ``layer_norm_weight``, grouped
experts ``weight0..N``, stacked experts), with EP/ETP/PP coordinates given explicitly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mx_refit.megatron.classify import (
    BridgeKind,
    ClassificationError,
    RoleOverrides,
    classify_model,
    strip_wrapper_prefix,
)
from mx_refit.megatron.parallel import ParallelContext
from mx_refit.types import Role


def _module(class_name: str, **params: tuple[int, ...]) -> nn.Module:
    """An instance of a module class called ``class_name`` owning ``params`` (name -> shape)."""
    module = type(class_name, (nn.Module,), {})()
    for name, shape in params.items():
        module.register_parameter(name, nn.Parameter(torch.randn(shape)))
    return module


class _Config:
    gated_linear_unit = True
    num_moe_experts = 8


def te_style_model(*, ep_rank: int = 1, layer_offset: int = 2, stacked: bool = False) -> nn.Module:
    """A 2-layer GPT with TE layer classes on a TP=2 / EP=2 / PP stage holding layers 2..3."""
    root = _module("GPTModel")
    root.config = _Config()
    root.embedding = nn.Module()
    root.embedding.word_embeddings = _module("VocabParallelEmbedding", weight=(64, 16))
    root.decoder = nn.Module()
    root.decoder.layers = nn.ModuleList()
    for local in range(2):
        layer = _module("TransformerLayer")
        layer.layer_number = layer_offset + local + 1  # Megatron: 1-based, global across stages
        attn = layer.self_attention = _module("SelfAttention")
        attn.linear_qkv = _module("TELayerNormColumnParallelLinear", weight=(48, 16), bias=(48,),
                                  layer_norm_weight=(16,))
        attn.linear_qkv.config = _Config()
        attn.linear_proj = _module("TERowParallelLinear", weight=(16, 16), bias=(16,))
        attn.q_layernorm = _module("TENorm", weight=(8,))
        if local == 0:
            layer.mlp = _module("MLP")
            layer.mlp.linear_fc1 = _module("TELayerNormColumnParallelLinear", weight=(64, 16), layer_norm_weight=(16,))
            layer.mlp.linear_fc1.config = _Config()
            layer.mlp.linear_fc2 = _module("TERowParallelLinear", weight=(16, 32))
        else:
            layer.pre_mlp_layernorm = _module("TENorm", weight=(16,))
            moe = layer.mlp = _module("MoELayer")
            moe.local_expert_indices = [ep_rank * 4 + i for i in range(4)]
            moe.router = _module("TopKRouter", weight=(8, 16))
            moe.experts = _module("TEGroupedMLP")
            moe.experts.num_local_experts = 4
            if stacked:
                moe.experts.linear_fc1 = _module("StackedExperts", weight=(4, 32, 16))
                moe.experts.linear_fc2 = _module("StackedExperts", weight=(4, 16, 16))
            else:
                moe.experts.linear_fc1 = _module("TEColumnParallelGroupedLinear",
                                                 **{f"weight{i}": (32, 16) for i in range(4)})
                moe.experts.linear_fc1.config = _Config()
                moe.experts.linear_fc2 = _module("TERowParallelGroupedLinear",
                                                 **{f"weight{i}": (16, 16) for i in range(4)})
        root.decoder.layers.append(layer)
    root.decoder.final_layernorm = _module("TENorm", weight=(16,))
    root.output_layer = _module("ColumnParallelLinear", weight=(64, 16))
    return root


class Wrapper(nn.Module):
    """What DDP and Float16Module do to names: the model lives under ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


CTX = ParallelContext(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, ep_rank=1, ep_size=2, etp_rank=0, etp_size=1)

EXPECTED = {
    "embedding.word_embeddings.weight": (Role.VOCAB_PARALLEL, 0),
    "decoder.layers.2.self_attention.linear_qkv.weight": (Role.QKV_COLUMN, 0),
    "decoder.layers.2.self_attention.linear_qkv.bias": (Role.QKV_COLUMN, 0),
    "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight": (Role.REPLICATED, -1),
    "decoder.layers.2.self_attention.linear_proj.weight": (Role.ROW, 1),
    "decoder.layers.2.self_attention.linear_proj.bias": (Role.REPLICATED, -1),
    "decoder.layers.2.self_attention.q_layernorm.weight": (Role.REPLICATED, -1),
    "decoder.layers.2.mlp.linear_fc1.weight": (Role.GATED_MLP_COLUMN, 0),
    "decoder.layers.2.mlp.linear_fc1.layer_norm_weight": (Role.REPLICATED, -1),
    "decoder.layers.2.mlp.linear_fc2.weight": (Role.ROW, 1),
    "decoder.layers.3.mlp.router.weight": (Role.REPLICATED, -1),
    "decoder.layers.3.pre_mlp_layernorm.weight": (Role.REPLICATED, -1),
    "decoder.final_layernorm.weight": (Role.REPLICATED, -1),
    "output_layer.weight": (Role.VOCAB_PARALLEL, 0),
    **{f"decoder.layers.3.mlp.experts.linear_fc1.weight{g}": (Role.EXPERT_COLUMN, 0) for g in range(4, 8)},
    **{f"decoder.layers.3.mlp.experts.linear_fc2.weight{g}": (Role.EXPERT_ROW, 1) for g in range(4, 8)},
}


def by_name(items):
    return {c.name: c for c in items}


@pytest.mark.parametrize("wraps", [0, 2])
def test_te_class_names_global_ids_and_prefixes(wraps: int) -> None:
    model = te_style_model()
    for _ in range(wraps):
        model = Wrapper(model)
    items = by_name(classify_model(model, ctx=CTX))
    roles = {name: (c.role, c.shard_axis) for name, c in items.items()}
    assert {n for n in roles if n not in EXPECTED} == {
        f"decoder.layers.3.self_attention.{p}" for p in (
            "linear_qkv.weight", "linear_qkv.bias", "linear_qkv.layer_norm_weight", "linear_proj.weight",
            "linear_proj.bias", "q_layernorm.weight")}
    for name, want in EXPECTED.items():
        assert roles[name] == want, name
    qkv = items["decoder.layers.2.self_attention.linear_qkv.weight"]
    assert qkv.global_shape == (96, 16) and qkv.shard_offset == 48 and qkv.extras == {"tp_rank": 1, "tp_size": 2}
    proj = items["decoder.layers.2.self_attention.linear_proj.weight"]
    assert proj.global_shape == (16, 32) and proj.shard_offset == 16
    expert = items["decoder.layers.3.mlp.experts.linear_fc1.weight6"]
    # Experts use the expert-TP group (size 1 here), and carry the global expert id.
    assert expert.extras == {"expert_id": 6, "tp_rank": 0, "tp_size": 1} and expert.global_shape == (32, 16)
    assert expert.raw_name == "module." * wraps + "decoder.layers.1.mlp.experts.linear_fc1.weight2"
    params = dict(model.named_parameters())
    for c in items.values():  # views of the live parameters, never copies
        assert c.tensor.data_ptr() == params[c.raw_name].data_ptr()
        assert c.decided_by == "megatron"


def test_stacked_experts_become_per_expert_views() -> None:
    model = te_style_model(stacked=True)
    items = by_name(classify_model(model, ctx=CTX))
    stacked = dict(model.named_parameters())["decoder.layers.1.mlp.experts.linear_fc1.weight"]
    for local in range(4):
        item = items[f"decoder.layers.3.mlp.experts.linear_fc1.weight{4 + local}"]
        assert item.role is Role.EXPERT_COLUMN and item.extras["expert_id"] == 4 + local
        assert item.tensor.data_ptr() == stacked[local].data_ptr() and item.tensor.is_contiguous()
        assert tuple(item.tensor.shape) == (32, 16)
    assert items["decoder.layers.3.mlp.experts.linear_fc2.weight5"].role is Role.EXPERT_ROW


def test_legacy_grouped_mlp_is_refused() -> None:
    model = te_style_model()
    experts = model.decoder.layers[1].mlp.experts
    experts.register_parameter("weight1", nn.Parameter(torch.randn(16, 4 * 64)))
    with pytest.raises(ClassificationError, match="legacy GroupedMLP"):
        classify_model(model, ctx=CTX)


def test_megatron_attributes_beat_class_names_and_unknown_classes_are_refused() -> None:
    model = te_style_model()
    linear = _module("MyFancyLinear", weight=(8, 16))
    model.decoder.layers[0].self_attention.extra = linear
    with pytest.raises(ClassificationError, match="MyFancyLinear"):
        classify_model(model, ctx=CTX)
    linear.weight.tensor_model_parallel = True
    linear.weight.partition_dim = 1
    items = by_name(classify_model(model, ctx=CTX))
    assert items["decoder.layers.2.self_attention.extra.weight"].role is Role.ROW


def test_overrides_win_pattern_beats_class_later_beats_earlier() -> None:
    model = te_style_model()
    overrides = RoleOverrides()
    overrides.register(role="column", module_class="TERowParallelLinear")
    overrides.register(role=Role.REPLICATED, pattern="*.linear_proj.weight")
    overrides.register(role="row", pattern="decoder.layers.2.mlp.linear_fc2.*", shard_axis=1)
    overrides.register(role="replicated", pattern="decoder.layers.2.mlp.linear_fc2.*")  # later wins
    items = by_name(classify_model(model, overrides=overrides, ctx=CTX, bridge_kinds={
        "decoder.layers.2.self_attention.linear_proj.weight": BridgeKind("AutoMapping", "row"),
    }))
    proj = items["decoder.layers.2.self_attention.linear_proj.weight"]
    assert (proj.role, proj.decided_by, proj.shard_axis, proj.global_shape) == (Role.REPLICATED, "override", -1, (16, 16))
    bias = items["decoder.layers.2.self_attention.linear_proj.bias"]  # only the class override matches
    assert (bias.role, bias.shard_axis, bias.global_shape, bias.shard_offset) == (Role.COLUMN, 0, (32,), 16)
    assert items["decoder.layers.2.mlp.linear_fc2.weight"].role is Role.REPLICATED


def test_bridge_kinds_decide_when_no_override() -> None:
    model = te_style_model()
    kinds = {
        "decoder.layers.2.self_attention.linear_qkv.weight": BridgeKind("QKVMapping"),
        "decoder.layers.2.mlp.linear_fc1.weight": BridgeKind("GatedMLPMapping"),
        "decoder.layers.3.mlp.experts.linear_fc1.weight5": BridgeKind("GatedMLPMapping"),
        "decoder.layers.3.mlp.experts.linear_fc2.weight5": BridgeKind("AutoMapping", "row"),
        "decoder.layers.2.self_attention.linear_proj.bias": BridgeKind("RowParallelMapping"),
        "output_layer.weight": BridgeKind("ColumnParallelMapping"),
        "decoder.final_layernorm.weight": BridgeKind("ReplicatedMapping"),
    }
    items = by_name(classify_model(model, ctx=CTX, bridge_kinds=kinds))
    want = {
        "decoder.layers.2.self_attention.linear_qkv.weight": Role.QKV_COLUMN,
        "decoder.layers.2.mlp.linear_fc1.weight": Role.GATED_MLP_COLUMN,
        "decoder.layers.3.mlp.experts.linear_fc1.weight5": Role.EXPERT_COLUMN,
        "decoder.layers.3.mlp.experts.linear_fc2.weight5": Role.EXPERT_ROW,
        "decoder.layers.2.self_attention.linear_proj.bias": Role.REPLICATED,  # 1-D row bias
        "output_layer.weight": Role.VOCAB_PARALLEL,
        "decoder.final_layernorm.weight": Role.REPLICATED,
    }
    for name, role in want.items():
        assert (items[name].role, items[name].decided_by) == (role, "bridge"), name
        assert items[name].mapping == kinds[name].mapping
    with pytest.raises(ClassificationError, match="KVMapping"):
        classify_model(model, ctx=CTX, bridge_kinds={"output_layer.weight": BridgeKind("KVMapping")})


def test_tied_output_layer_is_published_once() -> None:
    model = te_style_model()
    model.share_embeddings_and_output_weights = True
    names = {c.name for c in classify_model(model, ctx=CTX)}
    assert "output_layer.weight" not in names and "embedding.word_embeddings.weight" in names


def test_pipeline_stage_needs_layer_numbers() -> None:
    model = te_style_model()
    for layer in model.decoder.layers:
        del layer.layer_number
    with pytest.raises(ClassificationError, match="layer_number"):
        classify_model(model, ctx=CTX)  # pp_size 2: local indices would collide across stages
    single = ParallelContext(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)
    assert "decoder.layers.1.mlp.router.weight" in {c.name for c in classify_model(model, ctx=single)}


def test_override_registry_validation_and_config() -> None:
    overrides = RoleOverrides.from_config([
        {"role": "column", "pattern": "a.*"},
        {"role": "row", "module_class": "X", "shard_axis": 1},
    ])
    assert len(overrides) == 2
    assert overrides.lookup("a.b", "X").role is Role.COLUMN  # pattern beats class
    assert overrides.lookup("z", "X").role is Role.ROW
    assert overrides.lookup("z", "Y") is None
    with pytest.raises(ClassificationError, match="not one of"):
        overrides.register(role="diagonal", pattern="x")
    with pytest.raises(ClassificationError, match="needs a pattern or a module_class"):
        overrides.register(role="row")
    with pytest.raises(ClassificationError, match="contradicts"):
        overrides.register(role="replicated", pattern="x", shard_axis=0)
    with pytest.raises(ClassificationError, match="unknown keys"):
        RoleOverrides.from_config([{"role": "row", "pattern": "x", "axis": 1}])
    with pytest.raises(ClassificationError, match="missing 'role'"):
        RoleOverrides.from_config([{"pattern": "x"}])


def test_overrides_from_plugins_through_the_core_hook(mx_hooks) -> None:
    from mx_refit import hookimpl

    class Plugin:
        @hookimpl
        def mx_refit_register_role_overrides(self, register):
            register(role="replicated", pattern="*.linear_proj.weight")
            register(role="column", module_class="TERowParallelLinear")

    mx_hooks.register(Plugin())
    mx_hooks.configure({"role_overrides": [{"role": "row", "pattern": "*.linear_fc2.weight"}]})
    overrides = mx_hooks.role_overrides()  # plugin rules, then the config's
    items = by_name(classify_model(te_style_model(), overrides=overrides, ctx=CTX))
    assert items["decoder.layers.2.self_attention.linear_proj.weight"].role is Role.REPLICATED
    assert items["decoder.layers.2.self_attention.linear_proj.bias"].role is Role.COLUMN
    assert items["decoder.layers.2.mlp.linear_fc2.weight"].role is Role.ROW


def test_strip_wrapper_prefix() -> None:
    assert strip_wrapper_prefix("module.module.decoder.x") == "decoder.x"
    assert strip_wrapper_prefix("decoder.module.x") == "decoder.module.x"
