"""FP8 on publish (issue 23), end to end on CPU: a real Publisher quantises BF16 linear weights
into persistent FP8 + 128x128 scale buffers, a real catalog (gRPC) and real NIXL carry them, and
the receiver's compile-target filter takes or refuses the version."""

from __future__ import annotations

import pytest
import torch

from mx_refit.errors import CompileTargetError, InvalidArgument
from mx_refit.fp8 import BLOCK_METADATA, quantize_reference, scale_name
from mx_refit.publisher import Publisher
from mx_refit.receive.receiver import Receiver
from mx_refit.types import CompileCompat, PublishedTensor, Role, TargetLayout

pytestmark = pytest.mark.timeout(180)

FP8_TARGET = TargetLayout(compile_targets=("fp8_block",), required_metadata={"block_size": "128,128"})


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).bfloat16()

    return {
        "model.embed_tokens.weight": w(300, 256),
        "model.layers.0.input_layernorm.weight": w(256),
        "model.layers.0.self_attn.q_proj.weight": w(256, 256),
        "model.layers.0.self_attn.o_proj.weight": w(256, 256),
        "model.layers.0.mlp.gate_proj.weight": w(384, 256),
        "model.layers.0.mlp.down_proj.weight": w(256, 200),  # a ragged last block
        "model.layers.0.mlp.gate.weight": w(8, 256),  # a router: stays BF16
        "lm_head.weight": w(300, 256),
    }


QUANTISED = {"q_proj", "o_proj", "gate_proj", "down_proj"}


def _is_quantised(name: str) -> bool:
    return any(f".{part}.weight" in name for part in QUANTISED)


def test_fp8_refit_equals_the_reference_quantiser_and_keeps_the_rest_bf16(mx_catalog: str, mx_model_name: str) -> None:
    weights = _model(1)
    published = [PublishedTensor(n, t) for n, t in weights.items()]
    with Publisher(mx_catalog, mx_model_name, publish_format="fp8_block") as pub, \
            Receiver(mx_catalog, mx_model_name, target=FP8_TARGET) as rec:
        pub.publish(1, published)
        assert pub.quantize_seconds > 0
        result = rec.refit(1)
        got = dict(result.tensors)
        assert result.stats.compile_target == "fp8_block"
        for name, tensor in weights.items():
            if _is_quantised(name):
                q, s = quantize_reference(tensor)
                assert got[name].dtype == torch.float8_e4m3fn
                assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
                assert torch.equal(got[scale_name(name)], s), name
            else:
                assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], tensor), name
        assert scale_name("model.layers.0.mlp.gate.weight") not in got
        # Version 2 after an optimizer step: the same buffers (no new registration), new bytes.
        pub.wait_drained(1, timeout_s=30)
        for t in weights.values():
            t.mul_(1.5)
        pub.publish(2, published)
        second = rec.refit(2)
        assert second.stats.new_registrations == 0
        name = "model.layers.0.mlp.down_proj.weight"
        assert torch.equal(dict(second.tensors)[scale_name(name)], quantize_reference(weights[name])[1])
        # Wire bytes: what an FP8 engine pulls for the quantised weights vs their BF16 bytes.
        lin = [n for n in weights if _is_quantised(n)]
        bf16 = sum(weights[n].numel() * 2 for n in lin)
        fp8 = sum(got[n].numel() + got[scale_name(n)].numel() * 4 for n in lin)
        assert fp8 <= 0.52 * bf16


def test_a_bf16_receiver_refuses_an_fp8_version_naming_tensor_offered_and_wanted(mx_catalog: str, mx_model_name: str) -> None:
    weights = _model(2)
    engine: dict[str, torch.Tensor] = {}
    with Publisher(mx_catalog, mx_model_name, publish_format="fp8_block") as pub, \
            Receiver(mx_catalog, mx_model_name, engine=engine) as rec:
        pub.publish(1, [PublishedTensor(n, t) for n, t in weights.items()])
        with pytest.raises(CompileTargetError, match=r"tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' is offered as "
                                                     r"compile target 'fp8_block', but this receiver wants 'hf_raw'"):
            rec.refit(1)
        assert engine == {}  # nothing loaded


