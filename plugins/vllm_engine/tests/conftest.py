"""Fixtures: checkpoints, a real catalog, vLLM worker groups (TP 1 and TP 2), the RL relay.

Worker processes are expensive (vLLM import + model build, ~15 s each on a small CPU), so both
groups start once per session, concurrently, and every test re-initialises their engines with
its own model name. Each group remembers which checkpoint its live weights equal, so any test
can assert "weights untouched" byte for byte.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from _relay import Relay

from mx_refit.testing.checkpoints import build_version
from mx_refit.testing.procs import Group, rendezvous_url, start_group, vllm_python

HERE = Path(__file__).resolve().parent


class Workers:
    """A vLLM worker group plus the checkpoint its weights currently equal."""

    def __init__(self, group: Group, current: Path) -> None:
        self.group = group
        self.current = current
        self.tp = len(group)

    def rpc(self, method: str, **kwargs):
        return self.group.rpc(method, **kwargs)

    def check(self, hf_dir: Path) -> None:
        """Assert every live parameter equals ``hf_dir`` loaded by vLLM's own loader, bytewise."""
        for rank, report in enumerate(self.group.call("check", str(hf_dir))):
            assert report["compared"] > 0
            assert report["mismatched"] == [], (
                f"TP rank {rank}: {report['mismatched']} differ from {hf_dir.name}"
            )

    def assert_untouched(self) -> None:
        self.check(self.current)

    def stats(self) -> list[dict]:
        return self.group.call("stats")

    def refit(self, init_info: dict, update_info, hf_dir: Path) -> None:
        """A full init -> start -> update -> finish cycle that must succeed and land ``hf_dir``."""
        self.rpc("init_weight_transfer_engine", init_info=init_info)
        self.rpc("start_weight_update")
        self.rpc("update_weights", update_info=update_info)
        self.rpc("finish_weight_update")
        self.check(hf_dir)
        self.current = hf_dir


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {v: build_version(root, v) for v in range(5)}


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def worker_groups(ckpts: dict[int, Path], log_dir: Path) -> Iterator[dict[int, Workers]]:
    def start(tp: int) -> Group:
        rendezvous = rendezvous_url(log_dir)
        args = [
            ["--rank", str(r), "--world", str(tp), "--dist-init", rendezvous, "--hf-dir", str(ckpts[0])]
            for r in range(tp)
        ]
        return start_group(f"vllm-tp{tp}", vllm_python(), HERE / "_vllm_worker.py", args, log_dir)

    with ThreadPoolExecutor(2) as pool:
        futures = {tp: pool.submit(start, tp) for tp in (1, 2)}
        groups = {}
        for tp, future in futures.items():
            groups[tp] = Workers(future.result(), ckpts[0])
    try:
        yield groups
    finally:
        for workers in groups.values():
            workers.group.stop()


@pytest.fixture
def tp1(worker_groups: dict[int, Workers]) -> Workers:
    return worker_groups[1]


@pytest.fixture
def tp2(worker_groups: dict[int, Workers]) -> Workers:
    return worker_groups[2]


@pytest.fixture(scope="session")
def relay() -> Iterator[Relay]:
    server = Relay()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def model_name(request: pytest.FixtureRequest) -> str:
    return "vllm-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60]
