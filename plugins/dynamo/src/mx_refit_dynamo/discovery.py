"""Where the Dynamo workers are: system URLs given by hand, or the frontend's ``/v1/rl/workers``.

Dynamo 1.6.1's frontend (started with ``--enable-rl`` or ``DYN_ENABLE_RL=1``) answers
``GET /v1/rl/workers`` with ``{"protocol_version": 1, "namespace": ..., "workers": [...]}``;
each row names one worker instance (``namespace``, ``component``, ``endpoint``, ``instance_id``,
``transport``, ``request_plane_url``) and, when the worker answered the frontend's route probe,
its ``system_url`` (the ``DYN_SYSTEM_PORT`` server that hosts ``/engine/*``), ``routes``,
``world_size`` and ``model``; a worker that did not answer carries ``error`` instead. Rows
with ``admin_base_url`` are sidecar engines with another admin contract, not Python vLLM
workers. Only the standard library is used.

The frontend serves ``/v1/rl/*`` on its RL port only (``DYN_RL_PORT``, default 8001), not on
its OpenAI HTTP port (8000): a frontend URL without a port gets 8001, and a 404 says so.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from mx_refit.errors import InvalidArgument, Unavailable

__all__ = [
    "DEFAULT_RL_PORT",
    "REQUIRED_ROUTES",
    "DynamoWorker",
    "fetch_workers",
    "parse_workers",
    "rl_base_url",
]

# Dynamo's frontend mounts /v1/rl/* on a port of its own (DYN_RL_PORT), 8001 unless set.
DEFAULT_RL_PORT = 8001

# The engine routes a refit needs on every worker.
REQUIRED_ROUTES = (
    "init_weights_update_group",
    "pause_generation",
    "resume_generation",
    "update_weights_from_distributed",
)


@dataclass(frozen=True)
class DynamoWorker:
    """One Dynamo worker: its system server and how many vLLM ranks sit behind it.

    ``world_size`` is ``None`` when unknown (a bare URL, or a discovery row without it): a
    single update dict works then, a per-rank list is refused rather than guessed.
    """

    system_url: str
    world_size: int | None = None
    name: str = ""  # "namespace.component#instance" when discovered

    @classmethod
    def from_url(cls, url: str, *, world_size: int | None = None, name: str = "") -> DynamoWorker:
        """Validate ``http(s)://host:port`` (a trailing ``/`` or ``/engine`` is dropped)."""
        if not isinstance(url, str):
            raise InvalidArgument(f"system_url: expected 'http://host:port', got {url!r}")
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise InvalidArgument(f"system_url: expected 'http://host:port', got {url!r}")
        path = parts.path.rstrip("/").removesuffix("/engine")
        if path:
            raise InvalidArgument(f"system_url: {url!r} has a path {parts.path!r}; give the server root")
        bad_size = isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1
        if world_size is not None and bad_size:
            raise InvalidArgument(f"world_size: expected an integer >= 1 for {url}, got {world_size!r}")
        return cls(f"{parts.scheme}://{parts.netloc}", world_size, name)


