"""FP8 on publish (issue 23): wire bytes, quantise-on-publish throughput, whole refit BF16 vs FP8.

    python benchmarks/bench_fp8.py wire                    # CPU: wire bytes of real architectures
    python benchmarks/bench_fp8.py gpu --out fp8.json      # one GPU: throughput + colocated refits

``wire``: what an FP8 engine pulls against a BF16 one, for the parameter lists of real HF
architectures (built on the meta device from their configs, no weights): every weight
:func:`mx_refit.fp8.is_quantized_weight` selects becomes 1 byte per element plus one float32 per
128x128 block; everything else stays BF16. (tests/fp8 checks on real transfers that the bytes
pulled are exactly these.)

``gpu``: on cuda:0, (1) ``Fp8Publishing.convert`` (the publisher's quantisation, Triton kernel,
persistent buffers) over Qwen3-8B-shaped linear weights: GB/s of BF16 input, best of --reps after
a warm-up, after checking its bytes equal the CPU reference on a sample; (2) whole refits, trainer
and receiver processes colocated on GPU0 (``transport: auto`` -> CUDA IPC), once publishing bf16
into an ``hf_raw`` receiver and once fp8_block into an ``fp8_block`` receiver: the receiver's
refit wall time (``Receiver.refit``) and the publisher's quantise time per cycle.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import time

GB = 1e9
# Qwen3-8B's linear layers (hidden 4096, 32 q / 8 kv heads of 128, ffn 12288), per layer.
QWEN3_8B_LAYER = {
    "self_attn.q_proj.weight": (4096, 4096), "self_attn.k_proj.weight": (1024, 4096),
    "self_attn.v_proj.weight": (1024, 4096), "self_attn.o_proj.weight": (4096, 4096),
    "mlp.gate_proj.weight": (12288, 4096), "mlp.up_proj.weight": (12288, 4096), "mlp.down_proj.weight": (4096, 12288),
    "input_layernorm.weight": (4096,), "post_attention_layernorm.weight": (4096,),
}


def wire(models: list[str]) -> dict:
    import torch
    import transformers

    from mx_refit.fp8 import is_quantized_weight, scale_shape

    configs = {
        "Qwen3-8B": transformers.Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                             vocab_size=151936, tie_word_embeddings=False),
        "Qwen3-30B-A3B": transformers.Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                                     head_dim=128, num_experts=128, num_experts_per_tok=8,
                                                     vocab_size=151936, tie_word_embeddings=False),
    }
    out = {}
    for name in models:
        cfg = configs[name]
        cls = transformers.Qwen3MoeForCausalLM if "A3B" in name else transformers.Qwen3ForCausalLM
        with torch.device("meta"):
            model = cls(cfg)
        bf16 = fp8 = 0
        for pname, param in model.state_dict().items():
            shape = tuple(param.shape)
            bf16 += 2 * math.prod(shape)
            if len(shape) == 3 and ".experts." in pname:  # HF's fused experts: per expert on the wire
                fp8 += shape[0] * (math.prod(shape[1:]) + 4 * math.prod(scale_shape(shape[1:])))
            elif is_quantized_weight(pname, len(shape), "bfloat16"):
                fp8 += math.prod(shape) + 4 * math.prod(scale_shape(shape))
            else:
                fp8 += 2 * math.prod(shape)
        out[name] = {"bf16_bytes": bf16, "fp8_bytes": fp8, "ratio": fp8 / bf16}
        print(f"{name}: BF16 {bf16 / GB:.2f} GB, FP8 engine {fp8 / GB:.2f} GB, ratio {fp8 / bf16:.4f}", flush=True)
    return out


def _weights(layers: int, device: str, seed: int = 0) -> list:
    import torch

    from mx_refit.types import PublishedTensor

    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for layer in range(layers):
        for name, shape in QWEN3_8B_LAYER.items():
            t = torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
            out.append(PublishedTensor(f"model.layers.{layer}.{name}", t))
    return out


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def quantise_throughput(layers: int, reps: int, device: str) -> dict:
    import torch

    from mx_refit.fp8 import Fp8Publishing, _kernel_verified, quantize_reference

    tensors = _weights(layers, device)
    pub = Fp8Publishing()
    out = pub.convert(tensors)  # warm-up: allocation + Triton compile
    assert device == "cpu" or _kernel_verified(), "the Triton kernel did not load or failed its probe"
    by_name = {t.name: t.tensor for t in out}
    for t in tensors[:9]:  # one layer, every shape: the GPU bytes equal the CPU reference
        if t.tensor.dim() != 2:
            continue
        q, s = quantize_reference(t.tensor.cpu())
        assert torch.equal(by_name[t.name].cpu().view(torch.uint8), q.view(torch.uint8)), t.name
        assert torch.equal(by_name[t.name.removesuffix(".weight") + ".weight_scale_inv"].cpu(), s), t.name
    times = []
    for _ in range(reps):
        _sync(device)
        pub.convert(tensors)  # synchronises before returning, as before mark_ready
        times.append(pub.seconds)
    best = min(times)
    ref_t = []
    sample = [t.tensor for t in tensors if t.tensor.dim() == 2][:7]
    for _ in range(2):
        _sync(device)
        start = time.perf_counter()
        for x in sample:
            quantize_reference(x)
        _sync(device)
        ref_t.append(time.perf_counter() - start)
    sample_bytes = sum(x.numel() * 2 for x in sample)
    result = {"bf16_bytes": pub.bytes_in, "seconds": best, "gbps_bf16_input": pub.bytes_in / best / GB,
              "all_seconds": times, "torch_reference_gbps": sample_bytes / min(ref_t) / GB}
    print(f"quantise-on-publish: {pub.bytes_in / GB:.2f} GB BF16 in {best * 1e3:.1f} ms = "
          f"{result['gbps_bf16_input']:.0f} GB/s (torch reference: {result['torch_reference_gbps']:.0f} GB/s)", flush=True)
    return result


def _source(address: str, model: str, fmt: str, layers: int, cycles: int, device: str, q, read_q) -> None:
    from mx_refit.publisher import Publisher

    tensors = _weights(layers, device, seed=1)
    with Publisher(address, model, publish_format=fmt) as pub:
        for version in range(1, cycles + 1):
            if version > 1:
                read_q.get(timeout=600)  # the receiver read the previous version
                pub.wait_drained(version - 1, timeout_s=120)
            for t in tensors:
                t.tensor.mul_(1.0001)  # an optimizer step
            _sync(device)
            pub.publish(version, tensors)
            q.put(("published", version, pub.quantize_seconds))
        read_q.get(timeout=600)


def colocated_refit(layers: int, cycles: int, device: str) -> dict:
    from mx_refit.catalog import start_embedded
    from mx_refit.receive.receiver import Receiver
    from mx_refit.types import TargetLayout

    ctx = mp.get_context("spawn")
    server = start_embedded()
    out = {}
    try:
        for fmt, targets in (("bf16", ("hf_raw",)), ("fp8_block", ("fp8_block",))):
            model = f"bench-{fmt}"
            q, read_q = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(target=_source, args=(server.address, model, fmt, layers, cycles, device, q, read_q),
                               daemon=True)
            proc.start()
            rows = []
            with Receiver(server.address, model, device=device, target=TargetLayout(compile_targets=targets)) as rec:
                for version in range(1, cycles + 1):
                    _, v, quant_s = q.get(timeout=600)
                    _sync(device)
                    start = time.perf_counter()
                    result = rec.refit(version, wait_s=60)
                    _sync(device)
                    wall = time.perf_counter() - start
                    read_q.put(version)
                    s = result.stats
                    rows.append({"version": v, "refit_s": wall, "quantise_s": quant_s, "bytes_pulled": s.bytes_pulled,
                                 "transport": s.transport, "compile_target": s.compile_target, "phases": s.phase_seconds})
                    print(f"{fmt} v{v}: refit {wall * 1e3:.1f} ms, quantise {quant_s * 1e3:.1f} ms, "
                          f"{s.bytes_pulled / GB:.2f} GB over {s.transport}", flush=True)
            proc.join(60)
            steady = rows[1:] or rows
            out[fmt] = {"rows": rows, "refit_s": min(r["refit_s"] for r in steady),
                        "quantise_s": min(r["quantise_s"] for r in steady), "bytes_pulled": rows[-1]["bytes_pulled"]}
    finally:
        server.stop()
    bf, fp = out["bf16"], out["fp8_block"]
    out["ratio_refit"] = fp["refit_s"] / bf["refit_s"]
    out["ratio_refit_plus_quantise"] = (fp["refit_s"] + fp["quantise_s"]) / bf["refit_s"]
    out["ratio_bytes"] = fp["bytes_pulled"] / bf["bytes_pulled"]
    print(f"FP8 / BF16: refit {out['ratio_refit']:.3f}, refit + quantise {out['ratio_refit_plus_quantise']:.3f}, "
          f"bytes {out['ratio_bytes']:.3f}", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("wire", "gpu"))
    parser.add_argument("--models", default="Qwen3-8B,Qwen3-30B-A3B")
    parser.add_argument("--layers", type=int, default=16, help="Qwen3-8B-shaped layers (gpu; 16: 6.2 GB BF16)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda:0", help="gpu mode's device (cpu: a smoke run)")
    args = parser.parse_args()
    import torch

    results: dict = {"mode": args.mode, "python": platform.python_version(), "torch": torch.__version__}
    if args.mode == "wire":
        results["wire"] = wire(args.models.split(","))
    else:
        results["device"] = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
        results["quantise"] = quantise_throughput(args.layers, args.reps, args.device)
        results["colocated"] = colocated_refit(args.layers, args.cycles, args.device)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
