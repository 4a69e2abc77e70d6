"""The mistakes a new user made on first contact (issue 14), each reproduced through the real
``mx-refit`` command: every one ends in ONE line on stderr, ``mx-refit: error: <cause>``, that
names the cause, with the documented exit code, within seconds, before any process starts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mx_refit.cli import EXIT_FAILURE, EXIT_MISSING_EXTRA, EXIT_USAGE

# Generous: a Python start plus the imports, on a loaded 2-core box. Preflight failures need no
# model building, no process spawning and no catalog, so they are far below it.
QUICK_S = 60


def mx(*args: str, env: dict[str, str] | None = None, timeout: float = QUICK_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mx_refit.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def one_line_error(out: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """The command failed with ``code`` and exactly one stderr line naming every needle."""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == code, out.stderr
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("mx-refit: error: "), lines[0]
    assert "Traceback" not in out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def hf_dir(path: Path, *, safetensors: bool = True, **config: object) -> Path:
    """A checkpoint directory whose config.json says ``config`` (Llama-like defaults)."""
    path.mkdir(parents=True, exist_ok=True)
    base = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "hidden_size": 64, "vocab_size": 128}
    (path / "config.json").write_text(json.dumps({k: v for k, v in {**base, **config}.items() if v is not None}))
    if safetensors:
        (path / "model.safetensors").write_bytes(b"")  # preflight reads only the listing
    return path


# -- 2. a missing optional dependency names its extra, never a hang ---------------------------------


def test_demo_without_torch_names_the_extra():
    # The documented way to make an installed module unimportable (what a venv without torch sees).
    code = ("import sys; sys.modules['torch'] = None; from mx_refit.cli import main; "
            "sys.exit(main(['demo', '--json']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=QUICK_S)
    one_line_error(out, EXIT_MISSING_EXTRA, "torch is not installed", "install `mx-refit[transport]`")
    assert out.stdout == ""


# -- 6. serve: port validation, port in use, a token file that is not there ---------------------------


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_rejects_a_bad_port(port):
    one_line_error(mx("serve", "--port", port), EXIT_USAGE, "--port", port)


def test_serve_on_a_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line_error(mx("serve", "--port", str(port)), EXIT_FAILURE, f"127.0.0.1:{port}")


def test_serve_with_a_missing_token_file(tmp_path):
    missing = tmp_path / "no-token"
    one_line_error(mx("serve", "--port", "0", "--token-file", str(missing)), EXIT_USAGE, "--token-file", str(missing))


# -- 7. --device cuda without CUDA --------------------------------------------------------------------


def test_demo_device_cuda_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    one_line_error(mx("demo", "--device", "cuda"), EXIT_USAGE, "--device cuda", "no CUDA device")


# -- 8, 9. layout mistakes caught from config.json before any process starts -----------------------------


@pytest.mark.parametrize(
    ("argv", "config", "needles"),
    [
        (["--source-tp", "3"], {}, ["--source-tp 3", "num_attention_heads=4"]),
        (["--source-tp", "2"], {"num_attention_heads": 12, "num_key_value_heads": 3},
         ["--source-tp 2", "num_key_value_heads=3"]),
        (["--source-ep", "2", "--source-dp", "1"], {"num_experts": 4}, ["--source-dp 1", "etp x ep = 2"]),
        (["--source-etp", "0"], {}, ["--source-etp 0 must be >= 1"]),
        (["--source-pp", "3"], {}, ["--source-pp 3", "num_hidden_layers=2"]),
        (["--source-ep", "2"], {}, ["--source-ep 2", "dense"]),
        (["--source-ep", "3"], {"num_experts": 4}, ["--source-ep 3", "num_experts=4"]),
        (["--target-tp", "3"], {}, ["--target-tp 3", "num_attention_heads=4"]),
        (["--target-ep", "2"], {}, ["--target-ep 2", "dense"]),
        (["--source-tp", "0"], {}, ["--source-tp 0 must be >= 1"]),
        ([], {"model_type": None}, ["no 'model_type'"]),
    ],
)
def test_verify_layout_mistakes_are_caught_from_config_json(tmp_path, argv, config, needles):
    started = time.monotonic()
    out = mx("verify", "--hf-dir", str(hf_dir(tmp_path / "ckpt", **config)), *argv, "--json")
    one_line_error(out, EXIT_USAGE, *needles)
    assert out.stdout == ""
    assert time.monotonic() - started < QUICK_S


@pytest.mark.parametrize("source_tp", [4, 8])
def test_kv_groups_fewer_than_source_tp_are_accepted(source_tp):
    # Megatron-Core accepts KV groups that divide TP (each rank holds one group, replicated).
    from mx_refit.preflight import check_layouts

    config = {"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2}
    check_layouts(config, source_tp=source_tp, targets=[(1, 1), (2, 1)])


def test_verify_without_config_json_or_weights(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(mx("verify", "--hf-dir", str(empty), "--json"), EXIT_USAGE, "has no config.json")
    no_weights = hf_dir(tmp_path / "no-weights", safetensors=False)
    one_line_error(mx("verify", "--hf-dir", str(no_weights), "--json"), EXIT_USAGE, "no *.safetensors")
    one_line_error(mx("verify", "--hf-dir", str(tmp_path / "nope"), "--json"), EXIT_USAGE, "does not exist")


def test_demo_model_with_a_tp_the_model_cannot_take(tmp_path):
    ckpt = hf_dir(tmp_path / "ckpt")
    one_line_error(mx("demo", "--model", str(ckpt), "--source-tp", "3"), EXIT_USAGE, "--source-tp 3",
                   "num_attention_heads=4")
    one_line_error(mx("demo", "--model", str(ckpt), "--target-tp", "1", "3"), EXIT_USAGE, "--target-tp 3")
    one_line_error(mx("demo", "--model", str(tmp_path / "nope")), EXIT_USAGE, "--model", "does not exist")


# -- 10, 11. plugins -------------------------------------------------------------------------------------


def test_an_unknown_plugin_is_one_line_before_anything_starts():
    out = mx("demo", "--json", env={"MX_REFIT_PLUGINS": "no-such-plugin"})
    one_line_error(out, EXIT_USAGE, "MX_REFIT_PLUGINS", "no-such-plugin")
    assert out.stdout == ""


def test_bad_flag_is_one_line():
    one_line_error(mx("demo", "--cycles", "many"), EXIT_USAGE, "--cycles", "many")
    one_line_error(mx("demo", "--cycles", "0"), EXIT_USAGE, "--cycles 0 must be >= 1")
    one_line_error(mx("nonsense"), EXIT_USAGE, "nonsense")


# -- 2. a child that dies is noticed within seconds ------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.timeout(300)
def test_demo_notices_a_child_that_dies():
    proc = subprocess.Popen([sys.executable, "-m", "mx_refit.cli", "demo", "--cycles", "1000", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        victims: list[int] = []
        while len(victims) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            victims = _children(proc.pid)  # 2 trainers + 1 receiver
        assert len(victims) >= 3, f"demo children not found: {victims}"
        os.kill(victims[0], signal.SIGKILL)
        killed_at = time.monotonic()
        out, err = proc.communicate(timeout=120)
        noticed_s = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == EXIT_FAILURE, err[-3000:]
    assert out == ""
    last = [line for line in err.splitlines() if line.startswith("mx-refit: error: ")]
    assert len(last) == 1 and "exited (code -9)" in last[0], err[-3000:]
    assert noticed_s < 60, noticed_s  # was a 600 s step timeout
