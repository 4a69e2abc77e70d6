"""NeMo RL's refit choreography, end to end on real parts: a Megatron-Core TP2 policy (real
megatron-core + Megatron-Bridge, gloo) with the reproduced worker mixins and export generator,
the plugin's engine on both sides, the embedded catalog and NIXL, and vLLM 0.33 Qwen2 workers at
TP1 and TP2 loading through the reproduced loading loop. Every parameter of every vLLM rank must
equal vLLM loading the checkpoint itself, byte for byte.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from conftest import Job


def sync_and_check(job: Job, ckpts: dict[int, Path], version: int) -> list[dict]:
    runs_before = [s["export_runs"] for s in job.policy_stats()]
    job.train(ckpts[version])
    job.sync.sync_weights()
    job.check(ckpts[version])
    stats = job.policy_stats()
    for before, rank in zip(runs_before, stats, strict=True):
        assert rank["export_runs"] == before, "the HF export ran on the trainer"
        assert rank["generator_states"][-1] == inspect.GEN_CLOSED
        assert rank["last_send"]["mode"] == "native" and rank["last_send"]["published"]
        assert rank["last_send"]["owner_strategy"] == "generator"
    return stats


def test_tp2_trainer_to_vllm_tp1(make_job, ckpts: dict[int, Path]) -> None:
    job = make_job("tp1")
    runs_before = [s["export_runs"] for s in job.policy_stats()]
    job.sync.init_communicator()
    assert job.sync.calls[:8] == [
        "policy:checkpoint_engine_total_memory_bytes", "generation:checkpoint_engine_total_memory_bytes",
        "policy:init_checkpoint_engine", "generation:init_checkpoint_engine",
        "policy:prepare_checkpoint_engine", "generation:prepare_checkpoint_engine",
        "policy:init_checkpoint_engine_process_group", "generation:init_checkpoint_engine_process_group",
    ]
    setup = job.policy_stats()
    assert all(s["engine_is_checkpoint_engine"] and s["owner_is_worker"] for s in setup)
    assert [s["export_runs"] for s in setup] == [r + 1 for r in runs_before], (
        "NeMo RL's one setup-time export (prepare_refit_info)"
    )

    sync_and_check(job, ckpts, 1)
    second = sync_and_check(job, ckpts, 2)
    assert [s["last_send"]["new_registrations"] for s in second] == [0, 0]
    (rollout,) = job.rollout_stats()
    assert rollout["new_registrations"] == 0 and rollout["version"] == 2
    assert rollout["side"] == "rollout" and rollout["same_agent"] and rollout["agent_created_before_init"]
    assert rollout["arena_device"] == "cpu"  # the recipe's arena_device: worker, on vLLM's CPU device
    assert rollout["loaded"]["tensors"] > 0


def test_tp2_trainer_to_vllm_tp2(make_job, ckpts: dict[int, Path]) -> None:
    """Both vLLM ranks get their bytes: NeMo RL calls rank 0, which fans out to every worker."""
    job = make_job("tp2")
    job.sync.init_communicator()
    sync_and_check(job, ckpts, 3)
    sync_and_check(job, ckpts, 1)
    stats = job.rollout_stats()
    assert [s["version"] for s in stats] == [2, 2]
    assert [s["new_registrations"] for s in stats] == [0, 0]
    assert all(s["bytes_pulled"] > 0 and s["loaded"]["tensors"] > 0 for s in stats)


def test_two_refits_then_release_after_refit_and_prepare_again(make_job, ckpts: dict[int, Path]) -> None:
    job = make_job("tp1")
    job.sync.init_communicator()
    sync_and_check(job, ckpts, 4)
    sync_and_check(job, ckpts, 5)
    # Same job, now with release_after_refit: NeMo RL finalizes both sides after each refit.
    job.sync._config["engine_kwargs"][job.sync._config["backend"]]["release_after_refit"] = True
    job.sync.calls.clear()
    sync_and_check(job, ckpts, 2)
    assert job.sync.calls[-2:] == ["policy:finalize_checkpoint_engine", "generation:finalize_checkpoint_engine"]
    assert not job.sync._ready
    job.sync.calls.clear()
    sync_and_check(job, ckpts, 3)  # prepared again: new catalog, new endpoints, same engines
    assert "policy:prepare_checkpoint_engine" in job.sync.calls
    assert [s["version"] for s in job.policy_stats()] == [4, 4]


def test_role_overrides_from_the_recipe_reach_the_classifier(make_job, ckpts: dict[int, Path]) -> None:
    """A recipe rule (here deliberately wrong: a row-parallel weight declared replicated) is what
    the published descriptors say; only the policy side runs, nobody reads this version."""
    from mx_refit.catalog.client import CatalogClient

    rule = "{role: replicated, pattern: '*layers.1.mlp.linear_fc2.weight'}"
    job = make_job("tp1", [f"weight_sync.role_overrides=[{rule}]"])
    job.sync.init_communicator()
    job.policy.call("rpc", ("send_weights_via_checkpoint_engine", {"kv_scales": None}))
    address = job.policy_stats()[0]["catalog"]
    info = CatalogClient(address).get_version(model=job.master.weight_sync["model_name"], version=1)
    roles = {d.name: d.role.value for s in info.sources for d in s.tensors if d.name.endswith("linear_fc2.weight")}
    assert roles and all(
        (role == "replicated") == ("layers.1." in name) for name, role in roles.items()
    ), roles
