"""Classifier + sidecar + collector on real Megatron-Core models built through Megatron-Bridge.

One process per rank (gloo on CPU). Each job builds several tiny models in turn and returns the
published shard records; the assertions check, against Megatron-Bridge and the checkpoint bytes:
- every published tensor shares the parameter's storage (in place, no copy);
- roles agree between Bridge mappings and the Megatron-Core attribute fallback, and with the
  expected role of each Megatron parameter;
- names are pipeline-global (layers) and expert-parallel-global (experts);
- the sidecar's HF name map covers exactly the checkpoint's tensors (= Bridge's conversion tasks);
- reassembling the shards with an independent reference and the sidecar config reproduces every
  checkpoint tensor byte for byte.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import pytest

from mx_refit.verify.harness import launch_ranks
from tests.fixtures.megatron_jobs import Case, classify_job
from tests.fixtures.reference_hf import assemble_global, megatron_to_hf

# The role every Megatron parameter of these GPT models must get (first match wins).
EXPECTED_ROLES: list[tuple[str, str]] = [
    (r"\.linear_qkv\.(weight|bias)$", "qkv_column"),
    (r"\.experts\.local_experts\.\d+\.linear_fc1\.weight$", "expert_column"),
    (r"\.experts\.local_experts\.\d+\.linear_fc2\.weight$", "expert_row"),
    (r"\.mlp\.linear_fc1\.weight$", "gated_mlp_column"),
    (r"\.(linear_proj|linear_fc2)\.weight$", "row"),
    (r"^(embedding\.word_embeddings|output_layer)\.weight$", "vocab_parallel"),
    (r"(layernorm|router)\.weight$", "replicated"),
]


def expected_role(name: str) -> str:
    for pattern, role in EXPECTED_ROLES:
        if re.search(pattern, name):
            return role
    raise AssertionError(f"no expected role for {name}")


def run_cases(world: int, cases: list[Case]) -> dict[Case, list[dict[str, Any]]]:
    per_rank = launch_ranks(classify_job, world, cases, timeout_s=480)
    return {case: [rank_out[i] for rank_out in per_rank] for i, case in enumerate(cases)}


def check_case(case: Case, ranks: list[dict[str, Any]]) -> None:
    from safetensors.torch import load_file

    reference = load_file(f"{case.hf_dir}/model.safetensors")
    config = ranks[0]["sidecar"]["megatron.config"]
    hf_map: dict[str, dict[str, Any]] = {}
    shards = []
    for out in ranks:
        ctx = out["ctx"]
        assert (ctx["tp_size"], ctx["pp_size"], ctx["ep_size"]) == (case.tp, case.pp, case.ep)
        assert out["sidecar"]["megatron.config"] == config, "ranks disagree on megatron.config"
        for name, entry in out["sidecar"]["megatron.hf_map"].items():
            assert hf_map.setdefault(name, entry) == entry, f"{name}: ranks disagree on the HF map"
        published = {t["name"] for t in out["tensors"]}
        mapped = set(out["sidecar"]["megatron.hf_map"])
        # This rank's hf_map entries are its tensors (PP layers, EP experts); it publishes the
        # share the mesh gives it: dense ones as the first DP replica, experts as the first
        # expert-DP replica (the reassembly below proves the ranks' shares cover the checkpoint).
        share = {name for name in mapped
                 if (ctx["edp_rank"] == 0 if "local_experts." in name else ctx["dp_rank"] == 0)}
        assert published == share, published ^ share
        assert set(out["task_hf"]) == mapped
        for t in out["tensors"]:
            name = t["name"]
            assert t["same_storage"] and t["same_ptr"], f"{name}: not published in place"
            assert t["role"] == expected_role(name), f"{name}: role {t['role']}"
            assert out["fallback_roles"][name] == t["role"], f"{name}: Megatron fallback disagrees"
            assert t["decided_by"] == "bridge", name
            split = t["shard_axis"] >= 0
            if split:
                size = t["extras"]["tp_size"]
                expert = "expert_id" in t["extras"]
                assert size == (case.tp if not expert else case.tp)  # ETP defaults to TP
                assert t["shard_offset"] == t["extras"]["tp_rank"] * t["local_shape"][t["shard_axis"]]
                assert t["global_shape"][t["shard_axis"]] == size * t["local_shape"][t["shard_axis"]]
            else:
                assert t["global_shape"] == t["local_shape"] and t["shard_offset"] == 0
            layer = re.search(r"layers\.(\d+)\.", name)
            if layer:  # pipeline-global: stage p of P holds layers [p*L/P, (p+1)*L/P)
                per_stage = config["num_layers"] // case.pp
                assert int(layer.group(1)) // per_stage == ctx["pp_rank"], f"{name} on pp {ctx['pp_rank']}"
            expert_match = re.search(r"local_experts\.(\d+)\.", name)
            if expert_match:  # expert-parallel-global ids, also in extras
                gid = int(expert_match.group(1))
                per_rank = config["num_moe_experts"] // case.ep
                assert gid // per_rank == ctx["ep_rank"] and t["extras"]["expert_id"] == gid
            shards.append(t)
    # The HF map covers exactly the checkpoint: one HF tensor per name across every task.
    hf_names = [h for entry in hf_map.values() for h in entry["hf"]]
    assert len(hf_names) == len(set(hf_names)) == len(reference)
    assert set(hf_names) == set(reference)
    # Reassemble with the independent reference and compare bytes with the checkpoint.
    full = assemble_global(shards)
    roles = {t["name"]: (t["role"], t["extras"].get("tp_size", 1)) for t in shards}
    for name, tensor in full.items():
        role, tp_size = roles[name]
        for hf_name, value in megatron_to_hf(name, tensor, role, tp_size, hf_map[name], config).items():
            assert value.shape == reference[hf_name].shape, f"{hf_name}: {tuple(value.shape)}"
            assert value.contiguous().view(-1).view(dtype=__import__("torch").uint8).equal(
                reference[hf_name].contiguous().view(-1).view(dtype=__import__("torch").uint8)
            ), f"{hf_name} differs from the checkpoint"


def test_single_rank_every_model(tiny_hf, bridge) -> None:
    kinds = ["llama_mha", "llama_gqa", "qwen2", "qwen3", "qwen3_moe"]
    results = run_cases(1, [Case(k, str(tiny_hf(k))) for k in kinds])
    for case, ranks in results.items():
        check_case(case, ranks)
        # The built-in plugin's hook path (Publisher.publish(model=BridgedModel)) records the same.
        (out,) = ranks
        via = out["via_hooks"]
        assert via["state"] == "READY" and via["sidecar"] == out["sidecar"]
        assert via["descriptors"] == {
            t["name"]: (t["role"], t["global_shape"], t["local_shape"], t["shard_axis"], t["shard_offset"],
                        t["extras"]) for t in out["tensors"]}
    moe = results[Case("qwen3_moe", str(tiny_hf("qwen3_moe")))][0]
    assert sum(t["role"] == "expert_column" for t in moe["tensors"]) == 2 * 8


def test_tp2_padded_vocab_tied_and_expert_tp(tiny_hf, bridge) -> None:
    results = run_cases(2, [Case(k, str(tiny_hf(k)), tp=2) for k in ("qwen2", "qwen3_moe")])
    for case, ranks in results.items():
        check_case(case, ranks)
    qwen2 = results[Case("qwen2", str(tiny_hf("qwen2")), tp=2)]
    config = qwen2[0]["sidecar"]["megatron.config"]
    assert config["vocab_size"] == 131 and config["padded_vocab_size"] % 2 == 0
    assert config["padded_vocab_size"] > 131 and config["tie_word_embeddings"] is True
    names = {t["name"] for t in qwen2[0]["tensors"]}
    assert "output_layer.weight" not in names  # tied: the embedding is published once


def test_ep2_pp2_and_kv_heads_below_tp(tiny_hf, bridge) -> None:
    results = run_cases(4, [
        Case("qwen3_moe", str(tiny_hf("qwen3_moe")), pp=2, ep=2),
        Case("llama_gqa", str(tiny_hf("llama_gqa")), tp=4),
    ])
    for case, ranks in results.items():
        check_case(case, ranks)
    moe = results[Case("qwen3_moe", str(tiny_hf("qwen3_moe")), pp=2, ep=2)]
    by_rank = defaultdict(set)
    for out in moe:
        for t in out["tensors"]:
            if "expert_id" in t["extras"]:
                by_rank[(out["ctx"]["pp_rank"], out["ctx"]["ep_rank"])].add(t["name"].split(".")[2] + "/" + str(t["extras"]["expert_id"]))
    assert by_rank[(1, 1)] == {f"1/{e}" for e in range(4, 8)}
    assert by_rank[(0, 0)] == {f"0/{e}" for e in range(0, 4)}
