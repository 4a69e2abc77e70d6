"""Starts catalog processes (``mx-refit serve``) by forking a warm interpreter, so a test can
restart the catalog 100 times without paying ~1 s of imports per start.

Each child is a real, separate catalog process: it builds its own store connection, service
and gRPC server from scratch (the parent only imported modules: no gRPC object, Redis
connection or thread exists before the fork), and dies for real on SIGKILL/SIGTERM.

Protocol (JSON lines): ``{"argv": [...serve args], "log": path}`` on stdin -> ``{"pid": N}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import mx_refit.catalog.server  # noqa: F401 - warm imports only
import mx_refit.catalog.servicer  # noqa: F401
import mx_refit.catalog.store.redis_store  # noqa: F401
from mx_refit import cli


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the dead catalogs
    print(json.dumps({"event": "ready"}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        log = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        pid = os.fork()
        if pid == 0:  # the catalog process
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os._exit(cli.main(cmd["argv"]))
        os.close(log)
        print(json.dumps({"pid": pid}), flush=True)


if __name__ == "__main__":
    main()
