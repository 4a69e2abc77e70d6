"""Megatron-Core TP 2 trainer (real megatron-core + Megatron-Bridge, core venv) -> vLLM TP 1 and TP 2.

The two Megatron ranks publish their native shards (fused, group-interleaved QKV with biases,
[gate_r; up_r] fc1, a padded vocabulary) once; both vLLM worker groups refit the same READY
version, each planning from the sidecar, and must end up byte-identical to vLLM loading the HF
checkpoint itself. The same holds for the untied variant (its own ``lm_head.weight``, a
vocabulary of 131 that TP 2 does not divide: Megatron's padded output layer -> vLLM's
``ParallelLMHead``), refitted into vLLM groups built from that model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mx_refit.testing.checkpoints import build_version
from mx_refit.testing.procs import core_python, rendezvous_url, start_concurrently, start_group, vllm_python

from conftest import HERE, Workers


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


def assert_rank_exact(stats: list[dict]) -> None:
    """Every byte went straight into the parameters (nothing through vLLM's full-tensor
    loader), and each rank pulled about its own parameter bytes (vocabulary padding aside)."""
    for rank, s in enumerate(stats):
        assert s["layout"].full_tensors is False and s["unproven"] == {}, (rank, s["unproven"])
        assert s["last_load"]["loader_tensors"] == 0, (rank, s["last_load"])
        assert s["last_load"]["placed_bytes"] == s["bytes_pulled"], (rank, s["last_load"], s["bytes_pulled"])
        assert s["bytes_pulled"] <= s["param_bytes"], (rank, s["bytes_pulled"], s["param_bytes"])


def test_megatron_tp2_to_vllm_tp1(megatron, tp1, mx_catalog: str, ckpts: dict[int, Path]) -> None:
    name, _ = megatron
    tp1.refit({"catalog": mx_catalog, "model": name}, {"version": 3}, ckpts[3])
    assert tp1.stats()[0]["layout"].tp_size == 1
    assert_rank_exact(tp1.stats())


def test_megatron_tp2_to_vllm_tp2_per_rank_list(
    megatron, tp2, mx_catalog: str, ckpts: dict[int, Path]
) -> None:
    """vLLM's per-rank list form: the Worker picks entry ``dp_index * world_size + rank``."""
    name, _ = megatron
    entries = [{"version": 3, "wait_s": 1.0 + rank} for rank in range(2)]
    tp2.refit({"catalog": mx_catalog, "model": name}, entries, ckpts[3])
    assert_rank_exact(tp2.stats())
    for rank, stats in enumerate(tp2.stats()):
        assert stats["layout"].tp_rank == rank and stats["layout"].tp_size == 2
        # A Receiver handed this worker's engine finds its layout; handed the bare model (loaded
        # through vLLM's load_weights, which narrows whole tensors), the whole-tensor one.
        whole = dataclasses.replace(stats["layout"], full_tensors=True, whole_prefixes=())
        assert stats["hook_layouts"] == (whole, stats["layout"])
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


def test_stage_while_serving_then_commit(megatron, tp2, mx_catalog: str, ckpts: dict[int, Path]) -> None:
    """``phase="stage"`` pulls in the background and returns at once, the live weights stay
    the previous version's until ``phase="commit"`` places the staged bytes; a commit whose
    stage failed raises that error and leaves the weights intact."""
    name, group = megatron
    published = group.call("publish", (4, str(ckpts[4])), timeout_s=600)
    assert published[-1]["state"] in {"PENDING", "READY"}
    tp2.rpc("init_weight_transfer_engine", init_info={"catalog": mx_catalog, "model": name})
    tp2.rpc("start_weight_update")
    tp2.rpc("update_weights", update_info={"version": 4, "wait_s": 30.0, "phase": "stage"})
    tp2.assert_untouched()  # serving the previous version while the stage runs (or has run)
    tp2.rpc("update_weights", update_info={"phase": "commit"})
    tp2.rpc("finish_weight_update")
    tp2.check(ckpts[4])
    tp2.current = ckpts[4]
    assert_rank_exact(tp2.stats())
    for rank, s in enumerate(tp2.stats()):  # the pause (commit) next to the whole refit, for BENCHMARKS.md
        phases = s["phase_seconds"]
        assert "commit" in phases and "load" not in phases, phases
        total = sum(phases.values()) * 1e3
        print(f"rank {rank}: commit {phases['commit'] * 1e3:.3f} ms of a {total:.1f} ms refit "
              f"({s['param_bytes']} parameter bytes)")

    # A stage that fails (no such version) surfaces at the commit; nothing changed.
    tp2.rpc("start_weight_update")
    tp2.rpc("update_weights", update_info={"version": 99, "phase": "stage"})
    with pytest.raises(Exception, match="99"):
        tp2.rpc("update_weights", update_info={"phase": "commit"})
    tp2.assert_untouched()
    # A commit with nothing staged is refused, naming the fix.
    tp2.rpc("start_weight_update")
    with pytest.raises(Exception, match="phase='stage' first"):
        tp2.rpc("update_weights", update_info={"phase": "commit"})
    tp2.assert_untouched()
    assert not any(s["session"] for s in tp2.stats())


