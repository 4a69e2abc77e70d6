"""Planner bookkeeping speed on a Qwen3-30B-A3B-shaped manifest (no weights allocated).

Synthesizes the descriptors a Megatron job with the given TP/PP/EP/ETP grid would publish for
Qwen3-30B-A3B (48 layers, 128 experts, hidden 2048, 32 query heads, 4 KV groups, head_dim 128,
moe_ffn 768, vocab 151936: 18,867 HF tensors) with fake addresses, then times
``plan_receive`` + computing every materialize spec (``tensor_specs``; no memory touched) for
several receiver layouts, on one core. Prints one JSON object.

    python benchmarks/bench_planner.py                      # TP4 x DP2 ranks, EP8 (8 sources)
    python benchmarks/bench_planner.py --dp 4 --ep 4        # 16 sources, experts on 4 ranks each
    python benchmarks/bench_planner.py --baseline-ref ef779e0 --rounds 5   # old code, same run
    python benchmarks/bench_planner.py --baseline-ref ef779e0 --rounds 15 --cases tp8

``--baseline-ref`` times the planner of another commit (its ``core/src``, extracted with
``git archive``) on the same manifest in the same run: both are run ``--rounds`` times,
alternating, each in a fresh process, and every case reports the best round's median.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# --src DIR times the planner found there (the baseline of --baseline-ref); default: this checkout.
_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else None
sys.path.insert(0, _SRC or str(Path(__file__).resolve().parents[1] / "core" / "src"))

from mx_refit.layout.planner import plan_receive  # noqa: E402 (after the path above)
from mx_refit.types import (  # noqa: E402
    MeshPosition,
    Role,
    SourceInfo,
    TargetLayout,
    TensorDescriptor,
    VersionInfo,
    VersionState,
)

QWEN3_30B_A3B: dict[str, Any] = {
    "num_layers": 48,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_query_groups": 4,
    "kv_channels": 128,
    "ffn_hidden_size": 6144,
    "moe_ffn_hidden_size": 768,
    "num_moe_experts": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
QWEN3_8B: dict[str, Any] = {
    "num_layers": 36,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_query_groups": 8,
    "kv_channels": 128,
    "ffn_hidden_size": 12288,
    "num_moe_experts": 0,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
BF16 = 2


def manifest(tp: int, pp: int, dp: int, ep: int, etp: int = 1, config: dict[str, Any] | None = None) -> VersionInfo:
    """Descriptors of every rank of a Megatron job with TP x PP x DP ranks and MoE parallel
    folding: per stage, expert ranks (ETP fastest, then EP) are carved out of the TP x DP ranks,
    so a rank holds its TP shard of every dense tensor (replicated over DP) and the experts of its
    EP rank (replicated over the expert-DP ranks, split over ETP). ``config`` with
    ``num_moe_experts: 0`` (e.g. :data:`QWEN3_8B`) gives a dense model (gated MLP per layer)."""
    if (tp * dp) % (ep * etp):
        raise SystemExit(f"EP {ep} x ETP {etp} must divide TP {tp} x DP {dp}")
    c = config or QWEN3_30B_A3B
    h, heads, groups, d = c["hidden_size"], c["num_attention_heads"], c["num_query_groups"], c["kv_channels"]
    layers, experts, moe_ffn = c["num_layers"], c["num_moe_experts"], c.get("moe_ffn_hidden_size", 0)
    padded_vocab = -(-c["vocab_size"] // (128 * tp)) * (128 * tp)
    qkv_rows = (heads + 2 * groups) * d
    hf_map: dict[str, dict[str, object]] = {}
    # (name, role, global shape, split axis, split size, hf names, mapping, layer, expert)
    params: list[tuple] = []

    def add(name, role, shape, axis, split, hf, mapping, layer=None, expert=None):
        params.append((name, role, shape, axis, split, layer, expert))
        hf_map[name] = {"hf": hf, "mapping": mapping}

    add(
        "embedding.word_embeddings.weight",
        Role.VOCAB_PARALLEL,
        (padded_vocab, h),
        0,
        tp,
        ["model.embed_tokens.weight"],
        "AutoMapping",
    )
    for L in range(layers):
        m, p = f"decoder.layers.{L}.", f"model.layers.{L}."
        add(
            m + "self_attention.linear_qkv.layer_norm_weight",
            Role.REPLICATED,
            (h,),
            -1,
            1,
            [p + "input_layernorm.weight"],
            "AutoMapping",
            L,
        )
        add(
            m + "self_attention.linear_qkv.weight",
            Role.QKV_COLUMN,
            (qkv_rows, h),
            0,
            tp,
            [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
            "QKVMapping",
            L,
        )
        add(
            m + "self_attention.q_layernorm.weight",
            Role.REPLICATED,
            (d,),
            -1,
            1,
            [p + "self_attn.q_norm.weight"],
            "AutoMapping",
            L,
        )
        add(
            m + "self_attention.k_layernorm.weight",
            Role.REPLICATED,
            (d,),
            -1,
            1,
            [p + "self_attn.k_norm.weight"],
            "AutoMapping",
            L,
        )
        add(
            m + "self_attention.linear_proj.weight",
            Role.ROW,
            (h, heads * d),
            1,
            tp,
            [p + "self_attn.o_proj.weight"],
            "AutoMapping",
            L,
        )
        add(
            m + "pre_mlp_layernorm.weight",
            Role.REPLICATED,
            (h,),
            -1,
            1,
            [p + "post_attention_layernorm.weight"],
            "AutoMapping",
            L,
        )
        if not experts:  # dense: one gated MLP
            ffn = c["ffn_hidden_size"]
            add(m + "mlp.linear_fc1.weight", Role.GATED_MLP_COLUMN, (2 * ffn, h), 0, tp,
                [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], "GatedMLPMapping", L)
            add(m + "mlp.linear_fc2.weight", Role.ROW, (h, ffn), 1, tp, [p + "mlp.down_proj.weight"],
                "AutoMapping", L)
            continue
        add(
            m + "mlp.router.weight",
            Role.REPLICATED,
            (experts, h),
            -1,
            1,
            [p + "mlp.gate.weight"],
            "AutoMapping",
            L,
        )
        for e in range(experts):
            add(
                m + f"mlp.experts.linear_fc1.weight{e}",
                Role.EXPERT_COLUMN,
                (2 * moe_ffn, h),
                0,
                etp,
                [p + f"mlp.experts.{e}.gate_proj.weight", p + f"mlp.experts.{e}.up_proj.weight"],
                "GatedMLPMapping",
                L,
                e,
            )
            add(
                m + f"mlp.experts.linear_fc2.weight{e}",
                Role.EXPERT_ROW,
                (h, moe_ffn),
                1,
                etp,
                [p + f"mlp.experts.{e}.down_proj.weight"],
                "AutoMapping",
                L,
                e,
            )
    add("decoder.final_layernorm.weight", Role.REPLICATED, (h,), -1, 1, ["model.norm.weight"], "AutoMapping")
    add("output_layer.weight", Role.COLUMN, (padded_vocab, h), 0, tp, ["lm_head.weight"], "AutoMapping")

    sources = []
    per_stage, per_ep = layers // pp, max(experts // ep, 1)
    for s in range(pp):
        for q in range(tp * dp):
            t, e, et = q % tp, (q // etp) % ep, q % etp
            descs, addr = [], 0x7F00_0000_0000 + len(sources) * (1 << 36)
            for name, role, shape, axis, split, layer, expert in params:
                stage = (
                    layer // per_stage
                    if layer is not None
                    else (0 if name.startswith("embedding") else pp - 1)
                )
                if stage != s or (expert is not None and expert // per_ep != e):
                    continue
                rank = et if expert is not None else t
                local = list(shape)
                if split > 1:
                    local[axis] //= split
                nbytes = BF16
                for n in local:
                    nbytes *= n
                extras = {"tp_rank": rank, "tp_size": split} if split > 1 else {}
                if expert is not None:
                    extras["expert_id"] = expert
                descs.append(
                    TensorDescriptor(
                        name=name,
                        dtype="bfloat16",
                        global_shape=shape,
                        local_shape=tuple(local),
                        addr=addr,
                        nbytes=nbytes,
                        role=role,
                        shard_axis=axis if split > 1 else -1,
                        shard_offset=rank * local[axis] if split > 1 else 0,
                        extras=extras,
                    )
                )
                addr += (nbytes + 511) // 512 * 512  # a contiguous parameter buffer, 512 B aligned
            mesh = MeshPosition(tp_rank=t, tp_size=tp, pp_rank=s, pp_size=pp, ep_rank=e, ep_size=ep)
            sources.append(
                SourceInfo(f"pp{s}-rank{q}", mesh, f"agent-{len(sources)}", b"", tuple(descs), True)
            )
    config = {**c, "padded_vocab_size": padded_vocab}
    return VersionInfo(
        "qwen3-30b-a3b" if experts else "qwen3-8b",
        1,
        VersionState.READY,
        len(sources),
        tuple(sources),
        {"megatron.config": config, "megatron.hf_map": hf_map},
    )


def time_plan(version: VersionInfo, target: TargetLayout, repeat: int) -> dict[str, object]:
    """``plan_receive`` (everything ``materialize`` needs, reads included) and, separately, the
    flat ``tensor_specs()`` list and freeing the previous plan; wall and CPU time, best and
    median of ``repeat`` runs."""
    wall, cpu, spec_cpu, free_cpu = [], [], [], []
    plan = None
    specs: list = []
    for _ in range(repeat):
        # The previous round's plan is freed first, outside the timed planning (tens of
        # thousands of small objects: ~5 ms on the 2-core CI machine), and timed on its own.
        f0 = time.process_time()
        plan = None
        specs = []
        free_cpu.append(time.process_time() - f0)
        gc.collect()
        w0, c0 = time.perf_counter(), time.process_time()
        plan = plan_receive(version, target)
        reads = plan.reads
        w1, c1 = time.perf_counter(), time.process_time()
        specs = plan.tensor_specs()
        spec_cpu.append(time.process_time() - c1)
        wall.append(w1 - w0)
        cpu.append(c1 - c0)
    assert plan is not None

    def ms(samples: list[float]) -> dict[str, float]:
        return {"median": round(statistics.median(samples) * 1e3, 2), "min": round(min(samples) * 1e3, 2)}

    return {
        "target": {
            k: getattr(target, k) for k in ("tp_size", "tp_rank", "ep_size", "ep_rank", "full_tensors")
        },
        "plan_cpu_ms": ms(cpu),
        "plan_wall_ms": ms(wall),
        "tensor_specs_cpu_ms": ms(spec_cpu),
        "free_previous_plan_cpu_ms": ms(free_cpu[1:] or free_cpu),
        "plan_plus_specs_cpu_ms_median": round(
            (statistics.median(cpu) + statistics.median(spec_cpu)) * 1e3, 2
        ),
        "hf_tensors": len(specs),
        "reads": len(reads),
        "staged_copies": sum(s.copies for s in specs),
        "bytes_needed": plan.bytes_needed,
        "bytes_pulled": plan.bytes_pulled,
        "arena_bytes": plan.arena_bytes,
    }


def calibration_ms() -> float:
    """A fixed pure-Python loop (1M additions), to compare machines: best of 5, CPU time."""
    best = float("inf")
    for _ in range(5):
        c0, x = time.process_time(), 0
        for i in range(1_000_000):
            x += i
        best = min(best, time.process_time() - c0)
    return round(best * 1e3, 1)


def compare(args: argparse.Namespace) -> None:
    """This checkout against ``--baseline-ref``, alternating fresh processes; one JSON object."""
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parents[1]
    common = [f"--{k}={getattr(args, k)}" for k in ("tp", "pp", "dp", "ep", "etp", "repeat", "cases")]
    runs: dict[str, list[dict[str, Any]]] = {"current": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(root), "archive", args.baseline_ref, "core/src"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        sources = {"current": str(root / "core" / "src"), "baseline": str(Path(tmp) / "core" / "src")}
        for _ in range(args.rounds):
            for label in ("baseline", "current"):
                out = subprocess.run([sys.executable, __file__, "--src", sources[label], *common],
                                     check=True, capture_output=True, text=True).stdout
                runs[label].append(json.loads(out))
    cases = []
    for i, case in enumerate(runs["current"][0]["cases"]):
        best = {label: min(r["cases"][i]["plan_cpu_ms"]["median"] for r in rs) for label, rs in runs.items()}
        cases.append({"target": case["target"], "reads": case["reads"], "plan_cpu_ms_median_best_round": best,
                      "ratio_current_vs_baseline": round(best["current"] / best["baseline"], 3)})
    print(json.dumps({
        "benchmark": "planner, current vs baseline in the same run",
        "baseline_ref": args.baseline_ref,
        "rounds": args.rounds,
        "cases": cases,
        "calibration_loop_ms": [r["calibration_loop_ms"] for r in runs["current"]],
        "python": platform.python_version(),
    }, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--etp", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--budget-ms", type=float, default=50.0)
    parser.add_argument("--src", default=None, help="core/src to time (default: this checkout's)")
    parser.add_argument("--baseline-ref", default=None, help="also time this git commit's planner")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds with --baseline-ref")
    parser.add_argument("--cases", default="full,tp4,tp2ep8,tp8",
                        help="comma-separated receiver cases to time (default: all four)")
    args = parser.parse_args()
    if args.baseline_ref:
        compare(args)
        return
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as specified

    version = manifest(args.tp, args.pp, args.dp, args.ep, args.etp)
    known = {
        "full": TargetLayout(full_tensors=True),
        "tp4": TargetLayout(tp_size=4, tp_rank=1, full_tensors=False),
        "tp2ep8": TargetLayout(tp_size=2, tp_rank=0, ep_size=8, ep_rank=3, full_tensors=False),
        "tp8": TargetLayout(tp_size=8, tp_rank=5, full_tensors=False),
    }
    unknown = [c for c in args.cases.split(",") if c not in known]
    if unknown:
        raise SystemExit(f"--cases: unknown case(s) {unknown}; known: {sorted(known)}")
    cases = [known[c] for c in args.cases.split(",")]
    results = [time_plan(version, target, args.repeat) for target in cases]
    worst = max(r["plan_cpu_ms"]["median"] for r in results)  # type: ignore[index]
    print(
        json.dumps(
            {
                "benchmark": "planner",
                "model": "Qwen3-30B-A3B (synthetic manifest, no weights)",
                "source": {
                    "tp": args.tp,
                    "pp": args.pp,
                    "dp": args.dp,
                    "ep": args.ep,
                    "etp": args.etp,
                    "sources": len(version.sources),
                    "descriptors": sum(len(s.tensors) for s in version.sources),
                },
                "hf_tensors_total": sum(len(v["hf"]) for v in version.sidecar["megatron.hf_map"].values()),
                "cases": results,
                "worst_plan_cpu_ms_median": worst,
                "budget_ms": args.budget_ms,
                "within_budget": worst <= args.budget_ms,
                "calibration_loop_ms": calibration_ms(),
                "python": platform.python_version(),
                "cpu": platform.processor() or platform.machine(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
