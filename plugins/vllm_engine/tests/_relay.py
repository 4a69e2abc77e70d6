"""vLLM's RL weight-sync HTTP routes in front of a test worker group, so trainers can use vLLM's
real ``HTTPVLLMWeightSyncClient`` over real JSON (the worker processes come from
:mod:`mx_refit.testing.procs`)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl

from mx_refit.testing.procs import Group


class Relay:
    """vLLM's RL weight-sync HTTP routes (the ``VLLM_SERVER_DEV_MODE`` ones), fanned out to a
    worker group. Lets trainers use vLLM's real ``HTTPVLLMWeightSyncClient`` over real JSON."""

    ROUTES = {
        "/init_weight_transfer_engine": ("init_weight_transfer_engine", "init_info"),
        "/start_weight_update": ("start_weight_update", None),
        "/update_weights": ("update_weights", "update_info"),
        "/finish_weight_update": ("finish_weight_update", None),
    }

    # vLLM's /pause and /resume act on the engine core's scheduler, which these workers (vLLM's
    # Worker without a scheduler) do not have: the relay records them, so tests see where a
    # trainer paused relative to the update calls.
    CONTROL = ("/pause", "/resume")

    def __init__(self) -> None:
        self.group: Group | None = None
        self.calls: list[tuple[str, Any]] = []
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null") if length else None
                path, _, query = self.path.partition("?")
                if path in relay.CONTROL:
                    relay.calls.append((path[1:], dict(parse_qsl(query))))
                    self.send_response(200)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                    return
                route = relay.ROUTES.get(path)
                if route is None or relay.group is None:
                    self.send_error(404)
                    return
                method, key = route
                kwargs = {key: body[key]} if key else {}
                relay.calls.append((method, kwargs))
                try:
                    relay.group.rpc(method, **kwargs)
                except Exception as exc:
                    payload = json.dumps({"error": str(exc)}).encode()
                    self.send_response(500)
                else:
                    payload = b"{}"
                    self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
