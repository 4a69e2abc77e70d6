"""Real processes for fault injection: the catalog (``mx-refit serve``), a TCP relay, and
publisher/reader workers (``_workers.py``), each a child process the test can SIGKILL/SIGSTOP."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
WORKERS = HERE / "_workers.py"
RELAY = HERE / "_relay.py"


def wait_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on port {port} after {timeout:.0f} s") from None
            time.sleep(0.02)


class Proc:
    """A child process speaking JSON lines (events carry an ``event`` key, replies do not)."""

    def __init__(self, argv: list[str], name: str, log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=HERE.parent.parent,
        )
        self.pid = self.proc.pid
        self.ready: dict[str, Any] = {}  # the ready event, where a helper kept it
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                self._lines.put(json.loads(raw))
            except ValueError:
                self._lines.put({"event": "noise", "text": raw.decode(errors="replace")})
        self._lines.put(None)

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def next(self, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise TimeoutError(f"{self.name}: no reply in {timeout:.0f} s; log: {self.tail()}") from None
            if line is None:
                raise RuntimeError(f"{self.name} exited ({self.proc.poll()}); log: {self.tail()}")
            if line.get("event") != "noise":
                return line

    def expect(self, event: str, timeout: float = 60.0) -> dict[str, Any]:
        got = self.next(timeout)
        assert got.get("event") == event, (self.name, event, got)
        return got

    def call(self, timeout: float = 60.0, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.next(timeout)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
        self.proc.wait(10)
        self._log.close()

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class CatalogProc:
    """``mx-refit serve``, restartable on its port the way a crashed catalog comes back."""

    def __init__(self, log_dir: Path, port: int = 0) -> None:
        self.port = port  # 0: the first start binds a port and announces it
        self.log_dir = log_dir
        self.restarts = 0
        self.proc: Proc | None = None
        self.start()
        self.address = f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Serve on ``self.port`` and wait for the announcement (it comes once the port is bound).
        A restart binds the same port again: another process may take it in the gap, so a start
        that exits (address in use) is retried for a while before the rig gives up."""
        deadline = time.monotonic() + 30
        while True:
            argv = [sys.executable, "-m", "mx_refit.cli", "serve", "--json", "--port", str(self.port)]
            self.proc = Proc(argv, f"catalog-{self.port}-{self.restarts}", self.log_dir)
            try:
                self.port = int(self.proc.next(60)["port"])
                return
            except RuntimeError:  # it exited
                if self.port == 0 or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def restart(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.signal(sig)
        self.proc.kill()
        self.restarts += 1
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()


class RelayProc:
    """A TCP relay ``listen port -> catalog port``; ``cut()`` kills it, ``mend()`` restarts it on
    the same port (the first start binds port 0 and reports the port)."""

    def __init__(self, target_port: int, log_dir: Path) -> None:
        self.port = 0
        self.target_port = target_port
        self.log_dir = log_dir
        self.count = 0
        self.proc: Proc | None = None
        self.mend()
        self.address = f"127.0.0.1:{self.port}"

    def mend(self) -> None:
        self.proc = Proc([sys.executable, str(RELAY), str(self.port), str(self.target_port)],
                         f"relay-{self.port}-{self.count}", self.log_dir)
        self.count += 1
        self._ready()

    def _ready(self) -> None:
        assert self.proc is not None
        self.port = int(self.proc.expect("ready", timeout=30)["port"])

    def cut(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()


def publisher(catalog: str, model: str, log_dir: Path, *, rank: int = 0, ranks: int = 1,
              ttl: float = 5.0, name: str | None = None) -> Proc:
    argv = [sys.executable, str(WORKERS), "publisher", "--catalog", catalog, "--model", model,
            "--rank", str(rank), "--ranks", str(ranks), "--ttl", str(ttl)]
    proc = Proc(argv, name or f"pub-{model}-{rank}", log_dir)
    proc.expect("ready", timeout=120)
    return proc


def reader(catalog: str, model: str, log_dir: Path, *, lease_ttl: float = 1.0, gate: bool = False,
           name: str | None = None, transfer_timeout: float = 10.0) -> Proc:
    argv = [sys.executable, str(WORKERS), "reader", "--catalog", catalog, "--model", model,
            "--lease-ttl", str(lease_ttl), "--transfer-timeout", str(transfer_timeout)]
    if gate:
        argv.append("--gate")
    proc = Proc(argv, name or f"reader-{model}", log_dir)
    proc.expect("ready", timeout=120)
    return proc


def zygote(catalog: str, log_dir: Path, name: str = "zygote") -> Proc:
    argv = [sys.executable, str(WORKERS), "zygote", "--catalog", catalog, "--model", "-"]
    proc = Proc(argv, name, log_dir)
    proc.expect("ready", timeout=120)
    return proc


def spawn_source(zyg: Proc, timeout: float = 180.0, **cmd: Any) -> dict[str, Any]:
    """Fork one publisher process from ``zyg``; returns its ``published`` event."""
    zyg.send(cmd="spawn", **cmd)
    got = zyg.next(timeout)
    assert got.get("event") == "published", got
    return got


def kill_and_wait(pid: int, timeout: float = 60.0) -> None:
    """SIGKILL ``pid`` and wait until it is gone (its memory unmapped), not merely signalled."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return  # a zombie: its memory is gone
        except (OSError, IndexError):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} still exists {timeout:.0f} s after SIGKILL")
        time.sleep(0.01)


FAILOVER_WORKERS = HERE / "_failover_workers.py"


def failover_worker(role: str, catalog: str, model: str, log_dir: Path, name: str, *extra: str) -> Proc:
    """A long-lived ``_failover_workers.py`` process (``source``, ``reader``, ``soak-*``), ready."""
    proc = Proc([sys.executable, str(FAILOVER_WORKERS), role, "--catalog", catalog, "--model", model, *extra],
                name, log_dir)
    proc.ready = proc.expect("ready", timeout=120)
    return proc
