"""Sidecar name-map ordering with real Megatron-Bridge mapping objects (no process groups)."""

from __future__ import annotations

from mx_refit.megatron.sidecar import hf_names_of


def test_hf_names_follow_the_schema_order_whatever_the_declaration(bridge) -> None:
    from megatron.bridge.models.conversion.param_mapping import (
        AutoMapping,
        GatedMLPMapping,
        QKVMapping,
    )

    qkv = QKVMapping("decoder.layers.*.self_attention.linear_qkv.weight",
                     v="model.layers.*.self_attn.v_proj.weight", k="model.layers.*.self_attn.k_proj.weight",
                     q="model.layers.*.self_attn.q_proj.weight").resolve(("3",))
    assert hf_names_of(qkv) == [f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv"]
    gated = GatedMLPMapping("decoder.layers.*.mlp.linear_fc1.weight", up="model.layers.*.mlp.up_proj.weight",
                            gate="model.layers.*.mlp.gate_proj.weight").resolve(("0",))
    assert hf_names_of(gated) == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    auto = AutoMapping("decoder.final_layernorm.weight", "model.norm.weight")
    assert hf_names_of(auto) == ["model.norm.weight"]


def test_mapping_types_without_a_role_are_named_before_any_export(bridge) -> None:
    """Bridge's GDN, Mamba and QKVG mappings (Qwen3-Next, Nemotron-H) have no mx-refit role; the
    check reads only the tasks' mapping classes, placeholder tasks of other stages included."""
    import pytest
    from megatron.bridge.models.conversion.model_bridge import WeightConversionTask
    from megatron.bridge.models.conversion.param_mapping import (
        AutoMapping,
        GatedMLPMapping,
        GDNLinearMapping,
        MambaInProjMapping,
        QKVGMapping,
        QKVMapping,
    )

    import mx_refit
    from mx_refit.errors import ClassificationError
    from mx_refit.megatron.classify import BridgeKind, _role_from_bridge

    def task(mapping):
        name = mapping.megatron_param
        return WeightConversionTask(param_name=name, global_param_name=f"module.{name}", mapping=mapping)

    known = [
        QKVMapping("decoder.layers.0.self_attention.linear_qkv.weight", q="q", k="k", v="v"),
        GatedMLPMapping("decoder.layers.0.mlp.linear_fc1.weight", gate="g", up="u"),
        AutoMapping("decoder.final_layernorm.weight", "model.norm.weight"),
    ]
    unknown = [
        GDNLinearMapping("decoder.layers.1.self_attention.in_proj.weight", qkvz="qkvz", ba="ba"),
        GDNLinearMapping("decoder.layers.5.self_attention.in_proj.weight", qkvz="qkvz", ba="ba"),
        MambaInProjMapping("decoder.layers.2.mixer.in_proj.weight", "in_proj"),
        QKVGMapping("decoder.layers.3.self_attention.linear_qkv.weight", q="q", k="k", v="v", g="g"),
    ]
    tasks = [task(m) for m in known + unknown] + [None]  # Bridge leaves None holes too
    assert mx_refit.unsupported_bridge_mappings(tasks) == {
        "GDNLinearMapping": ["decoder.layers.1.self_attention.in_proj.weight",
                             "decoder.layers.5.self_attention.in_proj.weight"],
        "MambaInProjMapping": ["decoder.layers.2.mixer.in_proj.weight"],
        "QKVGMapping": ["decoder.layers.3.self_attention.linear_qkv.weight"],
    }
    assert mx_refit.unsupported_bridge_mappings([task(m) for m in known]) == {}
    assert mx_refit.unsupported_bridge_mappings(None) == {}
    # The same answer the classifier gives once it meets such a parameter.
    for mapping in unknown:
        with pytest.raises(ClassificationError, match="has no mx-refit role"):
            _role_from_bridge(BridgeKind(type(mapping).__name__, None), ndim=2, is_expert=False,
                              module_class="X", module_path="p", name=mapping.megatron_param)
