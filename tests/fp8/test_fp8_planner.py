"""FP8 weights and their scale grids through the Megatron receive planner (issue 23).

Megatron-native shards (fused QKV, [gate; up] fc1, row-parallel o/down, grouped experts) are
quantised per shard by the publisher's own code (mx_refit.fp8.Fp8Publishing), laid out in fake
source memory, planned for several target TP layouts and executed byte for byte: every HF FP8
weight and weight_scale_inv a worker holds equals vLLM's per-block cast of the full HF BF16
tensor (mx_refit.fp8.quantize_reference, equal to vllm.utils.deep_gemm.per_block_cast_to_fp8,
see plugins/vllm_engine/tests/test_fp8_reference.py), windowed the way vLLM shards it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mx_refit.compile_targets import check_compile_targets
from mx_refit.errors import InvalidArgument
from mx_refit.fp8 import BLOCK, Fp8Publishing, is_quantized_weight, quantize_reference, scale_name
from mx_refit.layout.planner import plan_receive
from mx_refit.publisher import describe
from mx_refit.types import PublishedTensor, SourceInfo, TargetLayout
from tests.layout._planner_harness import ModelSpec, Published, SourceLayout, execute, expected_window, publish

DENSE = ModelSpec("fp8-dense", layers=2, hidden=256, heads=4, groups=2, head_dim=128, ffn=512, vocab=300)
MOE = ModelSpec("fp8-moe", layers=1, hidden=256, heads=4, groups=2, head_dim=128, experts=4, moe_ffn=256, vocab=300)


def _fp8_version(published: Published) -> tuple[Published, dict[str, Fp8Publishing]]:
    """The same shards as each source's publisher would publish them with fp8_block."""
    sources, memory, pubs = [], {}, {}
    sidecar = dict(published.version.sidecar)
    for src in published.version.sources:
        base, raw = published.memory[src.source_id]
        tensors = []
        for d in src.tensors:
            lo = d.addr - base
            local = raw[lo:lo + d.nbytes].view(getattr(torch, d.dtype)).view(d.local_shape)
            tensors.append(PublishedTensor(d.name, local.clone(), d.role, d.global_shape, d.shard_axis, d.shard_offset,
                                           dict(d.extras)))
        pub = pubs[src.source_id] = Fp8Publishing()
        out = pub.convert(tensors)
        side = {"megatron.hf_map": dict(published.version.sidecar["megatron.hf_map"])}
        pub.extend_sidecar(side)
        sidecar["megatron.hf_map"] = {**sidecar["megatron.hf_map"], **side["megatron.hf_map"]}
        chunks, descs, offset = [], [], 0
        for t in out:
            data = t.tensor.contiguous().view(-1).view(torch.uint8)
            descs.append(dataclasses.replace(describe(t), addr=base + offset))
            chunks.append(data)
            offset += data.numel()
        memory[src.source_id] = (base, torch.cat(chunks))
        sources.append(SourceInfo(src.source_id, src.mesh, src.agent_name, b"", tuple(descs), ready=True))
    version = dataclasses.replace(published.version, sources=tuple(sources), sidecar=sidecar)
    return Published(version, memory, published.hf, published.params), pubs


