"""``DynamoRefitClient`` against two Dynamo 1.6.1 workers (real runtime, routes and handler) in
front of real vLLM ranks (TP 1 and TP 2), fed by real trainers over a real catalog and NIXL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import HERE, DynamoWorkerProc

from mx_refit.testing.procs import core_python, rendezvous_url, start_group, vllm_python
from mx_refit_dynamo import DynamoRefitClient, DynamoRefitError

pytestmark = pytest.mark.timeout(900)

CYCLE = [
    "pause_generation",
    "rpc:start_weight_update",
    "rpc:update_weights",
    "rpc:finish_weight_update",
    "reset_prefix_cache",  # Dynamo's finish route resets it; the client asks for nothing more
    "resume_generation",
]
FAILED_UPDATE = ["pause_generation", "rpc:start_weight_update", "rpc:update_weights", "resume_generation"]


def client_for(workers: list[DynamoWorkerProc], **kwargs) -> DynamoRefitClient:
    for worker in workers:
        worker.calls()  # start each test from a clean record
    return DynamoRefitClient([w.system_url for w in workers], **kwargs)


def publish_hf(catalog: str, model: str, version: int, hf_dir: Path) -> subprocess.Popen:
    """A throwaway source process (whole HF tensors); returns once the version is READY."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_hf_source.py"), catalog, model, str(version), str(hf_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # NIXL logs to stdout too
        if line.strip() == "ready":
            return proc
    raise AssertionError(f"source for v{version} did not come up (exit {proc.wait(10)})")


@pytest.fixture
def sources() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def megatron(dynamo_workers, ckpts, log_dir):
    python = core_python()
    if python is None:
        pytest.fail("the core venv (megatron-core + Megatron-Bridge) is needed: set MX_REFIT_CORE_PYTHON")
    from mx_refit import start_catalog

    server = start_catalog()
    rendezvous = rendezvous_url(log_dir)
    readers = sum(w.tp for w in dynamo_workers)  # one reader per vLLM rank
    args = [
        ["--rank", str(r), "--world", "2", "--dist-init", rendezvous, "--catalog", server.address,
         "--model-name", "dyn-megatron", "--readers", str(readers)]
        for r in range(2)
    ]
    group = start_group("megatron", python, str(HERE / "_megatron_rank.py"), args, log_dir)
    yield server.address, group
    group.stop()
    server.stop(0)


def test_megatron_tp2_publisher_drives_two_dynamo_workers(megatron, dynamo_workers, ckpts) -> None:
    """Case 1: byte-identical on every rank of both workers, 0 new registrations on cycle 2, and
    the driverless publisher returns from wait_read only once all 3 readers completed."""
    catalog, ranks = megatron
    client = client_for(dynamo_workers)
    client.init_weight_transfer_engine({"catalog": catalog, "model": "dyn-megatron", "transfer_timeout_s": 120.0})
    assert [w.calls() for w in dynamo_workers] == [["rpc:init_weight_transfer_engine"]] * 2
    registrations = None
    for version in (1, 2):
        published = ranks.call("publish", (version, str(ckpts[version])), timeout_s=600)
        report = client.refit(version)
        assert report.weight_version == str(version)
        ranks.call("wait_read", (version, 120.0))  # every rank, returns once 3 readers completed
        for worker in dynamo_workers:
            worker.check(ckpts[version])
            worker.current = ckpts[version]
            assert worker.calls() == CYCLE  # no re-init: once per worker
        stats = [s["registrations"] for w in dynamo_workers for s in w.ranks("stats")]
        if registrations is None:
            registrations = (stats, [p["registrations"] for p in published])
        else:
            assert (stats, [p["registrations"] for p in published]) == registrations, "cycle 2 registered memory"
    assert client.weight_versions() == {w.system_url: "2" for w in dynamo_workers}


def test_update_failures_resume_keep_weights_and_the_next_cycle_works(
    dynamo_workers, ckpts, mx_catalog, model_name, sources
) -> None:
    """Case 2: unknown version, catalog down, a source killed before the reads finish."""
    from mx_refit import start_catalog

    client = client_for(dynamo_workers, timeout_s=300.0)
    init = {"catalog": mx_catalog, "model": model_name, "transfer_timeout_s": 30.0}
    client.init_weight_transfer_engine(init)

    def failing_cycle(version: int, expect: str) -> None:
        for worker in dynamo_workers:
            worker.calls()
        with pytest.raises(DynamoRefitError, match=expect) as caught:
            client.refit(version)
        assert caught.value.step == "update_weights"
        assert sorted(caught.value.resumed) == sorted(w.system_url for w in dynamo_workers)
        assert caught.value.updated == ()
        for worker in dynamo_workers:
            assert worker.calls() == FAILED_UPDATE, "not resumed, or finished after vLLM ended the session"
            worker.assert_untouched()

    sources.append(publish_hf(mx_catalog, model_name, 4, ckpts[4]))  # READY, for the last cycle
    failing_cycle(99, f"'{model_name}' has no version 99")  # unknown version

    down = start_catalog()
    client.init_weight_transfer_engine({**init, "catalog": down.address})
    down.stop(0)
    failing_cycle(1, "Unavailable|unreachable|catalog")  # catalog down

    client.init_weight_transfer_engine(init)
    doomed = publish_hf(mx_catalog, model_name, 3, ckpts[3])
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)
    failing_cycle(3, "TransferError|NIXL|transfer")  # its source died before the reads

    client.refit(4)
    for worker in dynamo_workers:
        worker.check(ckpts[4])
        worker.current = ckpts[4]
        assert worker.calls() == CYCLE


