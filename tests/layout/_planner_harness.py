"""Test harness of the planner tests: HF reference tensors -> Megatron globals -> native shards in
fake per-source "remote memory" -> descriptors + sidecar; executes a plan's reads as byte copies
and computes the vLLM-style windows a receiver should end up with, independently of the planner.

Megatron globals are built with Megatron-Bridge's own merge functions when Bridge imports (QKV
weights and biases); the gated-MLP concat follows Bridge's ``GatedMLPMapping.hf_to_megatron``
literally (``torch.chunk`` of gate and up per rank, ``[gate_t; up_t]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from mx_refit.types import (
    MeshPosition,
    ReadOp,
    Role,
    SourceInfo,
    TargetLayout,
    TensorDescriptor,
    VersionInfo,
    VersionState,
)

_PM: Any = None


def bridge_param_mapping() -> Any | None:
    """Megatron-Bridge's ``param_mapping`` module, or None when Bridge cannot import here."""
    global _PM
    if _PM is None:
        try:
            from mx_refit.megatron._bridge_import import import_bridge

            import_bridge()
            import megatron.bridge.models.conversion.param_mapping as pm

            _PM = pm
        except ImportError:
            _PM = False
    return _PM or None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int = 2
    hidden: int = 32
    heads: int = 4
    groups: int = 2
    head_dim: int = 8
    ffn: int = 48  # dense gated MLP (used when experts == 0)
    experts: int = 0
    moe_ffn: int = 16
    vocab: int = 50
    qkv_bias: bool = False
    qk_norm: bool = False
    tie: bool = False
    sequential_experts: bool = False  # local_experts.{e}.linear_fc1 naming instead of TE grouped
    dtype: torch.dtype = torch.bfloat16


@dataclass(frozen=True)
class SourceLayout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    axis0_when_unsplit: bool = False  # publish T=1 shards with shard_axis 0 instead of -1


@dataclass
class MegatronParam:
    name: str
    role: Role
    hf: list[str]
    mapping: str
    tensor: torch.Tensor  # the Megatron global tensor (Megatron concat coordinates)
    layer: int | None = None
    expert: int | None = None
    tp: int = 1  # publishing (expert-)TP for this tensor


@dataclass
class Published:
    version: VersionInfo
    memory: dict[str, tuple[int, torch.Tensor]]  # source_id -> (base address, bytes)
    hf: dict[str, torch.Tensor]
    params: list[MegatronParam] = field(default_factory=list)


