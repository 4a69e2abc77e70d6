"""First contact, tried as a new user would: a catalog that is down, an address that never
answers, an address without a port, a metrics port another process holds, SIGTERM to the demo,
``--transport cuda_ipc`` without a GPU. Each fails at once (or within its timeout) and says why."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mx_refit.catalog.client import CatalogClient
from mx_refit.errors import InvalidArgument, Unavailable
from mx_refit.testing.procs import refused_address


@pytest.fixture
def silent_address() -> Iterator[str]:
    """An address that accepts TCP connections (the kernel's backlog) and never says a word."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def test_refit_and_publish_against_a_catalog_that_is_down_fail_at_once() -> None:
    import torch

    from mx_refit import Publisher, Receiver

    with refused_address() as address:
        started = time.monotonic()
        with Receiver(address, "toy") as receiver, pytest.raises(Unavailable) as info:
            receiver.refit(1)
        assert time.monotonic() - started < 10  # it took 41 s (4 attempts x 10 s, DEADLINE_EXCEEDED)
        assert f"catalog at {address} is unreachable: connection refused" in str(info.value)
        started = time.monotonic()
        with Publisher(address, "toy", expected_sources=1) as publisher, pytest.raises(Unavailable) as info:
            publisher.publish(1, model={"w": torch.ones(4)})
        assert time.monotonic() - started < 10
        assert f"catalog at {address} is unreachable: connection refused" in str(info.value)


def test_an_address_that_never_answers_fails_within_the_timeout(silent_address: str) -> None:
    from mx_refit import Receiver

    client = CatalogClient(silent_address, timeout_s=2.0)
    started = time.monotonic()
    with Receiver(client, "toy") as receiver, pytest.raises(Unavailable) as info:
        receiver.refit(1)  # LeaseVersion: waits for a connection once the catalog answered, not before
    assert time.monotonic() - started < 6  # one timeout shared by the attempts, not one per attempt
    assert f"catalog at {silent_address} is unreachable: " in str(info.value)
    started = time.monotonic()
    with pytest.raises(Unavailable, match="is unreachable"):
        client.list_versions("toy")
    assert time.monotonic() - started < 6
    client.close()


def test_a_catalog_that_answered_once_is_retried_as_before() -> None:
    """After first contact the retries are the documented ones (each attempt its own timeout)."""
    from mx_refit.catalog.server import CatalogServer

    with CatalogServer() as server:
        client = CatalogClient(server.address, retries=2, backoff_s=0.01, timeout_s=2)
        assert client.list_versions("m") == []
    with pytest.raises(Unavailable, match=rf"catalog at {server.address} is unavailable after 3 attempt"):
        client.list_versions("m")
    client.close()


@pytest.mark.parametrize("address", ["localhost", "catalog.example.com", "10.0.0.5", "[::1]"])
def test_an_address_without_a_port_is_refused(address: str) -> None:
    from mx_refit import Receiver

    with pytest.raises(InvalidArgument, match=r"address: .* has no port \(expected host:port"):
        CatalogClient(address)
    with pytest.raises(InvalidArgument, match="has no port"):
        Receiver(address, "toy")


@pytest.mark.parametrize("address, needle", [
    ("localhost:http", "port 'http' is not a number"),
    ("localhost:70000", "port '70000' is not a number in 1-65535"),
    ("::1:50551", "an IPv6 address goes in brackets"),
])
def test_a_malformed_port_is_refused(address: str, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        CatalogClient(address)


@pytest.mark.parametrize("address", ["127.0.0.1:50551", "[::1]:50551", "catalog:1", "unix:/tmp/mx.sock",
                                     "dns:///catalog.example.com:50551"])
def test_addresses_with_a_port_or_a_scheme_are_taken(address: str) -> None:
    CatalogClient(address).close()


def test_a_metrics_port_another_process_holds_is_one_warning_not_a_crash() -> None:
    """Every worker of a multi-process engine inherits MX_REFIT_METRICS_PORT: the first binds it,
    the others warn once, naming the port, and run on."""
    pytest.importorskip("prometheus_client")
    code = ("from mx_refit.plugins import Hooks\n"
            "for _ in range(3):\n"
            "    names = [e['name'] for e in Hooks().describe()]\n"
            "print('mx_refit.metrics' in names)\n")
    with socket.socket() as first:  # the first worker's endpoint
        first.bind(("127.0.0.1", 0))
        first.listen()
        port = first.getsockname()[1]
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "MX_REFIT_METRICS_PORT": str(port)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # no endpoint here, no metrics plugin
    warnings = [line for line in out.stderr.splitlines() if "MX_REFIT_METRICS_PORT" in line]
    assert len(warnings) == 1, out.stderr
    assert f"MX_REFIT_METRICS_PORT={port}: 127.0.0.1:{port} is taken" in warnings[0]


def test_cuda_ipc_without_a_gpu_device_is_a_usage_error_at_once() -> None:
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "mx_refit.cli", "demo", "--transport", "cuda_ipc"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--transport cuda_ipc" in out.stderr and "--device cuda" in out.stderr
    assert time.monotonic() - started < 20  # the interpreter and imports only: no process started


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
@pytest.mark.timeout(600)
def test_sigterm_stops_the_demo_and_its_children() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "mx_refit.cli", "demo", "--cycles", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # children are up and refitting
            if line.startswith("cycle 1/"):
                break
        else:
            pytest.fail(f"the demo ended before its first cycle (exit {proc.wait()})")
        children = _children(proc.pid)
        assert len(children) >= 3  # two trainers and a receiver
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, rest[-3000:]  # interrupted
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in children if _alive(pid)], "demo children outlived SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_draining_an_unknown_version_is_not_found_and_arms_no_fence() -> None:
    """A typo (or a pruned version) answers NotFound at once; the next real drain does not sleep
    the lease fence (it slept 60 s by default)."""
    import torch

    from mx_refit import Publisher
    from mx_refit.catalog.server import CatalogServer
    from mx_refit.errors import NotFound

    with CatalogServer() as server, \
            Publisher(server.address, "typo", lease_fence_s=30, drain_timeout_s=20) as publisher:
        publisher.publish(1, model={"w": torch.ones(4)})
        started = time.monotonic()
        with pytest.raises(NotFound, match=r"wait_drained: version 7 of 'typo' is unknown to the catalog"):
            publisher.wait_drained(7)
        publisher.wait_drained(1)
        assert time.monotonic() - started < 10  # no 30 s fence


def test_a_not_found_longer_than_the_status_header_arrives_cut_to_fit() -> None:
    """A heartbeat naming 400 unknown sources: NotFound, its message cut to fit gRPC's 8 KiB
    header limit and saying so (it arrived as a random other status)."""
    from mx_refit.catalog.server import CatalogServer
    from mx_refit.errors import NotFound

    unknown = [f"trainer-rank-{i:04d}-of-a-long-job-name" for i in range(400)]
    with CatalogServer() as server, CatalogClient(server.address) as client:
        with pytest.raises(NotFound) as info:
            client.heartbeat(source_ids=unknown)
    message = str(info.value)
    assert message.startswith("heartbeat: unknown or expired source_ids")
    assert "truncated to fit gRPC's status header" in message
    assert unknown[0] in message and len(message.encode()) <= 4096


def test_plugin_tracing_never_writes_the_token() -> None:
    """MX_REFIT_TRACE_PLUGINS=1 logs every hook call with its arguments: the weight_sync block
    that mx_refit_configure gets holds the catalog token, which must not reach the log."""
    code = """
import logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
from mx_refit import start_catalog
from mx_refit.config import load_config
from mx_refit.publisher import Publisher
catalog = start_catalog(token="s3cret-token-value")
cfg = load_config({"method": "mx", "model_name": "traced",
                   "catalog": {"mode": "standalone", "address": catalog.address, "token": "s3cret-token-value"}})
print(repr(cfg), file=sys.stderr)
with Publisher.from_config(cfg, mesh=None, expected_sources=1) as publisher:
    print(publisher.client.list_versions("traced"))
catalog.stop()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MX_REFIT_TRACE_PLUGINS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"  # the token worked
    assert "mx_refit_configure [hook]" in out.stderr  # the call was traced ...
    assert "'token': '<redacted>'" in out.stderr
    assert "s3cret-token-value" not in out.stderr  # ... without the token, in the trace or a repr