def _check(published: Published, spec: ModelSpec, target: TargetLayout) -> int:
    plan = plan_receive(published.version, target)
    got = dict(plan.materialize(execute(plan, published.memory)))
    blocks = dataclasses.replace(spec, head_dim=spec.head_dim // BLOCK)
    quantised = 0
    for name, full in published.hf.items():
        if is_quantized_weight(name, full.dim(), "bfloat16"):
            q, s = quantize_reference(full)
            want_q, want_s = expected_window(name, q, spec, target), expected_window(name, s, blocks, target)
            if want_q is None:
                assert name not in got and scale_name(name) not in got
                continue
            assert got[name].dtype == torch.float8_e4m3fn, name
            assert torch.equal(got[name].contiguous().view(torch.uint8), want_q.contiguous().view(torch.uint8)), name
            assert torch.equal(got[scale_name(name)], want_s), name
            quantised += 1
        else:
            want = expected_window(name, full, spec, target)
            if want is not None:
                assert torch.equal(got[name], want), name
    return quantised


@pytest.mark.parametrize("source_tp", [1, 2])
@pytest.mark.parametrize(
    "target",
    [TargetLayout(), TargetLayout(tp_size=2, tp_rank=1, full_tensors=False),
     TargetLayout(tp_size=4, tp_rank=2, full_tensors=False)],
    ids=["full", "tp2r1", "tp4r2"],
)
def test_dense_fp8_weights_and_scales_equal_vllms_cast_of_the_hf_tensor_for_any_target_tp(
    source_tp: int, target: TargetLayout
) -> None:
    published, _ = _fp8_version(publish(DENSE, SourceLayout(tp=source_tp)))
    fp8 = dataclasses.replace(target, compile_targets=("fp8_block",))
    assert check_compile_targets(published.version, fp8) == "fp8_block"
    assert _check(published, DENSE, target) == DENSE.layers * 7  # q k v o gate up down per layer


@pytest.mark.parametrize("target", [TargetLayout(), TargetLayout(tp_size=2, tp_rank=0, full_tensors=False),
                                    TargetLayout(ep_size=2, ep_rank=1, full_tensors=False)], ids=["full", "tp2", "ep2"])
def test_moe_expert_fp8_weights_and_scales(target: TargetLayout) -> None:
    published, _ = _fp8_version(publish(MOE, SourceLayout(tp=2, ep=2)))
    assert _check(published, MOE, target) > 0


def test_a_target_tp_that_cuts_a_block_is_refused_naming_the_tensor() -> None:
    spec = dataclasses.replace(DENSE, ffn=384)  # gate/up of 384 rows: 3 blocks, not two halves of whole blocks
    published, _ = _fp8_version(publish(spec, SourceLayout(tp=1)))
    wanted = r"linear_fc1\.weight_scale_inv.*gate/up rows: extent 3 does not divide by target TP size 2"
    with pytest.raises(InvalidArgument, match=wanted):
        plan_receive(published.version, TargetLayout(tp_size=2, tp_rank=0, full_tensors=False))
    _check(published, spec, TargetLayout())  # whole tensors: vLLM's loader refuses TP itself


def test_a_head_dim_below_the_block_is_refused() -> None:
    spec = dataclasses.replace(DENSE, heads=8, groups=4, head_dim=64, hidden=256)
    published, _ = _fp8_version(publish(spec, SourceLayout(tp=1)))
    with pytest.raises(InvalidArgument, match=r"head_dim 64 is not a multiple of the 128-row block"):
        plan_receive(published.version, TargetLayout())


def test_the_wire_bytes_of_an_fp8_version_are_at_most_052_of_bf16() -> None:
    bf16 = publish(DENSE, SourceLayout(tp=2))
    fp8, _ = _fp8_version(bf16)

    def linear_bytes(p: Published) -> int:
        plan = plan_receive(p.version, TargetLayout())
        return plan.bytes_needed

    # The whole model (embeddings, LM head and norms stay BF16) and the quantised layers alone.
    ratio = linear_bytes(fp8) / linear_bytes(bf16)
    hf = bf16.hf
    lin = [n for n, t in hf.items() if is_quantized_weight(n, t.dim(), "bfloat16")]
    lin_bf16 = sum(hf[n].numel() * 2 for n in lin)
    lin_fp8 = sum(hf[n].numel() + 4 * quantize_reference(hf[n])[1].numel() for n in lin)
    assert lin_fp8 / lin_bf16 <= 0.52
    assert ratio < 0.75, ratio  # this toy model is embedding-heavy; BENCHMARKS.md has a real one
