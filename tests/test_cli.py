"""The `mx-refit` command line: `serve` with a token, and the subcommand surface."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from mx_refit.catalog.client import CatalogClient
from mx_refit.errors import Unauthenticated


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "mx_refit.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for command in ("demo", "serve", "verify"):
        assert command in out.stdout


@pytest.mark.timeout(120)
def test_serve_binds_loopback_and_enforces_the_token():
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mx_refit.cli", "-v", "serve", "--port", str(port), "--token", "s3cret"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:  # the server is up once an authenticated call succeeds
            try:
                with CatalogClient(address, token="s3cret", timeout_s=2, retries=0) as client:
                    assert client.list_versions("nothing-here") == []
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.3)
        for token in (None, "wrong"):
            with CatalogClient(address, token=token, timeout_s=2, retries=0) as client:
                with pytest.raises(Unauthenticated):
                    client.list_versions("nothing-here")
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert f"127.0.0.1:{port}" in output  # it says where it listens


def test_verify_is_dispatched_with_its_public_arguments(tmp_path):
    missing = tmp_path / "nope"
    out = subprocess.run(
        [sys.executable, "-m", "mx_refit.cli", "verify", "--hf-dir", str(missing), "--source-tp", "2",
         "--target-tp", "1", "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    assert f"--hf-dir {str(missing)!r} is not a directory" in out.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "mx_refit.cli", "verify", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    for flag in ("--hf-dir", "--source-tp", "--source-pp", "--source-ep", "--target-tp", "--target-ep", "--device", "--json"):
        assert flag in help_text
