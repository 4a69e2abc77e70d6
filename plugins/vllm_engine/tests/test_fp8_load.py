"""An FP8 refit through vLLM's own loader (issue 23): vLLM 0.33 builds a block-FP8 Qwen2 on the
CPU (``_fp8_worker.py``: everything but the AMX-only GEMM kernel, which loading never runs), one
copy loads the FP8 checkpoint written by mx-refit's reference quantiser, the other receives the
same BF16 weights quantised on publish through a real Publisher and Receiver (the plugin's
``fp8_block`` target) and hands them to the same ``load_weights``. Every parameter (fused
``qkv_proj`` / ``gate_up_proj`` FP8 weights and their ``weight_scale_inv`` grids, BF16 biases,
norms, embeddings) must then be equal byte for byte, at TP 1 and TP 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mx_refit import Publisher
from mx_refit.fp8 import is_quantized_weight, quantize_reference, scale_name
from mx_refit.testing.checkpoints import CONFIG
from mx_refit.testing.procs import rendezvous_url, start_group, vllm_python
from mx_refit.types import PublishedTensor

pytestmark = pytest.mark.timeout(600)

HERE = Path(__file__).resolve().parent
# Qwen2 with every linear layer on 128 blocks: q 256 (2 heads of 128), k/v 128 (1 kv head,
# replicated at TP 2), MLP 256 (128 per rank at TP 2); biases and norms stay BF16.
FP8_CONFIG = {
    **CONFIG,
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "vocab_size": 300,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]
    },
}


def _bf16_weights() -> dict[str, torch.Tensor]:
    import transformers

    kept = {"architectures", "model_type", "quantization_config"}
    config = transformers.Qwen2Config(**{k: v for k, v in FP8_CONFIG.items() if k not in kept})
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in transformers.Qwen2ForCausalLM(config).named_parameters()}
    g = torch.Generator().manual_seed(23)
    weights = {n: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for n, s in sorted(shapes.items())}
    # An all-zero block and a large block: vLLM's amax floor and the full FP8 range.
    weights["model.layers.0.self_attn.k_proj.weight"][:128, :128] = 0
    weights["model.layers.0.mlp.up_proj.weight"][128:, 128:] *= 400
    return weights


def _write_reference_checkpoint(root: Path, weights: dict[str, torch.Tensor]) -> Path:
    """The FP8 checkpoint the reference quantiser makes (Qwen3-*-FP8's naming)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if is_quantized_weight(name, tensor.dim(), "bfloat16"):
            tensors[name], tensors[scale_name(name)] = quantize_reference(tensor)
        else:
            tensors[name] = tensor
    out = root / "qwen2-fp8"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(FP8_CONFIG, indent=1))
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_an_fp8_refit_equals_vllm_loading_the_reference_fp8_checkpoint(
    tp: int, tmp_path: Path, mx_catalog: str, mx_model_name: str
) -> None:
    weights = _bf16_weights()
    checkpoint = _write_reference_checkpoint(tmp_path, weights)
    rendezvous = rendezvous_url(tmp_path)
    args = [
        ["--rank", str(r), "--world", str(tp), "--dist-init", rendezvous, "--hf-dir", str(checkpoint)]
        for r in range(tp)
    ]
    group = start_group(f"fp8-tp{tp}", vllm_python(), HERE / "_fp8_worker.py", args, tmp_path)
    try:
        for built in group.call("describe"):
            assert built["quant_config"] == "Fp8Config" and built["block"] == [128, 128]
            fp8 = {n for n, d in built["dtypes"].items() if d == "torch.float8_e4m3fn"}
            assert fp8 == {
                "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
            }
            assert {f"{n}_scale_inv" for n in fp8} <= set(built["dtypes"])
        with Publisher(mx_catalog, mx_model_name, publish_format="fp8_block") as pub:
            pub.publish(1, [PublishedTensor(n, t) for n, t in weights.items()])
            pulled = group.call("refit", (mx_catalog, mx_model_name, 1))
        for report in pulled:
            assert report["targets"] == ["fp8_block"]
            q_proj = "model.layers.0.self_attn.q_proj"
            assert report["received"][f"{q_proj}.weight"][0] == "torch.float8_e4m3fn"
            assert report["received"][f"{q_proj}.weight_scale_inv"] == ("torch.float32", (2, 2))
        for rank, report in enumerate(group.call("compare")):
            assert report["compared"] >= 16
            assert report["mismatched"] == [], f"TP rank {rank} of {tp}: {report['mismatched']}"
        # The comparison sees one changed element: version 2 differs in down_proj's first block
        # (rank 0's slice of this row-parallel layer), so its FP8 bytes and scale differ there.
        down_proj = "model.layers.0.mlp.down_proj.weight"
        changed = {**weights, down_proj: weights[down_proj].clone()}
        changed[down_proj][0, 0] = 3.0
        with Publisher(mx_catalog, mx_model_name, publish_format="fp8_block") as pub:
            pub.publish(2, [PublishedTensor(n, t) for n, t in changed.items()])
            group.call("refit", (mx_catalog, mx_model_name, 2))
        down = ["model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv"]
        assert [sorted(r["mismatched"]) for r in group.call("compare")] == [down] + [[]] * (tp - 1)
    finally:
        group.stop()
