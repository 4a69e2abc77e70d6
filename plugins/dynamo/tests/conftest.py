"""Fixtures: checkpoints, Dynamo worker processes (real Dynamo 1.6.1 runtime, routes, handler)
in front of real vLLM worker ranks, and the list of what this suite does not run.

The vLLM ranks are the vLLM plugin's own test workers (``plugins/vllm_engine/tests``), reused
rather than duplicated; each Dynamo worker process starts its own ranks, as ``dynamo.vllm``
starts its engine.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from mx_refit.testing.checkpoints import build_version
from mx_refit.testing.procs import Child, start_concurrently

HERE = Path(__file__).resolve().parent

NOT_RUN = (
    "python -m dynamo.vllm: Dynamo 1.6.1's dynamo.vllm.main does not import on vLLM 0.33 "
    "(`get_engine_zmq_addresses` is gone from vllm.v1.engine.utils), so no released Dynamo can "
    "serve with the mx backend yet; the routes and handler run here, AsyncLLM/EngineCore do not",
    "GPUs: everything runs on CPU (UCX loopback in DRAM); no NIXL transfer into GPU memory",
    "a live Dynamo frontend: /v1/rl/workers is parsed from a reply built from the workers' real "
    "route descriptors, not served by dynamo.frontend (its HTTP service needs the full runtime)",
    "NeMo RL driving Dynamo workers: at NeMo RL HEAD its Dynamo backend requires "
    "refit_transport: null and forces --weight-transfer-config {\"backend\":\"nccl\"}, and NeMo RL "
    "is not installable here",
    "Dynamo's development-branch mx engine and MX route (dev branch only, not released): the "
    "backend-name test registers an engine with that branch's init-info shape in its place",
    "DynamoWorkerExtension (Dynamo main only; 1.6.1 has FpmGcWorkerExtension, which is tested)",
)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.section("mx-refit-dynamo: not run here")
    for line in NOT_RUN:
        terminalreporter.write_line(f"- {line}")


class DynamoWorkerProc:
    """One ``_dynamo_worker.py`` process: a Dynamo worker and the vLLM ranks behind it."""

    def __init__(self, name: str, tp: int, hf_dir: Path, log_dir: Path, **extra: str) -> None:
        args = ["--namespace", name, "--tp", str(tp), "--hf-dir", str(hf_dir), "--log-dir", str(log_dir)]
        for key, value in extra.items():
            args += [f"--{key.replace('_', '-')}", value]
        # Port 0: the system server binds a free port and the worker reports its URL, so no
        # port is probed here and taken by someone else before Dynamo binds it.
        env = {"DYN_SYSTEM_PORT": "0", "DYN_SYSTEM_HOST": "127.0.0.1", "DYN_NAMESPACE": name}
        self.child = Child(name, sys.executable, str(HERE / "_dynamo_worker.py"), args, log_dir, env, 1500.0)
        self.name = name
        self.tp = tp
        self.system_url: str = self.child.hello["system_url"]
        self.current = hf_dir  # the checkpoint the live weights equal

    def call(self, cmd: str, arg: Any = None) -> Any:
        return self.child.call(cmd, arg, timeout_s=600.0)

    def calls(self) -> list[str]:
        """Engine-client calls the routes made since the last ask, as 'name' or 'rpc:method'."""
        return [f"rpc:{d}" if n == "collective_rpc" else n for n, d in self.call("calls")]

    def ranks(self, cmd: str, arg: Any = None) -> list[Any]:
        return self.call("ranks", (cmd, arg))

    def check(self, hf_dir: Path) -> None:
        """Every live parameter of every rank equals ``hf_dir`` loaded by vLLM's own loader."""
        for rank, report in enumerate(self.ranks("check", str(hf_dir))):
            assert report["compared"] > 0
            assert report["mismatched"] == [], f"{self.name} rank {rank}: {report['mismatched']} differ from {hf_dir.name}"

    def assert_untouched(self) -> None:
        self.check(self.current)

    def stop(self) -> None:
        self.child.stop()


def start_workers(specs: list[tuple[str, int]], hf_dir: Path, log_dir: Path, **extra: str) -> list[DynamoWorkerProc]:
    return start_concurrently(
        [partial(DynamoWorkerProc, name, tp, hf_dir, log_dir, **extra) for name, tp in specs],
        stop=DynamoWorkerProc.stop,
    )


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {v: build_version(root, v) for v in range(5)}


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def dynamo_workers(ckpts: dict[int, Path], log_dir: Path) -> Iterator[list[DynamoWorkerProc]]:
    """Two Dynamo workers: one in front of a vLLM TP 1 rank, one in front of TP 2 ranks."""
    workers = start_workers([("dyn-a", 1), ("dyn-b", 2)], ckpts[0], log_dir)
    try:
        yield workers
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture
def model_name(request: pytest.FixtureRequest) -> str:
    return "dyn-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60]
