"""The README's code runs as written (extracted from the README's own text, not copied here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_python(heading: str) -> str:
    """The first ```python block under ``## heading`` in README.md."""
    text = (ROOT / "README.md").read_text()
    assert f"\n## {heading}\n" in text, f"README has no section {heading!r}"
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert blocks, f"README section {heading!r} has no python block"
    return blocks[0]


def test_publishing_from_megatron_core_runs_as_written(tmp_path):
    """On a real Megatron-Core rank (CPU, gloo, Megatron-Bridge) against an embedded gRPC catalog:
    every step's refit receives the model's weights as they were at that step, byte for byte."""
    pytest.importorskip("megatron.core")
    import mx_refit
    import torch
    from mx_refit.verify.harness import launch_ranks
    from safetensors.torch import load_file

    from tests.fixtures.megatron_jobs import readme_publish_job
    from tests.fixtures.tiny_hf import build_tiny_hf

    code = readme_python("Publishing from Megatron-Core")
    assert "mx_refit.Publisher(" in code and "import mx_refit" in code  # the front door only
    hf_dir = build_tiny_hf("llama_mha", tmp_path / "hf")
    checkpoint = load_file(str(hf_dir / "model.safetensors"))
    steps = 2
    server = mx_refit.start_catalog()
    try:
        (result,) = launch_ranks(readme_publish_job, 1, code, str(hf_dir), server.address, steps, timeout_s=600)
        states = [(v.version, v.state.value) for v in server.service.list_versions("qwen3-30b-a3b")]
    finally:
        server.stop(0)
    assert states == [(step, "RETIRED") for step in range(steps)]  # every version drained
    assert result["tasks_kept"]  # Bridge's tasks computed once, kept on the public field
    assert (result["handed_state"], result["handed_task_calls"]) == ("READY", 0)  # handed-over tasks reused
    seen = result["seen"]
    assert sorted(seen) == list(range(steps))
    for step in range(steps):
        assert sorted(seen[step]) == sorted(checkpoint), f"step {step}: received names differ"
        for name, original in checkpoint.items():
            expected = original - 0.25 * step  # SGD, lr 0.25, gradients of one, per step
            assert torch.equal(seen[step][name], expected), f"step {step}: {name} differs"


def test_writing_a_plugin_example_runs_as_written():
    code = readme_python("Writing a plugin")
    assert "import mx_refit" in code and "mx_refit.catalog" not in code and "mx_refit.plugins" not in code
    names: dict = {}
    exec(compile(code, "README.md: Writing a plugin", "exec"), names)  # noqa: S102
    assert names["engine"].weights["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert names["cfg"].plugin_settings == {"toy": {"knob": 1}}
