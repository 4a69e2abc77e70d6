"""The main job: `mx-refit demo --json` end to end (3 processes, embedded catalog, NIXL on CPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


@pytest.mark.timeout(900)
def test_demo_json_reports_every_tensor_identical():
    out = subprocess.run(
        [sys.executable, "-m", "mx_refit.cli", "demo", "--json"], capture_output=True, text=True, timeout=900,
        env={**os.environ, "MX_REFIT_TRACE_PLUGINS": "1"},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)  # the whole stdout: NIXL's and the children's logs go to stderr
    assert set(summary) == {"cycles", "tensors_per_cycle", "identical", "mismatched", "bytes_per_cycle", "gbps",
                            "transport"}
    assert summary["transport"] == ["nixl"] * 3  # host memory: NIXL, whatever the node
    assert summary["cycles"] == 3
    assert summary["tensors_per_cycle"] == 75  # 8 Llama layers x 9 + embeddings, norm, lm_head
    assert summary["mismatched"] == 0
    assert summary["identical"] == 3 * 75
    assert summary["bytes_per_cycle"] > 300e6
    assert len(summary["gbps"]) == 3 and all(g > 0 for g in summary["gbps"])
    assert "cycle 3/3" in out.stderr  # progress goes to stderr when --json owns stdout
    # the children inherit the logging set-up: the receiver's hook trace reaches stderr
    assert re.search(r"mx_refit\.plugins\.trace: +mx_refit_refit_done \[hook\]", out.stderr), out.stderr[-3000:]


@pytest.mark.timeout(900)
def test_demo_with_a_megatron_model(tmp_path):
    """`demo --model HF_DIR`: Bridge-built Megatron TP=2 ranks -> receivers at TP 1 and 2."""
    from tests.fixtures.tiny_hf import build_tiny_hf

    hf_dir = build_tiny_hf("qwen2", tmp_path / "qwen2")
    out = subprocess.run(
        [sys.executable, "-m", "mx_refit.cli", "demo", "--model", str(hf_dir), "--json"],
        capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)  # the whole stdout: NIXL's and the children's logs go to stderr
    assert set(summary) == {"tp1", "tp2"}
    for target in summary.values():
        assert target["tensors"] > 0 and target["identical"] == target["tensors"]
        assert target["mismatched"] == [] and target["missing"] == []
        assert target["bytes_pulled"] == target["bytes_needed"]
