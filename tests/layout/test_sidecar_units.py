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