def test_an_fp8_receiver_refuses_a_bf16_version_and_wrong_metadata(mx_catalog: str, mx_model_name: str) -> None:
    weights = _model(3)
    with Publisher(mx_catalog, mx_model_name) as pub:
        pub.publish(1, [PublishedTensor(n, t) for n, t in weights.items()])
        with Receiver(mx_catalog, mx_model_name, target=FP8_TARGET) as rec:
            wanted = r"offered as compile target 'hf_raw', but this receiver wants 'fp8_block'"
            with pytest.raises(CompileTargetError, match=wanted):
                rec.refit(1)
    with Publisher(mx_catalog, mx_model_name + "-b", publish_format="fp8_block") as pub:
        pub.publish(1, [PublishedTensor(n, t) for n, t in weights.items()])
        other_block = TargetLayout(compile_targets=("fp8_block",), required_metadata={"block_size": "64,64"})
        with Receiver(mx_catalog, mx_model_name + "-b", target=other_block) as rec:
            wanted = r"compile_metadata\['block_size'\] = '128,128', but this receiver wants '64,64'"
            with pytest.raises(CompileTargetError, match=wanted):
                rec.refit(1)
        other_runtime = TargetLayout(compile_targets=("fp8_block",), compat=CompileCompat(compile_config_digest="other"))
        with Receiver(mx_catalog, mx_model_name + "-b", target=other_runtime) as rec:
            wanted = r"another runtime: compile_config_digest: 'fp8_block:[0-9a-f]+' offered, 'other' wanted"
            with pytest.raises(CompileTargetError, match=wanted):
                rec.refit(1)


def test_a_shard_that_cuts_a_block_is_refused_when_publishing_fp8(mx_catalog: str, mx_model_name: str) -> None:
    shard = (torch.randn(96, 256) * 0.02).bfloat16()
    tensor = PublishedTensor("model.layers.0.mlp.gate_proj.weight", shard, Role.COLUMN, (192, 256), 0, 96)
    with Publisher(mx_catalog, mx_model_name, publish_format="fp8_block") as pub:
        with pytest.raises(InvalidArgument, match=r"shard \[96, 192\) of dim 0 \(of 192\) cuts a 128x128 FP8 block"):
            pub.publish(1, [tensor])


def test_publish_format_is_checked() -> None:
    with pytest.raises(InvalidArgument, match=r"publish_format: 'fp8' \(expected 'bf16' or 'fp8_block'\)"):
        Publisher("127.0.0.1:1", "m", publish_format="fp8")
    assert BLOCK_METADATA["block_size"] == "128,128"


def test_the_revision_is_content_addressed_and_compat_is_stated(mx_catalog: str, mx_model_name: str) -> None:
    weights = _model(4)
    published = [PublishedTensor(n, t) for n, t in weights.items()]
    with Publisher(mx_catalog, mx_model_name, publish_format="fp8_block", checksums=True) as pub:
        revisions = []
        for version in (1, 2, 3):
            if version > 1:
                pub.wait_drained(version - 1, timeout_s=30)
            if version == 3:
                next(iter(weights.values())).add_(1.0)  # new bytes
            pub.publish(version, published)
            source = pub.client.get_version(mx_model_name, version).sources[0]
            revisions.append(source.revision)
            assert source.compat is not None and source.compat.compile_config_digest.startswith("fp8_block:")
    assert revisions[0] == revisions[1] != revisions[2] and revisions[0].startswith("b2p:")
    with Publisher(mx_catalog, mx_model_name + "-plain") as plain:
        plain.publish(1, published)
        source = plain.client.get_version(mx_model_name + "-plain", 1).sources[0]
        assert source.revision == "" and source.compat is None  # nothing stated without checksums / FP8
