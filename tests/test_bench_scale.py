"""benchmarks/bench_scale.py on CPU at tiny size, and its synthetic Megatron layout against
Megatron-Bridge's merge functions.

The benchmark runs end to end as a subprocess: 2 trainer processes (TP=2) publish through the real
embedded catalog and NIXL (UCX on loopback, DRAM), receivers at TP=2 and TP=1 pull, and every HF
tensor they materialise is compared with the regenerated export.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _megatron_synth as synth  # noqa: E402

from mx_refit.types import Role, TargetLayout  # noqa: E402

pytestmark = pytest.mark.timeout(240)

TINY = ["--scale", "0.0001", "--dense-layers", "1", "--moe-layers", "2", "--experts", "16"]  # ~3.4 MiB


def test_bench_scale_cpu_tp2_to_tp2_and_tp1(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_scale.py"), "--device", "cpu",
           "--trainer-layout", "tp2", "--cases", "tp2,tp1", *TINY, "--cycles", "2", "--repeats", "2",
           "--timeout-s", "120", "--out", str(out)]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    result = json.loads(out.read_text())
    assert result["ok"] is True
    shape = synth.ModelShape.scaled(0.0001, dense_layers=1, moe_layers=2, experts=16)
    assert result["config"]["model_bytes"] == synth.model_bytes(shape) > 2 << 20
    assert set(result["cases"]) == {"tp2", "tp1"}
    for label, workers in (("tp2", 2), ("tp1", 1)):
        case = result["cases"][label]
        targets = [TargetLayout(tp_rank=r, tp_size=workers, full_tensors=False) for r in range(workers)]
        per_cycle = sum(len(synth.expected_windows(shape, t)) for t in targets)
        # Every expected HF tensor, every worker, every cycle: byte-identical, nothing missing.
        assert case["tensors_checked"] == case["identical"] == 2 * per_cycle, label
        assert case["mismatched"] == case["missing"] == case["unexpected"] == 0, label
        # TP=2 sources -> TP=2 or TP=1 targets: every read is contiguous, so the planner promises
        # exactly the needed bytes on the wire.
        assert case["exact_promised"] is True
        assert case["wire_equals_needed"] is True and case["needed_matches_independent"] is True
        assert case["wire_bytes"] == case["needed_bytes"] == sum(synth.window_bytes(shape, t) for t in targets)
        assert sum(p for p, _ in case["bytes_by_role"].values()) == case["wire_bytes"]
        for cycle in case["cycles"]:
            for worker in cycle["workers"]:
                assert worker["bytes_pulled"] == worker["bytes_needed"]
        assert case["new_registrations_steady"] == 0
        assert case["refit_s"] > 0 and case["aggregate_gbps"] > 0
        base = case["baseline"]
        assert base["bcast_s"] > 0 and base["allgather_bcast_s"] > 0
        assert math.isclose(case["speedup_vs_bcast"], base["bcast_s"] / case["refit_s"])
    assert "identical" in proc.stdout  # the human table
    print(f"bench_scale CPU run: {elapsed:.1f}s wall, phases {result['phases']}")


@pytest.mark.parametrize("layout_text,expert_tp", [("tp2", None), ("tp4", None), ("tp2ep2", None), ("tp2ep2", 1)])
def test_synthetic_shards_match_bridge_layout(layout_text: str, expert_tp: int | None) -> None:
    """Each rank's generated shard equals the slice of the Megatron global tensor built by the
    planner tests' harness (Megatron-Bridge's ``merge_qkv_weights`` and ``GatedMLPMapping``
    concat) from the same HF tensors."""
    from tests.layout import _planner_harness as harness

    shape = synth.ModelShape.scaled(0.0001, dense_layers=1, moe_layers=1, experts=4)
    layout = synth.TrainerLayout.parse(layout_text, expert_tp)
    version = 3
    reference: dict[str, harness.MegatronParam] = {}
    for experts in (0, shape.experts):  # the harness builds all-dense or all-MoE models
        spec = harness.ModelSpec(name="synth", layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
                                 groups=shape.groups, head_dim=shape.head_dim, ffn=shape.ffn, experts=experts,
                                 moe_ffn=shape.moe_ffn, vocab=shape.vocab)
        hf = {name: synth.fill_hf_block(torch.empty(t.shape, dtype=torch.bfloat16), name, tuple(t.shape), version)
              for name, t in harness.hf_reference(spec).items()}
        hsource = harness.SourceLayout(tp=layout.tp, ep=layout.ep, etp=layout.etp)
        reference.update({p.name: p for p in harness.megatron_params(spec, hf, hsource)})

    shapes = synth.hf_shapes(shape)
    held: set[str] = set()
    for rank in range(layout.ranks):
        shards = synth.rank_shards(shape, layout, rank)
        for shard in shards:
            mine = torch.empty(shard.local_shape, dtype=torch.bfloat16)
            synth.write_shard(mine, shard, shape, version)
            name = shard.param.name
            if shard.param.role is Role.VOCAB_PARALLEL:
                # Padding differs (the harness pads to 8 x TP, Megatron to 128 x TP): compare real rows.
                (hf_name,) = shard.param.hf
                lo = shard.shard_offset
                real = max(0, min(lo + shard.local_shape[0], shape.vocab) - lo)
                want = synth.fill_hf_block(torch.empty(shapes[hf_name], dtype=torch.bfloat16), hf_name,
                                           shapes[hf_name], version)[lo : lo + real]
                assert torch.equal(mine[:real].view(torch.int16), want.view(torch.int16)), name
                continue
            ref = reference[name]
            assert tuple(ref.tensor.shape) == shard.param.global_shape, name
            want = ref.tensor
            if shard.shard_axis >= 0:
                want = want.narrow(shard.shard_axis, shard.shard_offset, shard.local_shape[shard.shard_axis])
            assert torch.equal(mine.view(torch.int16), want.contiguous().view(torch.int16)), (name, rank)
            held.add(name)
        side = synth.sidecar(shape, layout, shards)
        assert set(side["megatron.hf_map"]) == {s.param.name for s in shards}
    # Together the ranks hold every Megatron parameter.
    assert held | {"embedding.word_embeddings.weight", "output_layer.weight"} == {
        p.name for p in synth.megatron_params(shape, layout)}


def test_cases_and_exactness() -> None:
    tp4 = synth.TrainerLayout.parse("tp4")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_scale

    assert bench_scale.default_cases(tp4, 4) == ["tp4", "2xtp2", "tp1"]
    assert bench_scale.default_cases(synth.TrainerLayout.parse("tp1"), 1) == ["tp1", "tp2"]
    assert bench_scale.default_cases(synth.TrainerLayout.parse("tp2ep2"), 4) == ["2xtp2ep2", "2xtp2", "tp1"]
    case = bench_scale.Case.parse("2xtp2ep2")
    assert case.workers == 4
    assert [(t.tp_rank, t.ep_rank, t.ep_size) for t in case.targets()] == [(0, 0, 2), (1, 1, 2)] * 2
    assert bench_scale.Case.parse("tp2").exact_promised(tp4)
    assert not bench_scale.Case.parse("tp2").exact_promised(synth.TrainerLayout.parse("tp1"))
    with pytest.raises(ValueError):
        bench_scale.Case.parse("tp2ep3")
