"""A MoE policy with expert tensor parallel 1 (NeMo RL's Qwen3-30B setting) refits through the
plugin's engine: TP 2 x EP 2 x ETP 1 on 2 real Megatron-Core ranks (gloo), each the first
data-parallel replica of its TP position and the first expert-data-parallel replica of its EP
position, so both publish dense shards and whole experts, and the engine expects the 2 sources
the core's rule counts (``mx_refit.expected_sources``; tp x pp x ep = 4 never became READY).

The policy side runs NeMo RL's choreography (the reproduced synchronizer, the shipped recipe); the
version is then received whole by a core ``Receiver`` over the engine's embedded catalog and NIXL
and compared byte for byte with the MoE checkpoint (the rollout group's vLLM model is dense).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DENSE, HERE, Job, compose_recipe

from mx_refit.testing.procs import Group, core_python, rendezvous_url, start_group

REPO = HERE.parents[2]


@pytest.fixture(scope="session")
def moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(REPO / "tests" / "fixtures"))
    from tiny_hf import build_tiny_hf

    return build_tiny_hf("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe")


@pytest.fixture(scope="session")
def moe_policy(moe_ckpt: Path, log_dir: Path) -> Iterator[Group]:
    core = core_python()
    if core is None:
        pytest.skip("needs the core venv (MX_REFIT_CORE_PYTHON)")
    rendezvous = rendezvous_url(log_dir)
    ranks = [["--rank", str(r), "--world", "2", "--dist-init", rendezvous, "--hf-dir", str(moe_ckpt),
              "--ep", "2", "--etp", "1"] for r in range(2)]
    group = start_group("policy-moe-tp2-ep2-etp1", core, HERE / "_policy_rank.py", ranks, log_dir)
    try:
        yield group
    finally:
        group.stop()


def test_moe_etp1_policy_refits(moe_policy: Group, groups, configs: Path, job_name: str, moe_ckpt: Path) -> None:
    from mx_refit import Receiver
    from mx_refit.types import TargetLayout
    from mx_refit.verify.expect import checkpoint_index, compare_received, expected_windows

    base = [f"weight_sync.model_name={job_name}", "weight_sync.catalog.host=127.0.0.1",
            "weight_sync.transfer_timeout_s=240"]
    job = Job(moe_policy, groups["tp1"], compose_recipe(DENSE, base, configs))
    job.sync.init_communicator()
    job.policy.call("rpc", ("send_weights_via_checkpoint_engine", {"kv_scales": None}))
    stats = job.policy_stats()
    assert [s["last_send"]["mode"] for s in stats] == ["native", "native"]
    assert [s["last_send"]["published"] for s in stats] == [True, True]
    target = TargetLayout(full_tensors=True)
    with Receiver(stats[0]["catalog"], job_name, target=target, reader_id="moe-check") as receiver:
        result = receiver.refit(1, wait_s=120)  # READY only with the right source count
        index = checkpoint_index(str(moe_ckpt))
        report = compare_received(str(moe_ckpt), expected_windows(result.version, target, index), result.tensors)
    assert sorted(s.source_id for s in result.version.sources) == [
        f"{job_name}/tp0-pp0-ep0-etp0", f"{job_name}/tp1-pp0-ep1-etp0"]
    assert result.version.expected_sources == 2
    assert {"expert_column", "expert_row"} <= set(result.plan.bytes_by_role)
    assert report["mismatched"] == [] and report["missing"] == []
    assert sorted(report["identical"]) == sorted(index)
