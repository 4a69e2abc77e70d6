"""The `mx-refit` command line: `serve` with a token, and the subcommand surface."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from mx_refit.catalog.client import CatalogClient
from mx_refit.errors import Unauthenticated


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "mx_refit.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for command in ("demo", "serve", "verify"):
        assert command in out.stdout


@pytest.mark.timeout(120)
def test_serve_binds_loopback_and_enforces_the_token():
    # Port 0: the server binds a port and says which (a port probed free beforehand may be taken
    # by a neighbouring test before the server binds it).
    proc = subprocess.Popen(
        [sys.executable, "-m", "mx_refit.cli", "-v", "serve", "--port", "0", "--token", "s3cret"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the announcement comes once the port is bound
            lines.append(line)
            found = re.search(r"mx-refit catalog listening on (127\.0\.0\.1:(\d+))", line)
            if found:
                address, port = found.group(1), int(found.group(2))
                break
        else:
            raise AssertionError("serve exited without announcing its address:\n" + "".join(lines))
        assert port > 0
        with CatalogClient(address, token="s3cret", timeout_s=2, retries=0) as client:
            assert client.list_versions("nothing-here") == []
        for token in (None, "wrong"):
            with CatalogClient(address, token=token, timeout_s=2, retries=0) as client:
                with pytest.raises(Unauthenticated):
                    client.list_versions("nothing-here")
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, "".join(lines) + output


def test_verify_is_dispatched_with_its_public_arguments(tmp_path):
    missing = tmp_path / "nope"
    out = subprocess.run(
        [sys.executable, "-m", "mx_refit.cli", "verify", "--hf-dir", str(missing), "--source-tp", "2",
         "--target-tp", "1", "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == f"mx-refit: error: verify: --hf-dir {str(missing)!r} does not exist"
    assert out.stdout == ""
    help_text = subprocess.run(
        [sys.executable, "-m", "mx_refit.cli", "verify", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    for flag in ("--hf-dir", "--source-tp", "--source-pp", "--source-ep", "--target-tp", "--target-ep", "--device", "--json"):
        assert flag in help_text


def _start_serve(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, dict]:
    """`mx-refit serve --json ...`; returns the process and its one JSON line."""
    import json
    import os

    proc = subprocess.Popen(
        [sys.executable, "-m", "mx_refit.cli", "serve", "--port", "0", "--json", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )
    line = proc.stdout.readline()  # bounded: the test's own timeout
    assert line, proc.stderr.read() if proc.poll() is not None else "no output"
    return proc, json.loads(line)


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out == "", out  # nothing after the one JSON line
    return err


@pytest.mark.timeout(120)
def test_serve_json_line_health_service_and_token_from_the_environment():
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    proc, info = _start_serve(env={"MX_REFIT_TOKEN": "from-env"})
    try:
        assert info["port"] > 0 and info["address"] == f"127.0.0.1:{info['port']}"
        assert info["token"] is True and info["health"] == "grpc.health.v1.Health" and info["metrics"] is None
        assert info["express_port"] > 0 and info["express_port"] != info["port"]
        with grpc.insecure_channel(info["address"]) as channel:  # probes carry no token
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "mx_refit.catalog.v1.CatalogService"):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with CatalogClient(info["address"], token="from-env", timeout_s=5, retries=0) as client:
            assert client.list_versions("nothing-here") == []
        with CatalogClient(info["address"], token=None, timeout_s=5, retries=0) as client:
            with pytest.raises(Unauthenticated):
                client.list_versions("nothing-here")
    finally:
        _stop(proc)


@pytest.mark.timeout(180)
def test_serve_stops_cleanly_when_terminated_right_after_its_json_line():
    # A supervisor may stop the server the moment it has read the line: the handlers must
    # already be installed then (CI once saw death by SIGTERM, exit -15, in that window).
    for _ in range(3):
        proc, info = _start_serve()
        assert info["port"] > 0
        _stop(proc)


@pytest.mark.timeout(120)
def test_serve_token_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    proc, info = _start_serve("--token-file", str(token_file), "--no-express")
    try:
        assert info["express_port"] == 0
        with CatalogClient(info["address"], token="from-file", timeout_s=5, retries=0) as client:
            assert client.list_versions("nothing-here") == []
    finally:
        _stop(proc)


def test_version_and_log_level_anywhere():
    from mx_refit import __version__

    out = subprocess.run([sys.executable, "-m", "mx_refit.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"mx-refit {__version__}"
    for argv in (["--log-level", "debug", "plugins", "--json"], ["plugins", "--json", "--log-level", "DEBUG"]):
        out = subprocess.run([sys.executable, "-m", "mx_refit.cli", *argv], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert isinstance(__import__("json").loads(out.stdout), list)


def test_plugins_lists_what_loaded_and_the_hooks(monkeypatch):
    import json

    out = subprocess.run([sys.executable, "-m", "mx_refit.cli", "plugins", "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    listing = {entry["name"]: entry for entry in json.loads(out.stdout)}
    assert "mx_refit_collect_tensors" in listing["mx_refit.builtin"]["hooks"]
    from mx_refit.plugins import BUILTIN_PLUGINS

    assert set(BUILTIN_PLUGINS) <= set(listing)
    assert any("mx_refit_build_sidecar" in listing[name]["hooks"] for name in BUILTIN_PLUGINS)
    text = subprocess.run([sys.executable, "-m", "mx_refit.cli", "plugins"], capture_output=True, text=True, timeout=60)
    assert "mx_refit.builtin (built-in): " in text.stdout


def test_plugins_names_the_distribution_that_installed_a_plugin(tmp_path):
    """A plugin loaded from an installed distribution's entry point is labelled with that
    distribution and its version, never "built-in"."""
    import os
    from pathlib import Path

    info = tmp_path / "mx_refit_sample-1.2.3.dist-info"  # what pip leaves in site-packages
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mx-refit-sample\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text("[mx_refit]\nsample = plugin_samples.good\n")
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(tests), os.environ.get("PYTHONPATH", "")])}
    text = subprocess.run([sys.executable, "-m", "mx_refit.cli", "plugins"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert text.returncode == 0, text.stderr
    assert "sample (mx-refit-sample 1.2.3): " in text.stdout
    assert "mx_refit.builtin (built-in): " in text.stdout
