"""The main job: `mx-refit demo --json` end to end (3 processes, embedded catalog, NIXL on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(900)
def test_demo_json_reports_every_tensor_identical():
    out = subprocess.run(
        [sys.executable, "-m", "mx_refit.cli", "demo", "--json"], capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(summary) == {"cycles", "tensors_per_cycle", "identical", "mismatched", "bytes_per_cycle", "gbps"}
    assert summary["cycles"] == 3
    assert summary["tensors_per_cycle"] == 75  # 8 Llama layers x 9 + embeddings, norm, lm_head
    assert summary["mismatched"] == 0
    assert summary["identical"] == 3 * 75
    assert summary["bytes_per_cycle"] > 300e6
    assert len(summary["gbps"]) == 3 and all(g > 0 for g in summary["gbps"])
    assert "cycle 3/3" in out.stderr  # progress goes to stderr when --json owns stdout