def parse_workers(
    reply: Any,
    *,
    component: str | None = None,
    model: str | None = None,
    required_routes: Sequence[str] = REQUIRED_ROUTES,
) -> list[DynamoWorker]:
    """The refit-capable workers of a ``/v1/rl/workers`` reply, in the reply's order.

    Rows of another component or model are skipped when those filters are given. A row that
    would be used but cannot be (an ``error``, no ``system_url``, a sidecar ``admin_base_url``,
    a missing required route) is an error naming the instance: refitting only some of the
    workers would leave the rest on old weights without anyone noticing.
    """
    if not isinstance(reply, Mapping) or not isinstance(reply.get("workers"), list):
        raise InvalidArgument(f"/v1/rl/workers: expected an object with a 'workers' list, got {reply!r:.200}")
    version = reply.get("protocol_version", 1)
    if version != 1:
        raise InvalidArgument(f"/v1/rl/workers: protocol_version {version!r} is not supported (only 1)")
    workers, problems = [], []
    for index, row in enumerate(reply["workers"]):
        if not isinstance(row, Mapping):
            problems.append(f"workers[{index}]: not an object")
            continue
        name = f"{row.get('namespace', '?')}.{row.get('component', '?')}#{row.get('instance_id', index)}"
        if component is not None and row.get("component") != component:
            continue
        if model is not None and row.get("model") not in (model, None):
            continue
        if row.get("error"):
            problems.append(f"{name}: the frontend could not reach it: {row['error']}")
            continue
        if row.get("admin_base_url") and not row.get("system_url"):
            problems.append(f"{name}: a sidecar engine (admin_base_url), not a Dynamo vLLM worker")
            continue
        url = row.get("system_url")
        if not url:
            problems.append(f"{name}: no system_url (start the worker with DYN_SYSTEM_PORT set)")
            continue
        routes = row.get("routes") or []
        missing = [r for r in required_routes if r not in routes]
        if missing:
            problems.append(f"{name}: lacks engine routes {missing} (has {sorted(routes)})")
            continue
        world_size = row.get("world_size")  # None: unknown, never guessed
        try:
            workers.append(DynamoWorker.from_url(url, world_size=world_size, name=name))
        except InvalidArgument as exc:
            problems.append(f"{name}: {exc}")
    if problems:
        raise InvalidArgument("/v1/rl/workers: " + "; ".join(problems))
    if not workers:
        wanted = ", ".join(f"{k}={v!r}" for k, v in (("component", component), ("model", model)) if v)
        raise InvalidArgument(
            f"/v1/rl/workers: no worker{' with ' + wanted if wanted else ''} in {reply!r:.300}"
        )
    return workers


def rl_base_url(frontend_url: str) -> str:
    """``http(s)://host:port`` of the frontend's RL server: a trailing ``/`` or ``/v1`` is
    dropped, and a URL without a port gets :data:`DEFAULT_RL_PORT` (8001, Dynamo's
    ``DYN_RL_PORT`` default), since ``/v1/rl/*`` is not served on the HTTP port."""
    if not isinstance(frontend_url, str):
        raise InvalidArgument(f"frontend_url: expected 'http://host:{DEFAULT_RL_PORT}', got {frontend_url!r}")
    parts = urlsplit(frontend_url.strip())
    path = parts.path.rstrip("/").removesuffix("/v1")
    if parts.scheme not in ("http", "https") or not parts.hostname or path or parts.query or parts.fragment:
        raise InvalidArgument(
            f"frontend_url: expected 'http://host:{DEFAULT_RL_PORT}' (the frontend's DYN_RL_PORT), "
            f"got {frontend_url!r}"
        )
    netloc = parts.netloc if parts.port is not None else f"{parts.netloc}:{DEFAULT_RL_PORT}"
    return f"{parts.scheme}://{netloc}"


def fetch_workers(
    frontend_url: str,
    *,
    component: str | None = None,
    model: str | None = None,
    timeout_s: float = 30.0,
    headers: Mapping[str, str] | None = None,
) -> list[DynamoWorker]:
    """``GET {frontend_url}/v1/rl/workers`` and :func:`parse_workers` the reply.

    ``frontend_url`` is the frontend's RL server (``DYN_RL_PORT``, default 8001; see
    :func:`rl_base_url`), not its OpenAI HTTP port.
    """
    base = rl_base_url(frontend_url)
    request = urllib.request.Request(f"{base}/v1/rl/workers", headers=dict(headers or {}), method="GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        hint = (
            f" (/v1/rl/* is served only on the frontend's RL port, DYN_RL_PORT, default {DEFAULT_RL_PORT},"
            " not on its HTTP port, and only with --enable-rl / DYN_ENABLE_RL=1)"
            if exc.code == 404
            else ""
        )
        raise Unavailable(f"GET {base}/v1/rl/workers: HTTP {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise Unavailable(f"GET {base}/v1/rl/workers: {getattr(exc, 'reason', exc)}") from None
    try:
        reply = json.loads(body)
    except ValueError:
        raise InvalidArgument(f"/v1/rl/workers: reply is not JSON: {body[:200]!r}") from None
    return parse_workers(reply, component=component, model=model)
