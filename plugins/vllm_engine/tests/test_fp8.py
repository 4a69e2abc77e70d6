"""FP8 (issue 23) against the real vllm package: mx-refit's block quantiser is vLLM's own
(``vllm.utils.deep_gemm.per_block_cast_to_fp8``, what vLLM's online block-FP8 quantisation runs)
byte for byte, a block-FP8 engine asks for ``fp8_block`` and a BF16 one for ``hf_raw``, and an
FP8 refit hands the engine exactly the checkpoint vLLM's quantiser would have written.

The model-level proof (a block-FP8 vLLM model loading a refit equals it loading the reference
FP8 checkpoint, TP 1 and 2) is ``test_fp8_load.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
from vllm.utils.deep_gemm import per_block_cast_to_fp8

from mx_refit import Publisher, Receiver
from mx_refit.errors import CompileTargetError
from mx_refit.fp8 import is_quantized_weight, quantize_reference, scale_name
from mx_refit.types import PublishedTensor
from mx_refit_vllm.layout import compile_form, target_layout

pytestmark = pytest.mark.timeout(300)

BLOCK_FP8 = Fp8Config(
    is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128]
)


@pytest.mark.parametrize("shape", [(256, 256), (300, 200), (128, 1000), (1, 129), (1024, 768)])
@pytest.mark.parametrize("scale", [0.02, 7.0])
def test_the_reference_quantiser_is_vllms_per_block_cast(shape: tuple[int, int], scale: float) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * scale).to(torch.bfloat16)
    x[: min(128, shape[0]), : min(128, shape[1])] = 0  # an all-zero block: the clamp
    q_vllm, s_vllm = per_block_cast_to_fp8(x, [128, 128], use_ue8m0=False)
    q, s = quantize_reference(x)
    assert q.dtype == q_vllm.dtype == torch.float8_e4m3fn
    assert torch.equal(q.view(torch.uint8), q_vllm.view(torch.uint8))
    assert torch.equal(s, s_vllm)


def test_engines_ask_for_the_form_their_quantisation_loads() -> None:
    assert compile_form(None) == (("hf_raw",), {})
    assert compile_form(BLOCK_FP8) == (("fp8_block",), {"block_size": "128,128"})
    # vLLM 0.33's online FP8 (quantising BF16 at load) is other config classes: they keep hf_raw.
    with pytest.raises(ValueError, match="no longer supports online quantization"):
        Fp8Config(is_checkpoint_fp8_serialized=False, activation_scheme="dynamic")
    per_tensor = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic")
    assert compile_form(per_tensor) == (("fp8_tensor",), {})  # no publisher offers it: refused, never cast
    layout = target_layout(SimpleNamespace(), BLOCK_FP8)
    assert layout.compile_targets == ("fp8_block",)
    assert layout.required_metadata == (("block_size", "128,128"),)
    assert target_layout(SimpleNamespace()).compile_targets == ("hf_raw",)


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    shapes = {
        "model.embed_tokens.weight": (300, 256),
        "model.layers.0.self_attn.qkv_proj.weight": (512, 256),
        "model.layers.0.self_attn.o_proj.weight": (256, 256),
        "model.layers.0.mlp.down_proj.weight": (256, 384),
        "model.layers.0.input_layernorm.weight": (256,),
        "lm_head.weight": (300, 256),
    }
    return {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}


def test_an_fp8_engine_receives_vllms_checkpoint_and_a_bf16_engine_refuses_it(
    mx_catalog: str, mx_model_name: str
) -> None:
    weights = _weights()
    with Publisher(mx_catalog, mx_model_name, publish_format="fp8_block") as pub:
        pub.publish(1, [PublishedTensor(n, t) for n, t in weights.items()])
        with Receiver(mx_catalog, mx_model_name, target=target_layout(SimpleNamespace(), BLOCK_FP8)) as rec:
            got = dict(rec.refit(1).tensors)
        checkpoint: dict[str, torch.Tensor] = {}
        for name, tensor in weights.items():  # what vLLM's quantiser writes for the same weights
            if is_quantized_weight(name, tensor.dim(), "bfloat16"):
                q, s = per_block_cast_to_fp8(tensor, [128, 128], use_ue8m0=False)
                checkpoint[name], checkpoint[scale_name(name)] = q, s
            else:
                checkpoint[name] = tensor
        assert set(got) == set(checkpoint)
        for name, want in checkpoint.items():
            assert got[name].dtype == want.dtype, name
            assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name
        with Receiver(mx_catalog, mx_model_name, target=target_layout(SimpleNamespace())) as bf16_engine:
            wanted = r"offered as compile target 'fp8_block', but this receiver wants 'hf_raw'"
            with pytest.raises(CompileTargetError, match=wanted):
                bf16_engine.refit(1)
