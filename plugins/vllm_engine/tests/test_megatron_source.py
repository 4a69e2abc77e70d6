"""Megatron-Core TP 2 trainer (real megatron-core + Megatron-Bridge, core venv) -> vLLM TP 1 and TP 2.

The two Megatron ranks publish their native shards (fused, group-interleaved QKV with biases,
[gate_r; up_r] fc1, a padded vocabulary) once; both vLLM worker groups refit the same READY
version, each planning from the sidecar, and must end up byte-identical to vLLM loading the HF
checkpoint itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mx_refit.testing.procs import core_python, rendezvous_url, start_group


@pytest.fixture(scope="module")
def megatron(mx_catalog: str, ckpts: dict[int, Path], log_dir: Path):
    python = core_python()
    if python is None:
        pytest.skip(
            "the core venv (megatron-core + Megatron-Bridge) is not available; set MX_REFIT_CORE_PYTHON"
        )
    rendezvous = rendezvous_url(log_dir)
    name = "vllm-megatron-tp2"
    args = [
        [
            "--rank",
            str(r),
            "--world",
            "2",
            "--dist-init",
            rendezvous,
            "--catalog",
            mx_catalog,
            "--model-name",
            name,
        ]
        for r in range(2)
    ]
    group = start_group("megatron", python, Path(__file__).parent / "_megatron_trainer.py", args, log_dir)
    published = group.call("publish", (3, str(ckpts[3])), timeout_s=600)
    assert {p["state"] for p in published} <= {"PENDING", "READY"} and published[-1]["tensors"] > 0
    yield name, group
    group.stop()


def test_megatron_tp2_to_vllm_tp1(megatron, tp1, mx_catalog: str, ckpts: dict[int, Path]) -> None:
    name, _ = megatron
    tp1.refit({"catalog": mx_catalog, "model": name}, {"version": 3}, ckpts[3])
    assert tp1.stats()[0]["layout"].tp_size == 1


def test_megatron_tp2_to_vllm_tp2_per_rank_list(
    megatron, tp2, mx_catalog: str, ckpts: dict[int, Path]
) -> None:
    """vLLM's per-rank list form: the Worker picks entry ``dp_index * world_size + rank``."""
    name, _ = megatron
    entries = [{"version": 3, "wait_s": 1.0 + rank} for rank in range(2)]
    tp2.refit({"catalog": mx_catalog, "model": name}, entries, ckpts[3])
    for rank, stats in enumerate(tp2.stats()):
        assert stats["layout"].tp_rank == rank and stats["layout"].tp_size == 2
        # Any mx-refit Receiver handed this worker's model or engine finds the same layout.
        assert stats["hook_layouts"] == (stats["layout"], stats["layout"])
        assert stats["last_update"]["wait_s"] == 1.0 + rank, "a worker loaded another rank's entry"


def test_engine_update_weights_accepts_the_list_itself(
    megatron, tp2, mx_catalog: str, ckpts: dict[int, Path]
) -> None:
    """Driving the engine directly (no vLLM Worker in between): it picks its own entry the same way."""
    name, _ = megatron
    tp2.rpc("init_weight_transfer_engine", init_info={"catalog": mx_catalog, "model": name})
    tp2.group.call("engine", ("start_weight_update", {}))
    entries = [{"version": 3, "wait_s": 5.0 + rank} for rank in range(2)]
    tp2.group.call("engine", ("update_weights", {"update_info": entries}))
    tp2.group.call("engine", ("finish_weight_update", {}))
    tp2.check(ckpts[3])
    assert [s["last_update"]["wait_s"] for s in tp2.stats()] == [5.0, 6.0]