def padded_vocab(vocab: int, tp: int, divisible_by: int = 8) -> int:
    step = divisible_by * tp
    return -(-vocab // step) * step


def hf_reference(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF tensors (Qwen/Llama naming)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(spec.dtype)

    h, d = spec.hidden, spec.head_dim
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(spec.vocab, h)}
    for layer in range(spec.layers):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = rnd(h)
        out[p + "self_attn.q_proj.weight"] = rnd(spec.heads * d, h)
        out[p + "self_attn.k_proj.weight"] = rnd(spec.groups * d, h)
        out[p + "self_attn.v_proj.weight"] = rnd(spec.groups * d, h)
        if spec.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = rnd(spec.heads * d)
            out[p + "self_attn.k_proj.bias"] = rnd(spec.groups * d)
            out[p + "self_attn.v_proj.bias"] = rnd(spec.groups * d)
        if spec.qk_norm:
            out[p + "self_attn.q_norm.weight"] = rnd(d)
            out[p + "self_attn.k_norm.weight"] = rnd(d)
        out[p + "self_attn.o_proj.weight"] = rnd(h, spec.heads * d)
        out[p + "post_attention_layernorm.weight"] = rnd(h)
        if spec.experts:
            out[p + "mlp.gate.weight"] = rnd(spec.experts, h)
            for e in range(spec.experts):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = rnd(spec.moe_ffn, h)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = rnd(spec.moe_ffn, h)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = rnd(h, spec.moe_ffn)
        else:
            out[p + "mlp.gate_proj.weight"] = rnd(spec.ffn, h)
            out[p + "mlp.up_proj.weight"] = rnd(spec.ffn, h)
            out[p + "mlp.down_proj.weight"] = rnd(h, spec.ffn)
    out["model.norm.weight"] = rnd(h)
    if not spec.tie:
        out["lm_head.weight"] = rnd(spec.vocab, h)
    return out


def _merge_qkv(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    pm = bridge_param_mapping()
    if pm is not None:
        cfg = SimpleNamespace(
            num_attention_heads=spec.heads,
            num_query_groups=spec.groups,
            kv_channels=spec.head_dim,
            hidden_size=spec.hidden,
        )
        return (pm.merge_qkv_biases if q.ndim == 1 else pm.merge_qkv_weights)(cfg, q, k, v)
    from tests.layout.reference_math import merge_qkv

    return merge_qkv(q, k, v, spec.heads, spec.groups, spec.head_dim)


def _merge_gated(gate: torch.Tensor, up: torch.Tensor, tp: int) -> torch.Tensor:
    # GatedMLPMapping.hf_to_megatron: rank i gets cat(chunk(gate)[i], chunk(up)[i]).
    gates, ups = torch.chunk(gate, tp, dim=0), torch.chunk(up, tp, dim=0)
    return torch.cat([torch.cat([gates[i], ups[i]], dim=0) for i in range(tp)], dim=0)


def megatron_params(
    spec: ModelSpec, hf: dict[str, torch.Tensor], layout: SourceLayout
) -> list[MegatronParam]:
    tp, etp = layout.tp, layout.etp
    pv = padded_vocab(spec.vocab, tp)
    gen = torch.Generator().manual_seed(1234)

    def pad_vocab(x: torch.Tensor) -> torch.Tensor:
        junk = torch.randn(pv - x.shape[0], x.shape[1], generator=gen).to(x.dtype)  # must be trimmed
        return torch.cat([x, junk], dim=0)

    params = [
        MegatronParam(
            "embedding.word_embeddings.weight",
            Role.VOCAB_PARALLEL,
            ["model.embed_tokens.weight"],
            "AutoMapping",
            pad_vocab(hf["model.embed_tokens.weight"]),
            tp=tp,
        )
    ]
    for layer in range(spec.layers):
        m, p = f"decoder.layers.{layer}.", f"model.layers.{layer}."

        def add(
            name: str,
            role: Role,
            names: list[str],
            mapping: str,
            tensor: torch.Tensor,
            m: str = m,
            p: str = p,
            layer: int = layer,
            **kw: Any,
        ) -> None:
            params.append(
                MegatronParam(m + name, role, [p + n for n in names], mapping, tensor, layer=layer, **kw)
            )

        add(
            "self_attention.linear_qkv.layer_norm_weight",
            Role.REPLICATED,
            ["input_layernorm.weight"],
            "AutoMapping",
            hf[p + "input_layernorm.weight"],
        )
        qkv = [f"self_attn.{x}_proj.weight" for x in "qkv"]
        add(
            "self_attention.linear_qkv.weight",
            Role.QKV_COLUMN,
            qkv,
            "QKVMapping",
            _merge_qkv(spec, *(hf[p + n] for n in qkv)),
            tp=tp,
        )
        if spec.qkv_bias:
            qkvb = [f"self_attn.{x}_proj.bias" for x in "qkv"]
            add(
                "self_attention.linear_qkv.bias",
                Role.QKV_COLUMN,
                qkvb,
                "QKVMapping",
                _merge_qkv(spec, *(hf[p + n] for n in qkvb)),
                tp=tp,
            )
        if spec.qk_norm:
            add(
                "self_attention.q_layernorm.weight",
                Role.REPLICATED,
                ["self_attn.q_norm.weight"],
                "AutoMapping",
                hf[p + "self_attn.q_norm.weight"],
            )
            add(
                "self_attention.k_layernorm.weight",
                Role.REPLICATED,
                ["self_attn.k_norm.weight"],
                "AutoMapping",
                hf[p + "self_attn.k_norm.weight"],
            )
        add(
            "self_attention.linear_proj.weight",
            Role.ROW,
            ["self_attn.o_proj.weight"],
            "AutoMapping",
            hf[p + "self_attn.o_proj.weight"],
            tp=tp,
        )
        if spec.experts:
            add(
                "pre_mlp_layernorm.weight",
                Role.REPLICATED,
                ["post_attention_layernorm.weight"],
                "AutoMapping",
                hf[p + "post_attention_layernorm.weight"],
            )
            add(
                "mlp.router.weight",
                Role.REPLICATED,
                ["mlp.gate.weight"],
                "AutoMapping",
                hf[p + "mlp.gate.weight"],
            )
            for e in range(spec.experts):
                gu = [f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight"]
                if spec.sequential_experts:
                    fc1, fc2 = (
                        f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                        f"mlp.experts.local_experts.{e}.linear_fc2.weight",
                    )
                else:
                    fc1, fc2 = f"mlp.experts.linear_fc1.weight{e}", f"mlp.experts.linear_fc2.weight{e}"
                add(
                    fc1,
                    Role.EXPERT_COLUMN,
                    gu,
                    "GatedMLPMapping",
                    _merge_gated(hf[p + gu[0]], hf[p + gu[1]], etp),
                    expert=e,
                    tp=etp,
                )
                add(
                    fc2,
                    Role.EXPERT_ROW,
                    [f"mlp.experts.{e}.down_proj.weight"],
                    "AutoMapping",
                    hf[p + f"mlp.experts.{e}.down_proj.weight"],
                    expert=e,
                    tp=etp,
                )
        else:
            add(
                "mlp.linear_fc1.layer_norm_weight",
                Role.REPLICATED,
                ["post_attention_layernorm.weight"],
                "AutoMapping",
                hf[p + "post_attention_layernorm.weight"],
            )
            add(
                "mlp.linear_fc1.weight",
                Role.GATED_MLP_COLUMN,
                ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                "GatedMLPMapping",
                _merge_gated(hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"], tp),
                tp=tp,
            )
            add(
                "mlp.linear_fc2.weight",
                Role.ROW,
                ["mlp.down_proj.weight"],
                "AutoMapping",
                hf[p + "mlp.down_proj.weight"],
                tp=tp,
            )
    params.append(
        MegatronParam(
            "decoder.final_layernorm.weight",
            Role.REPLICATED,
            ["model.norm.weight"],
            "AutoMapping",
            hf["model.norm.weight"],
        )
    )
    if not spec.tie:
        params.append(
            MegatronParam(
                "output_layer.weight",
                Role.COLUMN,
                ["lm_head.weight"],
                "AutoMapping",
                pad_vocab(hf["lm_head.weight"]),
                tp=tp,
            )
        )
    return params


def _stage_of(param: MegatronParam, spec: ModelSpec, pp: int) -> int:
    if param.layer is not None:
        return param.layer // (spec.layers // pp)
    return 0 if param.name.startswith("embedding.") else pp - 1


def publish(
    spec: ModelSpec,
    layout: SourceLayout,
    *,
    seed: int = 0,
    drop: set[str] = frozenset(),
    drop_sources: set[str] = frozenset(),
    gaps: bool = True,
) -> Published:
    """Cut native shards per source rank and lay them out in fake per-source memory.

    ``drop`` removes descriptors by Megatron name (every source); ``drop_sources`` removes whole
    sources (their descriptors AND their sidecar name-map entries). ``gaps=False`` packs a
    source's tensors back to back (like Megatron's contiguous DDP parameter buffer).
    """
    hf = hf_reference(spec, seed)
    params = megatron_params(spec, hf, layout)
    sources, memory = [], {}
    hf_map_all: dict[str, dict[str, Any]] = {}
    for pp in range(layout.pp):
        for ep in range(layout.ep):
            for tp in range(layout.tp):
                sid = f"pp{pp}-ep{ep}-tp{tp}"
                base = 0x1000_0000 * (len(sources) + 1)
                chunks: list[torch.Tensor] = []
                descs: list[TensorDescriptor] = []
                offset = filled = 0
                for prm in params:
                    if _stage_of(prm, spec, layout.pp) != pp:
                        continue
                    if prm.expert is not None and prm.expert // (spec.experts // layout.ep) != ep:
                        continue
                    rank = tp % prm.tp if prm.expert is not None else tp
                    local, axis, off, extras = _shard(prm, rank, layout)
                    raw = local.contiguous().view(-1).view(torch.uint8)
                    if gaps:
                        offset += 64 + (len(descs) % 3) * 32  # gaps between tensors, like an allocator
                    if sid not in drop_sources:
                        hf_map_all[prm.name] = {"hf": prm.hf, "mapping": prm.mapping}
                    if prm.name in drop:
                        continue
                    descs.append(
                        TensorDescriptor(
                            name=prm.name,
                            dtype=str(prm.tensor.dtype).removeprefix("torch."),
                            global_shape=tuple(prm.tensor.shape),
                            local_shape=tuple(local.shape),
                            addr=base + offset,
                            nbytes=raw.numel(),
                            role=prm.role,
                            shard_axis=axis,
                            shard_offset=off,
                            extras={
                                **extras,
                                **({"expert_id": prm.expert} if prm.expert is not None else {}),
                            },
                        )
                    )
                    chunks.append(torch.zeros(offset - filled, dtype=torch.uint8))
                    chunks.append(raw)
                    offset = filled = offset + raw.numel()
                if sid in drop_sources:
                    continue
                memory[sid] = (base, torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8))
                mesh = MeshPosition(
                    tp_rank=tp,
                    tp_size=layout.tp,
                    pp_rank=pp,
                    pp_size=layout.pp,
                    ep_rank=ep,
                    ep_size=layout.ep,
                )
                sources.append(SourceInfo(sid, mesh, f"agent-{sid}", b"", tuple(descs), ready=True))
    config = {
        "num_layers": spec.layers,
        "hidden_size": spec.hidden,
        "num_attention_heads": spec.heads,
        "num_query_groups": spec.groups,
        "kv_channels": spec.head_dim,
        "ffn_hidden_size": spec.ffn,
        "moe_ffn_hidden_size": spec.moe_ffn,
        "num_moe_experts": spec.experts or None,
        "vocab_size": spec.vocab,
        "padded_vocab_size": padded_vocab(spec.vocab, layout.tp),
        "tie_word_embeddings": spec.tie,
    }
    # The name map in Bridge task order (merged across sources the way the catalog does).
    ordered = {p.name: hf_map_all[p.name] for p in params if p.name in hf_map_all}
    version = VersionInfo(
        model=spec.name,
        version=7,
        state=VersionState.READY,
        expected_sources=len(sources),
        sources=tuple(sources),
        sidecar={"megatron.config": config, "megatron.hf_map": ordered},
    )
    return Published(version, memory, hf, params)


def _shard(
    prm: MegatronParam, rank: int, layout: SourceLayout
) -> tuple[torch.Tensor, int, int, dict[str, int]]:
    full, t = prm.tensor, prm.tp
    if prm.role is Role.REPLICATED:
        return full, -1, 0, {}
    axis = 1 if prm.role in (Role.ROW, Role.EXPERT_ROW) else 0
    if t == 1:
        return (
            full,
            (axis if layout.axis0_when_unsplit else -1),
            0,
            ({"tp_rank": 0, "tp_size": 1} if layout.axis0_when_unsplit else {}),
        )
    local = torch.chunk(full, t, dim=axis)[rank]
    return local, axis, rank * local.shape[axis], {"tp_rank": rank, "tp_size": t}


def execute(plan: Any, memory: dict[str, tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Run the plan's reads as byte copies into a fresh arena (poisoned, so gaps show); asserts
    that no arena byte is written twice."""
    arena = torch.full((plan.arena_bytes,), 0xA5, dtype=torch.uint8)
    written = torch.zeros(plan.arena_bytes, dtype=torch.int16)
    for op in plan.reads:
        assert isinstance(op, ReadOp) and op.nbytes > 0
        base, mem = memory[op.source_id]
        lo = op.remote_addr - base
        assert 0 <= lo and lo + op.nbytes <= mem.numel(), f"read outside source memory: {op}"
        arena[op.local_offset : op.local_offset + op.nbytes] = mem[lo : lo + op.nbytes]
        written[op.local_offset : op.local_offset + op.nbytes] += 1
    assert int(written.max()) <= 1, "two reads land on the same arena byte"
    return arena


def expected_window(
    name: str, full: torch.Tensor, spec: ModelSpec, target: TargetLayout
) -> torch.Tensor | None:
    """What a vLLM-style receiver holds of HF tensor ``name`` (None: not this worker's expert)."""
    expert = _hf_expert(name)
    if expert is not None and target.ep_size > 1:
        per = spec.experts // target.ep_size
        if not target.ep_rank * per <= expert < (target.ep_rank + 1) * per:
            return None
        return full  # vLLM EP: experts whole
    if target.receives_whole([name]):
        return full
    T, t = target.tp_size, target.tp_rank

    def rows(x: torch.Tensor) -> torch.Tensor:
        return torch.chunk(x, T, dim=0)[t] if x.shape[0] % T == 0 else _fail(name)

    if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
        if spec.groups >= T:
            return rows(full)
        head = t // (T // spec.groups)
        return full[head * spec.head_dim : (head + 1) * spec.head_dim]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        padded = math.ceil(spec.vocab / 64) * 64
        per = padded // T
        return full[min(t * per, spec.vocab) : min((t + 1) * per, spec.vocab)]
    if name.endswith(("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight")):
        return rows(full)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return torch.chunk(full, T, dim=1)[t]
    return full  # norms, router


def _hf_expert(name: str) -> int | None:
    if ".experts." not in name:
        return None
    return int(name.split(".experts.")[1].split(".")[0])


def _fail(name: str) -> torch.Tensor:
    raise AssertionError(f"{name}: test spec does not divide")


def check(plan: Any, published: Published, spec: ModelSpec, target: TargetLayout) -> dict[str, torch.Tensor]:
    """Execute + materialize and compare every tensor byte for byte; returns the tensors."""
    arena = execute(plan, published.memory)
    got = dict(plan.materialize(arena))
    assert len(got) == plan.tensors == len(plan.hf_names)
    expected = {
        n: w for n, full in published.hf.items() if (w := expected_window(n, full, spec, target)) is not None
    }
    assert set(got) == set(expected), (sorted(set(expected) - set(got)), sorted(set(got) - set(expected)))
    for name, want in expected.items():
        have = got[name]
        assert have.dtype == want.dtype and tuple(have.shape) == tuple(want.shape), (
            name,
            have.shape,
            want.shape,
        )
        assert torch.equal(have.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), name
    assert plan.bytes_needed == sum(w.numel() * w.element_size() for w in expected.values())
    return got
