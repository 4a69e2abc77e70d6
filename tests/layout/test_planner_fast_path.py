"""The planner's fast path (whole families of same-geometry tensors at a time, reads built in C)
must give exactly the plan of the reference path (every Megatron tensor one by one through the
general per-tensor planner): the same reads in the same order, the same arena, the same
placement of every HF tensor, the same accounting."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from mx_refit.errors import InvalidArgument
from mx_refit.layout.planner import MegatronReceivePlan, _Planner, plan_receive
from mx_refit.layout.receive_plan import gc_paused
from mx_refit.types import ReadOp, TargetLayout, VersionInfo
from tests.layout._planner_harness import ModelSpec, SourceLayout, publish
from tests.layout.test_planner import SPECS, targets


def reference_plan(version: VersionInfo, target: TargetLayout, **options: Any) -> MegatronReceivePlan:
    with gc_paused():
        return _Planner(
            version, target, options.get("row_slice_options"), options.get("sticky_bytes", 64 << 20), families=False
        ).run()


def assert_same_plan(fast: MegatronReceivePlan, ref: MegatronReceivePlan) -> None:
    assert fast.reads == ref.reads
    assert all(type(op) is ReadOp for op in fast.reads)
    assert fast.arena_bytes == ref.arena_bytes
    assert fast.bytes_needed == ref.bytes_needed
    assert fast.bytes_by_role == ref.bytes_by_role
    assert fast.tensors == ref.tensors
    assert fast.unmapped == ref.unmapped
    # Placements (name, arena offset, bytes, shape, dtype, staged copies) of every HF tensor;
    # the fast path may yield them in another order, never at another place.
    assert sorted(fast.tensor_specs()) == sorted(ref.tensor_specs())
    assert len(set(fast.hf_names)) == len(fast.hf_names) == fast.tensors


CASES = [
    ("gqa", SourceLayout(tp=2, pp=2)),
    ("qwen2_bias_tied_fp32", SourceLayout(tp=4, pp=1)),
    ("moe4", SourceLayout(tp=2, pp=1, ep=2, etp=1)),
    ("moe4", SourceLayout(tp=2, pp=2, ep=2, etp=2)),
    ("moe8_sequential", SourceLayout(tp=4, pp=1, ep=2, etp=1)),
]


@pytest.mark.parametrize(
    ("spec", "layout"), CASES, ids=[f"{s}-tp{l.tp}pp{l.pp}ep{l.ep}etp{l.etp}" for s, l in CASES]
)
def test_fast_path_plans_exactly_like_the_reference(spec: str, layout: SourceLayout) -> None:
    version = publish(SPECS[spec], layout).version
    for target in targets(SPECS[spec]):
        assert_same_plan(plan_receive(version, target), reference_plan(version, target))
    hull = {"row_slice_options": {"force": "rows"}}
    target = TargetLayout(tp_rank=3, tp_size=4, full_tensors=False)
    assert_same_plan(plan_receive(version, target, **hull), reference_plan(version, target, **hull))


def test_fast_path_with_unmapped_names_plans_like_the_reference() -> None:
    published = publish(ModelSpec("moe4u", experts=4), SourceLayout(tp=2, ep=2))
    hf_map = dict(published.version.sidecar["megatron.hf_map"])
    del hf_map["decoder.final_layernorm.weight"]
    version = published.version.__class__(
        **{**published.version.__dict__, "sidecar": {**published.version.sidecar, "megatron.hf_map": hf_map}}
    )
    for target in (TargetLayout(), TargetLayout(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2, full_tensors=False)):
        fast = plan_receive(version, target)
        assert fast.unmapped == ["decoder.final_layernorm.weight"]
        assert_same_plan(fast, reference_plan(version, target))


def test_fast_path_on_the_benchmark_manifest_tp8_slice_and_ep() -> None:
    """The Qwen3-30B-A3B-shaped manifest of bench_planner (8 sources, EP8, 18,867 HF tensors):
    the TP8-sliced window the planner budget is about, and an EP receiver."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_planner.py"
    spec = importlib.util.spec_from_file_location("mx_refit_bench_planner_fast", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    version = bench.manifest(tp=4, pp=1, dp=2, ep=8)
    for target in (
        TargetLayout(tp_size=8, tp_rank=5, full_tensors=False),
        TargetLayout(tp_size=2, tp_rank=0, ep_size=8, ep_rank=3, full_tensors=False),
    ):
        fast = plan_receive(version, target)
        assert_same_plan(fast, reference_plan(version, target))
    assert len(fast.reads) > 0


def _with_hf_map(version: VersionInfo, hf_map: dict[str, Any]) -> VersionInfo:
    return version.__class__(**{**version.__dict__, "sidecar": {**version.sidecar, "megatron.hf_map": hf_map}})


def test_hf_name_clashes_resolve_like_the_reference() -> None:
    """A family whose HF names clash with an earlier family's is planned one by one, the names
    received already skipped (as the reference does); a name twice within one family raises."""
    version = publish(SPECS["moe4"], SourceLayout(tp=2)).version
    hf_map = version.sidecar["megatron.hf_map"]
    q_norm = next(n for n in hf_map if n.endswith("0.self_attention.q_layernorm.weight"))
    final_norm = "decoder.final_layernorm.weight"  # another shape: another family
    # q_layernorm of layer 0 lands on the final norm's HF name: one family clashes with the other.
    clash = {**hf_map, q_norm: {**hf_map[q_norm], "hf": list(hf_map[final_norm]["hf"])}}
    target = TargetLayout(tp_rank=1, tp_size=2, full_tensors=False)
    fast = plan_receive(_with_hf_map(version, clash), target)
    ref = reference_plan(_with_hf_map(version, clash), target)
    # Which of the two claimants wins depends on planning order (a malformed map); the received
    # names, each once, do not.
    assert sorted(fast.hf_names) == sorted(ref.hf_names) == sorted(set(fast.hf_names))
    assert fast.tensors == ref.tensors == plan_receive(version, target).tensors - 1
    assert sorted(spec.name for spec in fast.tensor_specs()) == sorted(fast.hf_names)
    # Two experts of one family mapped to the same HF name: rejected, naming the kind.
    fc2 = sorted(n for n in hf_map if ".experts." in n and "linear_fc2" in n)
    twice = {**hf_map, fc2[1]: {**hf_map[fc2[1]], "hf": list(hf_map[fc2[0]]["hf"])}}
    # (The one-by-one reference skips the second claimant instead; the fast path always raised.)
    with pytest.raises(InvalidArgument, match="appears twice"):
        plan_receive(_with_hf_map(version, twice), target)


@pytest.mark.parametrize("spec", ["qwen2_bias_tied_fp32", "moe4"])
def test_whole_prefixes_arrive_whole_in_a_sliced_plan(spec: str) -> None:
    """``TargetLayout.whole_prefixes``: the named modules' tensors arrive whole (an engine that
    cannot place their slices loads them itself), every other tensor as the rank's window;
    the family fast path plans exactly like the reference."""
    from tests.layout._planner_harness import check

    published = publish(SPECS[spec], SourceLayout(tp=2))
    # A fused Megatron tensor (here QKV) arrives whole when any of its HF names is named.
    whole = ("model.layers.0.mlp.", "model.layers.1.self_attn.q_proj.", "model.layers.1.self_attn.k_proj.",
             "model.layers.1.self_attn.v_proj.")
    target = TargetLayout(tp_rank=1, tp_size=2, full_tensors=False, whole_prefixes=whole)
    plan = plan_receive(published.version, target)
    assert_same_plan(plan, reference_plan(published.version, target))
    got = check(plan, published, SPECS[spec], target)
    whole_names = [n for n in got if n.startswith(whole)]
    assert whole_names and all(got[n].shape == published.hf[n].shape for n in whole_names)
    sliced = plan_receive(published.version, TargetLayout(tp_rank=1, tp_size=2, full_tensors=False))
    assert sliced.bytes_needed < plan.bytes_needed
