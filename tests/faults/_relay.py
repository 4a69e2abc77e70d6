"""A TCP relay between catalog clients and the catalog: ``python _relay.py LISTEN_PORT TARGET_PORT``.

Tests put it on the path of a reader's catalog calls and then fault the link the way networks
fail: SIGSTOP pauses it (calls hang), SIGKILL cuts it (connections reset, new ones refused until
a new relay listens on the same port). Standard library only, so it starts in milliseconds.
LISTEN_PORT 0 binds a free port; the ready line says which. A relay restarted on its old port
retries the bind for a while: another process may hold the port for a moment.
"""

from __future__ import annotations

import socket
import sys
import threading
import time


def pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve(listen_port: int, target_port: int) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + 30
    while True:
        try:
            listener.bind(("127.0.0.1", listen_port))
            break
        except OSError:
            if listen_port == 0 or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    listener.listen(64)
    print(f'{{"event": "ready", "port": {listener.getsockname()[1]}}}', flush=True)
    while True:
        client, _ = listener.accept()
        try:
            upstream = socket.create_connection(("127.0.0.1", target_port), timeout=5)
            upstream.settimeout(None)
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
