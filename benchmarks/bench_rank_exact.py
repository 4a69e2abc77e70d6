"""Wire bytes and receive-arena bytes per vLLM TP rank: whole HF tensors vs rank-exact (planning
only, no weights allocated, no transfer).

The manifest is bench_planner's Megatron job (trainer TP4 x DP2 ranks, bf16): ``--model
qwen3-8b`` (dense, 36 layers, untied vocabulary of 151,936) or ``qwen3-30b-a3b`` (EP8, 48
layers, 128 experts; 18,867 HF tensors). For each receiver TP size and rank the planner is
asked for three targets and reports ``bytes_pulled`` (wire) and ``arena_bytes`` (receive memory
outside the parameters):

* ``full``: ``full_tensors=True``, what the vLLM plugin asked for before issue 21;
* ``plugin``: what the vLLM plugin asks for now: every tensor as the rank's window (dense
  modules and, since the parameter map places vLLM's fused-MoE ``w13``/``w2`` stacks, the
  experts TP-sliced); for an unquantized model on a Triton MoE backend nothing is pulled whole;
* ``moe_whole`` (MoE model only): the fused-MoE experts whole (``whole_prefixes``), what the
  plugin asked for before it placed ``FusedMoE`` parameters, and still its fallback for an
  unproven MoE module;
* ``ep`` (MoE model only): vLLM with expert parallelism over the TP ranks (the layout announces
  EP): the rank's contiguous block of whole experts, dense modules TP-sliced.

    python benchmarks/bench_rank_exact.py --table                         # Qwen3-8B, TP 1, 2, 4, 8
    python benchmarks/bench_rank_exact.py --model qwen3-30b-a3b --table --rank0-only  # the MoE model
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "core" / "src"))

from mx_refit.layout.planner import plan_receive  # noqa: E402
from mx_refit.types import TargetLayout  # noqa: E402


def _bench_planner():
    spec = importlib.util.spec_from_file_location("mx_refit_bench_planner", HERE / "bench_planner.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(tp_sizes: list[int], model: str, rank0_only: bool = False) -> dict[str, object]:
    planner = _bench_planner()
    if model == "qwen3-8b":
        version = planner.manifest(tp=4, pp=1, dp=2, ep=1, config=planner.QWEN3_8B)
        experts: tuple[str, ...] = ()
    else:
        version = planner.manifest(tp=4, pp=1, dp=2, ep=8)
        layers = planner.QWEN3_30B_A3B["num_layers"]
        experts = tuple(f"model.layers.{L}.mlp.experts." for L in range(layers))
    rows = []
    for tp in tp_sizes:
        for rank in range(1 if rank0_only else tp):
            targets = {
                "full": TargetLayout(tp_rank=rank, tp_size=tp),
                "plugin": TargetLayout(tp_rank=rank, tp_size=tp, full_tensors=False),
            }
            if experts:
                targets["moe_whole"] = TargetLayout(
                    tp_rank=rank, tp_size=tp, full_tensors=False, whole_prefixes=experts
                )
                targets["ep"] = TargetLayout(
                    tp_rank=rank, tp_size=tp, ep_rank=rank, ep_size=tp, full_tensors=False
                )
            row: dict[str, object] = {"tp": tp, "rank": rank}
            for kind, target in targets.items():
                plan = plan_receive(version, target)
                row[f"{kind}_wire"] = plan.bytes_pulled
                row[f"{kind}_arena"] = plan.arena_bytes
            rows.append(row)
    return {"model": f"{model}-shaped (bench_planner.manifest, trainer tp4 x dp2, bf16)", "rows": rows}


def table(result: dict[str, object]) -> str:
    gib = float(1 << 30)
    rows = result["rows"]  # type: ignore[index]
    kinds = [k for k in ("full", "moe_whole", "plugin", "ep") if f"{k}_wire" in rows[0]]  # type: ignore[index]
    lines = [
        "| TP | rank | " + " | ".join(f"{k} wire / arena GiB" for k in kinds) + " | plugin / full |",
        "|---|---|" + "---|" * (len(kinds) + 1),
    ]
    for r in rows:  # type: ignore[attr-defined]
        cells = " | ".join(f"{r[f'{k}_wire'] / gib:.2f} / {r[f'{k}_arena'] / gib:.2f}" for k in kinds)
        lines.append(f"| {r['tp']} | {r['rank']} | {cells} | {r['plugin_wire'] / r['full_wire']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", default="1,2,4,8", help="receiver TP sizes, comma separated")
    parser.add_argument("--table", action="store_true", help="also print a Markdown table (stderr)")
    parser.add_argument("--model", choices=("qwen3-8b", "qwen3-30b-a3b"), default="qwen3-8b")
    parser.add_argument("--rank0-only", action="store_true", help="only rank 0 of each TP size")
    args = parser.parse_args()
    result = measure([int(t) for t in args.tp.split(",")], args.model, args.rank0_only)
    if args.table:
        print(table(result), file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
