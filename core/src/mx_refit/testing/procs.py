"""Child processes a test drives over authenticated local sockets: trainer ranks, inference
workers, whole engines. Both ends of the protocol live here, for the core's and every plugin's tests.

Each child runs one script under a given interpreter, so a Megatron rank can run in the core venv
while vLLM workers run in the vLLM venv (their transformers pins conflict). The parent listens on
127.0.0.1 with a random authkey (``MX_TEST_AUTHKEY``) and starts ``python SCRIPT --listen
HOST:PORT ARGS...``; the child connects, builds what it serves and answers ``("ok", hello)`` or
``("err", ("StartupError", traceback))``. Every command ``(cmd, arg)`` then gets ``("ok", value)``
or ``("err", (kind, message))``; ``stop`` ends the child after its reply.

Parent: :class:`Child`, :class:`Group`, :func:`start_group`, :func:`core_python`,
:func:`vllm_python`, :func:`rendezvous_url` (a rank group's ``--dist-init``),
:func:`refused_address`. Child: :func:`rank_arguments`, :func:`open_child`, :func:`serve`,
:func:`describe_error`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from mx_refit.verify.harness import rendezvous_url

__all__ = [
    "TIMEOUT_SCALE",
    "Child",
    "Group",
    "RemoteError",
    "core_python",
    "describe_error",
    "open_child",
    "rank_arguments",
    "refused_address",
    "rendezvous_url",
    "serve",
    "start_group",
    "vllm_python",
]

# A shared, overloaded machine starts vLLM workers slowly: MX_TEST_TIMEOUT_SCALE=3 triples every
# wait on a child (CI runs with 1).
TIMEOUT_SCALE = float(os.environ.get("MX_TEST_TIMEOUT_SCALE", "1"))


class RemoteError(RuntimeError):
    """A child answered a command with an exception: ``kind`` is its type name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class Child:
    """One child process running ``script`` (its folder is the working directory) and its
    command connection; its output goes to ``log_dir/NAME.log``."""

    def __init__(
        self,
        name: str,
        python: str,
        script: str | Path,
        args: Sequence[str],
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 300.0,
    ) -> None:
        start_timeout_s *= TIMEOUT_SCALE
        script = Path(script).resolve()
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = listener.address
        child_env = {**os.environ, **(env or {}), "MX_TEST_AUTHKEY": authkey.hex(), "PYTHONUNBUFFERED": "1"}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [python, str(script), "--listen", f"{host}:{port}", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=str(script.parent),
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
        """The child's next answer; raises when it dies, stays silent past ``timeout_s`` (scaled),
        or answers with an error (:class:`RemoteError`)."""
        timeout_s *= TIMEOUT_SCALE
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
    script: str | Path,
    per_rank_args: list[list[str]],
    log_dir: Path,
    env: Mapping[str, str] | None = None,
    start_timeout_s: float = 300.0,
) -> Group:
    """Start one child per rank concurrently (their startups overlap); if any fails, the others
    are killed and its error raised."""
    return Group(start_concurrently(
        [
            partial(Child, f"{prefix}-{rank}", python, script, args, log_dir, env, start_timeout_s)
            for rank, args in enumerate(per_rank_args)
        ],
        stop=Child.kill,
    ))


def start_concurrently[T](starts: Sequence[Callable[[], T]], stop: Callable[[T], None]) -> list[T]:
    """Call every ``starts[i]()`` at once (slow process startups overlap); if any raises, the
    ones that started are stopped with ``stop`` and the first error is raised."""
    with ThreadPoolExecutor(max(len(starts), 1)) as pool:
        futures = [pool.submit(start) for start in starts]
    started: list[T] = []
    failures: list[Exception] = []
    for future in futures:
        try:
            started.append(future.result())
        except Exception as exc:
            failures.append(exc)
    if failures:
        for item in started:
            stop(item)
        raise failures[0]
    return started


@contextlib.contextmanager
def refused_address() -> Iterator[str]:
    """``127.0.0.1:PORT`` where a connection is refused for as long as the block runs: the port is
    bound (so no other process can take it) but never listened on. A port probed as free and
    closed again may be taken by anyone before the test dials it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def core_python() -> str | None:
    """The core venv's interpreter (megatron-core, Megatron-Bridge): ``$MX_REFIT_CORE_PYTHON``,
    else the newest complete ``scripts/dev`` core venv under ``$MX_REFIT_CACHE``."""
    return _venv_python("MX_REFIT_CORE_PYTHON", "core")


def vllm_python() -> str | None:
    """The vLLM venv's interpreter: ``$MX_REFIT_VLLM_PYTHON``, else this interpreter when it has
    vllm, else the newest complete ``scripts/dev`` vLLM venv under ``$MX_REFIT_CACHE``."""
    if not os.environ.get("MX_REFIT_VLLM_PYTHON") and importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return _venv_python("MX_REFIT_VLLM_PYTHON", "vllm")


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


# ---------------------------------------------------------------------------------- child's end
def rank_arguments() -> argparse.ArgumentParser:
    """A parser with what every rank script takes: ``--listen`` (from :class:`Child`), ``--rank``,
    ``--world`` and ``--dist-init`` (the process group's rendezvous, a :func:`rendezvous_url`:
    ``init_method`` for torch, ``distributed_init_method`` for vLLM); add the script's own."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--dist-init", required=True)
    return parser


def open_child[T](listen: str, build: Callable[[], T], **hello: Any) -> tuple[Connection, T] | None:
    """Connect to the parent at ``listen`` (``HOST:PORT``), then run ``build`` (imports, process
    groups, models) and say hello (this pid plus ``hello``). When ``build`` raises, its traceback
    goes to the parent as a ``StartupError`` and this returns None: the child should exit."""
    host, port = listen.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["MX_TEST_AUTHKEY"]))
    try:
        served = build()
    except BaseException:
        conn.send(("err", ("StartupError", traceback.format_exc())))
        return None
    conn.send(("ok", {"pid": os.getpid(), **hello}))
    return conn, served


def serve(
    conn: Connection,
    handlers: Mapping[str, Callable[[Any], Any]],
    on_stop: Callable[[], None] | None = None,
) -> None:
    """Answer commands until ``stop`` (``on_stop`` runs before its reply). A handler's exception
    is sent back (:func:`describe_error`), its traceback printed, and the child keeps serving:
    tests probe failure paths."""
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            if on_stop is not None:
                on_stop()
            conn.send(("ok", None))
            return
        try:
            handler = handlers.get(cmd)
            if handler is None:
                raise ValueError(f"unknown command {cmd!r} (known: {sorted(handlers)})")
            conn.send(("ok", handler(arg)))
        except BaseException as exc:
            traceback.print_exc()  # into the child's log, for the failure report
            conn.send(("err", describe_error(exc)))


def describe_error(exc: BaseException) -> tuple[str, str]:
    """``(type name, message)`` of an exception for the parent: one line with the message and its
    causes (callers forward it, e.g. as an HTTP route's error; the traceback goes to the log)."""
    parts = [f"{type(exc).__name__}: {exc}"]
    cause = exc.__cause__
    while cause is not None:
        parts.append(f"caused by {type(cause).__name__}: {cause}")
        cause = cause.__cause__
    return type(exc).__name__, " | ".join(parts)
