"""Fused-MoE experts placed rank-exactly into a real vLLM 0.33 Qwen3-MoE model on CPU.

Each TP rank (gloo, one process per rank) builds vLLM's own ``Qwen3MoeForCausalLM`` from a tiny
per-expert HF checkpoint, receives only its windows of the next checkpoint (cut by the core
planner's rules, see ``_moe_worker.py``), and :class:`mx_refit_vllm.params.ParamMap` places them
into ``w13_weight``/``w2_weight`` and every other parameter. Every parameter must then equal,
byte for byte, vLLM's own ``load_weights`` of the whole checkpoint, nothing may be left for the
loader, and the expert bytes a rank received must be exactly its expert parameters' bytes.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(600)

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 131,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "hidden_act": "silu",
}


def _checkpoint(root: Path, seed: int) -> Path:
    """A Qwen3-MoE checkpoint in the hub's per-expert layout, seeded random values."""
    import torch
    from safetensors.torch import save_file

    c = CONFIG
    h, inter, heads, kv, hd = c["hidden_size"], c["moe_intermediate_size"], 4, 2, c["head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "lm_head.weight": (c["vocab_size"], h),
              "model.norm.weight": (h,)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
            p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate.weight": (c["num_experts"], h),
        })
        for e in range(c["num_experts"]):
            shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (inter, h)
            shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (inter, h)
            shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, inter)
    out = root / f"qwen3moe-{seed}"
    out.mkdir()
    gen = torch.Generator().manual_seed(seed)
    save_file({n: torch.randn(s, generator=gen) * 0.05 for n, s in sorted(shapes.items())},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(CONFIG))
    return out


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("moe")
    return _checkpoint(root, 1), _checkpoint(root, 2)


def _run(world: int, ep: bool, ckpts: tuple[Path, Path]) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [str(world), "1" if ep else "0", f"tcp://127.0.0.1:{port}", str(ckpts[0]), str(ckpts[1])]
    procs = [
        subprocess.Popen([sys.executable, str(HERE / "_moe_worker.py"), str(r), *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=500)
        assert proc.returncode == 0, err[-4000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


@pytest.mark.parametrize(("world", "ep"), [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-ep2"])
def test_fused_moe_experts_placed_rank_exactly(world: int, ep: bool, moe_ckpts: tuple[Path, Path]) -> None:
    experts, layers = CONFIG["num_experts"], CONFIG["num_hidden_layers"]
    h, inter = CONFIG["hidden_size"], CONFIG["moe_intermediate_size"]
    for rank, r in enumerate(_run(world, ep, moe_ckpts)):
        assert r["coords"]["tp_rank"] == rank and r["coords"]["ep_size"] == (world if ep else 1), r["coords"]
        # vLLM's own stacks: [local experts, 2 * intermediate / moe-tp, hidden].
        local, moe_tp = (experts // world, 1) if ep else (experts, world)
        assert r["w13_shape"] == [local, 2 * inter // moe_tp, h]
        assert r["unproven"] == {} and len(r["moe_layers"]) == layers, r["unproven"]
        assert r["differ_before"] == r["compared"] > 0  # the next version differs everywhere
        assert r["mismatched"] == [] and r["rest"] == [], (rank, r["mismatched"], r["rest"])
        # Row pieces (receive_mode direct) land the same bytes into zeroed parameters.
        assert r["row_mismatched"] == [] and r["row_unwritten"] == [], (rank, r["row_mismatched"], r["row_unwritten"])
        assert r["placed_bytes"] == r["window_bytes"]  # every received byte went into a parameter
        # Only its own expert bytes: 1/TP of every expert, or its EP block of whole experts.
        own = layers * experts * 3 * h * inter * 4 // world  # fp32
        assert r["expert_window_bytes"] == r["expert_param_bytes"] == own
        # The per-module fallback stays loud and names the HF prefix it must receive whole.
        assert len(r["wrong_ep_unproven"]) == layers, r["wrong_ep_unproven"]
        assert all("fused MoE" in why for why in r["wrong_ep_unproven"].values())
        assert "model.layers.0.mlp.experts." in r["wrong_ep_whole"]