def test_unpaused_update_is_refused_and_the_opt_in_mode_works(
    dynamo_workers, ckpts, mx_catalog, model_name, sources
) -> None:
    """Case 3: Dynamo refuses an update to an unpaused worker; ``pause=False`` opts in."""
    worker = dynamo_workers[0]
    client_for(dynamo_workers)
    body = json.dumps({"engine_rpc": "start_weight_update", "reset_prefix_cache": False}).encode()
    request = urllib.request.Request(
        f"{worker.system_url}/engine/update_weights_from_distributed", data=body, method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        reply = json.loads(response.read())
    assert reply["status"] == "error" and "must be paused" in reply["message"]
    assert worker.calls() == []  # refused before reaching vLLM

    sources.append(publish_hf(mx_catalog, model_name, 2, ckpts[2]))
    client = client_for(dynamo_workers, pause=False)
    client.refit(2, init_info={"catalog": mx_catalog, "model": model_name})
    for w in dynamo_workers:
        w.check(ckpts[2])
        w.current = ckpts[2]
        # No pause, no resume, and no prefix-cache reset (Dynamo refuses one without a pause).
        assert w.calls() == [
            "rpc:init_weight_transfer_engine",
            "rpc:start_weight_update",
            "rpc:update_weights",
            "rpc:finish_weight_update",
        ]


def test_client_is_the_vllm_sync_client_of_the_trainer_engine(
    dynamo_workers, ckpts, mx_catalog, model_name, log_dir
) -> None:
    """Case 4: vLLM's trainer API (MxTrainerWeightTransferEngine, DTensor ModuleSource) with the
    Dynamo client in place of vLLM's HTTP client."""
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient

    assert isinstance(client_for(dynamo_workers), VLLMWeightSyncClient)
    rendezvous = rendezvous_url(log_dir)
    urls = ",".join(w.system_url for w in dynamo_workers)
    args = [
        ["--rank", str(r), "--world", "2", "--dist-init", rendezvous, "--catalog", mx_catalog,
         "--model-name", model_name, "--workers", urls, "--hf-dir", str(ckpts[0])]
        for r in range(2)
    ]
    trainers = start_group("dtensor", vllm_python(), str(HERE / "_dtensor_trainer.py"), args, log_dir)
    try:
        for version in (1, 3):
            trainers.call("send", (version, str(ckpts[version])), timeout_s=600)
            for worker in dynamo_workers:
                worker.check(ckpts[version])
                worker.current = ckpts[version]
        # The trainer engine stages then commits (two update calls); the Dynamo client pauses
        # around its own session, so the engine adds no pause of its own.
        staged_cycle = [*CYCLE[:3], "rpc:update_weights", *CYCLE[3:]]
        for worker in dynamo_workers:
            assert worker.calls()[-len(staged_cycle) :] == staged_cycle
    finally:
        trainers.stop()


def test_from_frontend_reads_the_workers_real_route_descriptors(dynamo_workers) -> None:
    """Case 6 (live part): each worker's own RL route registry answers the frontend's probe; a
    /v1/rl/workers reply built from those answers (as the 1.6.1 frontend builds it) yields the
    same workers, world sizes included."""
    rows = []
    for index, worker in enumerate(dynamo_workers):
        descriptor = worker.call("describe")
        assert descriptor["status"] == "ok" and descriptor["world_size"] == worker.tp
        rows.append({
            "namespace": worker.name, "component": "backend", "endpoint": "rl", "instance_id": 7000 + index,
            "transport": {"tcp": "127.0.0.1:0"}, "request_plane_url": "tcp://127.0.0.1:0",
            "model": "qwen2", **{k: v for k, v in descriptor.items() if k != "status"},
        })
    reply = json.dumps({"protocol_version": 1, "namespace": "dynamo", "workers": rows}).encode()

    class Frontend(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            status = 200 if self.path == "/v1/rl/workers" else 404
            self.send_response(status)
            self.send_header("Content-Length", str(len(reply) if status == 200 else 0))
            self.end_headers()
            if status == 200:
                self.wfile.write(reply)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Frontend)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = DynamoRefitClient.from_frontend(f"http://127.0.0.1:{server.server_address[1]}/v1")
        assert [(w.system_url, w.world_size) for w in client.workers] == [
            (w.system_url, w.tp) for w in dynamo_workers
        ]
    finally:
        server.shutdown()
        server.server_close()


def test_refit_staged_pauses_only_around_the_commit(megatron, dynamo_workers, ckpts) -> None:
    """Stage before the pause (generation goes on while the bytes arrive), commit between pause
    and resume; every rank of both workers ends byte-identical to the checkpoint."""
    catalog, ranks = megatron
    client = client_for(dynamo_workers)
    client.init_weight_transfer_engine({"catalog": catalog, "model": "dyn-megatron", "transfer_timeout_s": 120.0})
    for worker in dynamo_workers:
        worker.calls()
    ranks.call("publish", (3, str(ckpts[3])), timeout_s=600)
    report = client.refit_staged(3, wait_s=30.0)
    assert report.weight_version == "3"
    for worker in dynamo_workers:
        worker.check(ckpts[3])
        worker.current = ckpts[3]
        assert worker.calls() == [
            "rpc:start_weight_update",
            "rpc:update_weights",  # phase "stage": unpaused, returns at once
            "pause_generation",
            "rpc:update_weights",  # phase "commit"
            "rpc:finish_weight_update",
            "reset_prefix_cache",
            "resume_generation",
        ]