DIRECT_BUFFER = 16 << 10  # a 16 KiB receive buffer: the ~330 KiB model in ~20 chunks, gate_up split in rows


def test_direct_receive_through_a_small_buffer(megatron, tp1, tp2, mx_catalog: str, ckpts: dict[int, Path]) -> None:
    """``receive_mode: direct``: no arena; every rank's bytes go into vLLM's parameters through
    a 16 KiB buffer, windows larger than it in row pieces. Every parameter equals vLLM's own
    ``load_weights``, every byte went straight into the parameters, and all torch allocated in
    the worker during the load (the buffer included) is within the buffer setting."""
    name, _ = megatron
    init = {"catalog": mx_catalog, "model": name, "receive_mode": "direct", "receive_buffer_bytes": DIRECT_BUFFER}
    for workers in (tp1, tp2):
        workers.rpc("init_weight_transfer_engine", init_info=init)
        workers.rpc("start_weight_update")
        peaks = workers.group.call("measured", ("update_weights", {"update_info": {"version": 3}}))
        workers.rpc("finish_weight_update")
        workers.check(ckpts[3])
        workers.current = ckpts[3]
        stats = workers.stats()
        assert_rank_exact(stats)
        for rank, (s, peak) in enumerate(zip(stats, peaks)):
            mode, chunks, memory = s["receive"]
            assert mode == "direct" and chunks >= s["bytes_pulled"] // DIRECT_BUFFER >= 4, (rank, s["receive"])
            assert s["arenas"] == {} and 0 < memory <= DIRECT_BUFFER, (rank, s["receive"])
            assert 0 < peak <= DIRECT_BUFFER, (rank, peak)
            print(f"tp{workers.tp} rank {rank}: {s['bytes_pulled']} bytes in {chunks} chunks, torch peak {peak} B")

    # stage/commit need a staging arena: refused by name, weights untouched.
    tp2.rpc("init_weight_transfer_engine", init_info=init)
    tp2.rpc("start_weight_update")
    with pytest.raises(Exception, match=r"phase='stage' needs MxInitInfo.receive_mode='staged'"):
        tp2.rpc("update_weights", update_info={"version": 3, "phase": "stage"})
    tp2.assert_untouched()
    # A buffer that cannot hold one row of the widest window: refused before the first byte.
    tp1.rpc("init_weight_transfer_engine", init_info={**init, "receive_buffer_bytes": 4096})
    tp1.rpc("start_weight_update")
    tp1.rpc("update_weights", update_info={"version": 3})  # 4 KiB holds one row of every window here
    tp1.rpc("finish_weight_update")
    tp1.check(ckpts[3])


@pytest.fixture(scope="module")
def untied(megatron, tmp_path_factory: pytest.TempPathFactory, log_dir: Path):
    """vLLM TP 1 and TP 2 groups built from the untied model's version 0, and its version 3
    published by the Megatron TP 2 trainer under its own model name."""
    root = tmp_path_factory.mktemp("untied")
    v0, v3 = (build_version(root, v, tied=False) for v in (0, 3))
    _, group = megatron
    name = "vllm-megatron-tp2-untied"
    published = group.call("publish", (3, str(v3), name), timeout_s=600)
    assert {p["state"] for p in published} <= {"PENDING", "READY"}

    def start(tp: int):
        rendezvous = rendezvous_url(log_dir)
        args = [["--rank", str(r), "--world", str(tp), "--dist-init", rendezvous, "--hf-dir", str(v0)]
                for r in range(tp)]
        group = start_group(f"vllm-untied-tp{tp}", vllm_python(), HERE / "_vllm_worker.py", args, log_dir)
        return Workers(group, v0)

    groups = start_concurrently([lambda: start(1), lambda: start(2)], lambda w: w.group.stop())
    yield name, v3, groups
    for workers in groups:
        workers.group.stop()


def test_untied_embeddings_rank_exact_at_tp1_and_tp2(untied, mx_catalog: str) -> None:
    """Untied embeddings, vocabulary 131 (not divisible by TP 2): every vLLM parameter,
    ``lm_head.weight`` included, equals vLLM's own ``load_weights`` of the HF checkpoint, and
    every byte went straight into the parameters."""
    name, v3, groups = untied
    for workers in groups:
        workers.refit({"catalog": mx_catalog, "model": name}, {"version": 3}, v3)
        assert_rank_exact(workers.stats())
        for rank, s in enumerate(workers.stats()):
            assert s["layout"].tp_rank == rank and s["layout"].tp_size == workers.tp
