"""Child processes the tests drive over authenticated local sockets (the same harness as
plugins/vllm_engine/tests/_procs.py, without its HTTP relay).

Each child runs one script under a given interpreter: policy ranks in the core venv (megatron-core,
Megatron-Bridge), rollout ranks in the vLLM venv.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RemoteError(RuntimeError):
    """A child answered a command with an exception: ``kind`` is its type name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class Child:
    """One child process and its command connection."""

    def __init__(
        self,
        name: str,
        python: str,
        script: str,
        args: Sequence[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 300.0,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = listener.address
        address = f"{host}:{port}"
        child_env = {**os.environ, **(env or {}), "MX_TEST_AUTHKEY": authkey.hex(), "PYTHONUNBUFFERED": "1"}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [python, str(HERE / script), "--listen", address, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=str(HERE),
        )
        accepted: list[Connection] = []
        thread = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + start_timeout_s
        while thread.is_alive() and time.monotonic() < deadline and self.proc.poll() is None:
            thread.join(0.2)
        listener.close()
        if not accepted:
            self.kill()
            raise RuntimeError(f"{name} never connected (exit {self.proc.poll()}):\n{self.log_tail()}")
        self.conn = accepted[0]
        self.stopped = False
        self.hello = self.recv(start_timeout_s)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def send(self, cmd: str, arg: Any = None) -> None:
        self.conn.send((cmd, arg))

    def recv(self, timeout_s: float = 300.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.2):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} died (exit {self.proc.returncode}):\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not answer within {timeout_s}s:\n{self.log_tail()}")
        status, value = self.conn.recv()
        if status == "err":
            kind, message = value
            if kind == "StartupError":
                raise RuntimeError(f"{self.name} failed to start:\n{message}\n{self.log_tail()}")
            raise RemoteError(kind, message)
        return value

    def call(self, cmd: str, arg: Any = None, timeout_s: float = 300.0) -> Any:
        self.send(cmd, arg)
        return self.recv(timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            if not self.stopped:
                try:
                    self.call("stop", timeout_s=30)
                except Exception:
                    pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Group:
    """Children that receive every command together, like vLLM's ``collective_rpc``."""

    def __init__(self, children: list[Child]) -> None:
        self.children = children

    def __len__(self) -> int:
        return len(self.children)

    def call(self, cmd: str, arg: Any = None, timeout_s: float = 300.0) -> list[Any]:
        """Send to all, then collect all; raise the first rank's error after every rank answered."""
        self.submit(cmd, arg)
        return self.collect(timeout_s)

    def submit(self, cmd: str, arg: Any = None) -> Group:
        """Start ``cmd`` on every rank without waiting (collect the answers with :meth:`collect`)."""
        for child in self.children:
            child.send(cmd, arg)
        return self

    def collect(self, timeout_s: float = 300.0) -> list[Any]:
        """Every rank's answer to the last :meth:`submit`; the first error after all answered."""
        results, errors = [], []
        for child in self.children:
            try:
                results.append(child.recv(timeout_s))
            except RemoteError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return results

    def rpc(self, method: str, **kwargs: Any) -> list[Any]:
        return self.call("rpc", (method, kwargs))

    def stop(self) -> None:
        """Stop every rank together: ranks of one process group may wait for each other on exit."""
        live = [c for c in self.children if c.proc.poll() is None]
        for child in live:
            try:
                child.send("stop")
            except OSError:
                pass
        for child in live:
            try:
                child.recv(timeout_s=30)
            except Exception:
                pass
            child.stopped = True
        for child in self.children:
            child.stop()


def start_group(
    prefix: str,
    python: str,
    script: str,
    per_rank_args: list[list[str]],
    log_dir: Path,
    env: dict[str, str] | None = None,
) -> Group:
    """Start one child per rank concurrently (their startups overlap)."""
    with ThreadPoolExecutor(len(per_rank_args)) as pool:
        futures = [
            pool.submit(Child, f"{prefix}-{rank}", python, script, args, log_dir, env)
            for rank, args in enumerate(per_rank_args)
        ]
        children, failures = [], []
        for future in futures:
            try:
                children.append(future.result())
            except Exception as exc:
                failures.append(exc)
    if failures:
        for child in children:
            child.kill()
        raise failures[0]
    return Group(children)


def vllm_python() -> str | None:
    """The vLLM venv's interpreter: ``$MX_REFIT_VLLM_PYTHON``, else the newest complete
    ``scripts/dev`` vLLM venv under ``$MX_REFIT_CACHE``."""
    return _venv_python("MX_REFIT_VLLM_PYTHON", "vllm")


def core_python() -> str | None:
    """The core venv's interpreter (megatron-core + Megatron-Bridge): ``$MX_REFIT_CORE_PYTHON``,
    else the newest complete ``scripts/dev`` core venv under ``$MX_REFIT_CACHE``."""
    return _venv_python("MX_REFIT_CORE_PYTHON", "core")


def _venv_python(variable: str, kind: str) -> str | None:
    explicit = os.environ.get(variable)
    if explicit:
        return explicit if os.path.exists(explicit) else None
    cache = Path(os.environ.get("MX_REFIT_CACHE", Path.home() / ".cache" / "mx-refit"))
    built = sorted(cache.glob(f"venv-{kind}-*/.complete"), key=lambda p: p.stat().st_mtime, reverse=True)
    for marker in built:
        python = marker.parent / "bin" / "python"
        if python.exists():
            return str(python)
    return None
