"""When NeMo RL's export carries what native shards do not, every policy rank consumes the HF
stream together (loudly) and rank 0 publishes it; the bytes still match.

- an EAGLE draft model: ``draft.*`` weights, split off by NeMo RL's loading loop;
- an FP8 KV cache: KV/Q scale tensors (here recorded, not loaded: no vLLM model on CPU has them);
- FP8 parameters exported with ``build_export_fp8_tasks`` (the decision is tested; real FP8
  parameters cannot be built on CPU, so the stream carries the standard export);
- ModelOpt quantisation (``policy.quant_cfg``; the decision and the stream path: ModelOpt's
  quantizer folding is not installed here, so the stream carries the standard export);
- a Megatron-Bridge mapping type the classifier does not know (a new architecture's bridge
  subclassing a real Bridge mapping): decided before the generator is touched.

The rollout records what NeMo RL's loading loop is handed instead of loading it into vLLM: with
Megatron-Bridge 0.6.2 the export of a TP-padded vocabulary keeps the padding rows (132 for 131),
which vLLM's embedding loader rejects, so "the bytes match" is checked against the stream itself.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import Job


@pytest.fixture
def configured(groups):
    """Worker config for one test; back to plain afterwards."""
    def configure(options: dict) -> None:
        groups["policy"].call("configure", options)
        groups["tp1"].call("sink", True)

    yield configure
    groups["policy"].call("configure", {})
    groups["tp1"].call("sink", False)


def fallback_sync(job: Job, ckpts: dict[int, Path], version: int, kv_scales=None) -> list[dict]:
    runs_before = [s["export_runs"] for s in job.policy_stats()]
    job.train(ckpts[version])
    job.sync.sync_weights(kv_scales=kv_scales)
    stats = job.policy_stats()
    for before, rank in zip(runs_before, stats, strict=True):
        assert rank["export_runs"] == before + 1, "every rank consumes the stream together"
        assert rank["last_send"]["mode"] == "hf_fallback"
    assert [s["last_send"]["published"] for s in stats] == [True, False]  # rank 0 publishes
    return stats


def received_matches_stream(job: Job, kv_scales=None) -> dict[str, str]:
    stream = job.policy.call("stream_digests", kv_scales)[0]
    (received,) = job.rollout.call("digests")
    (rollout,) = job.rollout_stats()
    draft = {f"draft.{n}": d for n, d in rollout["draft"].items()}
    assert {**received, **draft} == stream
    return stream


def test_eagle_draft_weights(make_job, configured, ckpts: dict[int, Path], log_dir: Path) -> None:
    configured({"draft": True})
    job = make_job("tp1")
    job.sync.init_communicator()
    stats = fallback_sync(job, ckpts, 1)
    assert "EAGLE draft" in stats[0]["last_send"]["reasons"][0]
    stream = received_matches_stream(job)
    assert any(n.startswith("draft.") for n in stream)
    assert "falls back to NeMo RL's gathered HF export stream" in (log_dir / "policy-tp2-0.log").read_text()
    second = fallback_sync(job, ckpts, 2)
    received_matches_stream(job)
    assert second[0]["last_send"]["new_registrations"] == 0


def test_fp8_kv_scales(make_job, configured, ckpts: dict[int, Path]) -> None:
    configured({"cfg": {"generation": {"backend": "vllm", "vllm_cfg": {"kv_cache_dtype": "fp8_e4m3"}}}})
    job = make_job("tp1")
    job.sync.init_communicator()
    scales = {"model.layers.1.self_attn.attn.k_scale": 0.25, "model.layers.0.self_attn.attn.v_scale": 3.0}
    stats = fallback_sync(job, ckpts, 3, kv_scales=scales)
    assert any("FP8 KV" in r for r in stats[0]["last_send"]["reasons"])
    stream = received_matches_stream(job, scales)
    assert sum(name.endswith("_scale") for name in stream) == 2 * 3


def test_fp8_export_tasks(make_job, configured, ckpts: dict[int, Path]) -> None:
    configured({"fp8_param": True})
    job = make_job("tp1")
    job.sync.init_communicator()
    stats = fallback_sync(job, ckpts, 4)
    assert any("build_export_fp8_tasks" in r for r in stats[0]["last_send"]["reasons"])
    received_matches_stream(job)


def test_modelopt_quantisation(make_job, configured, ckpts: dict[int, Path]) -> None:
    configured({"cfg": {"quant_cfg": "NVFP4_DEFAULT_CFG"}})
    job = make_job("tp1")
    job.sync.init_communicator()
    stats = fallback_sync(job, ckpts, 5)
    assert any("ModelOpt quantisation is on (policy.quant_cfg='NVFP4_DEFAULT_CFG')" in r
               for r in stats[0]["last_send"]["reasons"])
    received_matches_stream(job)


def test_a_mapping_type_the_classifier_does_not_know(make_job, configured, ckpts: dict[int, Path]) -> None:
    configured({"new_mapping_type": True})
    job = make_job("tp1")
    job.sync.init_communicator()
    stats = fallback_sync(job, ckpts, 1)
    (reason,) = stats[0]["last_send"]["reasons"]
    assert re.match(r"Megatron-Bridge mapping NewArchQKVMapping has no mx-refit role \(\d+ parameters, e\.g\. "
                    r"decoder\.layers\.0\.self_attention\.linear_qkv\.", reason), reason
    assert stats[1]["last_send"]["reasons"] == [reason]  # every rank took the same path
    received_matches_stream(job)
