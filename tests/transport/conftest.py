"""Fixtures for real two-process NIXL transfers: spawned source processes and one reader agent."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import runpy
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

_SOURCE_PATH = Path(__file__).with_name("_source.py")


def _load_source_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mx_refit_transport_test_source", _SOURCE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


source_module = _load_source_module()


class SourceProc:
    """A spawned publisher process (see ``_source.py``) and the info it sent back.

    Starting does not wait: ``info`` blocks until the source has registered and reported, so
    several sources can boot concurrently."""

    def __init__(
        self, agent: str, seed: int, *, device: str = "cpu", start_timeout_s: float = 90.0
    ) -> None:
        ctx = mp.get_context("spawn")
        self.agent = agent
        self.seed = seed
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=runpy.run_path,
            args=(str(_SOURCE_PATH),),
            kwargs={
                "init_globals": {"SOURCE_ARGS": {"conn": child, "agent": agent, "seed": seed, "device": device}},
                "run_name": "__mx_transport_source__",
            },
            daemon=True,
            name=f"source-{agent}",
        )
        self.proc.start()
        child.close()
        self._start_timeout_s = start_timeout_s
        self._info: dict[str, Any] | None = None

    @property
    def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = self._recv(self._start_timeout_s)
        return self._info

    def _recv(self, timeout_s: float) -> dict[str, Any]:
        if not self.conn.poll(timeout_s):
            self.kill()
            raise TimeoutError(f"source {self.agent} sent nothing within {timeout_s} s")
        return self.conn.recv()

    @property
    def metadata(self) -> bytes:
        return self.info["metadata"]

    def addr(self, name: str) -> int:
        return self.info["tensors"][name][0]

    def add_tensor(self) -> dict[str, Any]:
        """Ask the source to register one more tensor; returns its refreshed info."""
        _ = self.info
        self.conn.send("add")
        self._info = self._recv(30.0)
        return self._info

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send("exit")
            except OSError:
                pass
            self.proc.join(15)
        self.kill()
        self.conn.close()


@pytest.fixture(scope="session")
def patterns() -> ModuleType:
    """``_source.py`` as a module (``make_patterns``, ``make_extra``, sizes)."""
    return source_module


@pytest.fixture(scope="session")
def spawn_source() -> type[SourceProc]:
    """``SourceProc(agent, seed)``: spawn an extra source (the caller stops it)."""
    return SourceProc


@pytest.fixture(scope="module")
def reader() -> Iterator[Any]:
    """The test process's NIXL agent (one per module, like one per process in production)."""
    pytest.importorskip("torch")
    from mx_refit.transport.nixl import NixlTransport

    transport = NixlTransport(f"reader-{os.getpid()}", max_retries=2, timeout_s=10.0, retry_backoff_s=0.05)
    yield transport
    transport.close()


@pytest.fixture(scope="module")
def source() -> Iterator[SourceProc]:
    """One long-lived source process serving every test of a module."""
    proc = SourceProc("src-main", seed=11)
    yield proc
    proc.stop()
