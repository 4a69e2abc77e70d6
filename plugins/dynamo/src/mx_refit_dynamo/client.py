"""``DynamoRefitClient``: refit Dynamo-served vLLM workers through Dynamo 1.6.1's engine routes.

Each Dynamo vLLM worker runs a system server (``DYN_SYSTEM_PORT``) whose ``/engine/<route>``
routes pass a call through to every vLLM rank of the worker (``collective_rpc``). The client
drives the ``mx`` weight-transfer backend with them:

- once per worker: ``init_weights_update_group {"engine_rpc": "init_weight_transfer_engine",
  "init_info": ...}`` (Dynamo kills a worker whose init outlives ``DYN_RL_INIT_WEIGHTS_TIMEOUT_S``,
  so it is never repeated for an unchanged init info);
- each cycle: ``pause_generation {"mode": "keep"}`` -> ``update_weights_from_distributed`` with
  ``engine_rpc`` ``start_weight_update``, then ``update_weights``, then ``finish_weight_update``
  (which keeps Dynamo's prefix-cache reset) -> ``resume_generation``, always, on failure too.

Dynamo's update route refuses an unpaused worker and holds its pause lock around the call, so
a concurrent resume cannot interleave. The client implements vLLM 0.33's
``VLLMWeightSyncClient`` protocol (four methods), so ``MxTrainerWeightTransferEngine`` drives
Dynamo workers unchanged, and a Megatron ``Publisher`` loop calls :meth:`refit`. Only the
standard library: it runs in a trainer's environment without vLLM or Dynamo.
"""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from mx_refit.config import check_count, check_flag, check_mode, check_seconds
from mx_refit.errors import InvalidArgument, MxRefitError
from mx_refit_dynamo.backend import ALIAS
from mx_refit_dynamo.discovery import DynamoWorker, fetch_workers

__all__ = ["CycleReport", "DynamoRefitClient", "DynamoRefitError", "DynamoWorker"]

log = logging.getLogger(__name__)

_PAUSE_MODES = ("keep", "wait", "abort")


class DynamoRefitError(MxRefitError):
    """One or more workers failed a step; ``failures`` maps each worker to its error.

    ``resumed`` lists the workers that were resumed afterwards (every paused one, unless the
    resume itself failed, which is then in ``failures`` too). ``updated`` lists the workers
    that hold the new version (their update succeeded and was finished); every other worker
    kept its previous weights.
    """

    def __init__(
        self,
        step: str,
        failures: Mapping[str, str],
        *,
        resumed: Sequence[str] = (),
        updated: Sequence[str] = (),
    ) -> None:
        self.step = step
        self.failures = dict(failures)
        self.resumed = tuple(resumed)
        self.updated = tuple(updated)
        lines = "; ".join(f"{w}: {m}" for w, m in self.failures.items())
        super().__init__(
            f"{step} failed on {len(self.failures)} worker(s): {lines} "
            f"(resumed: {', '.join(self.resumed) or 'none'}; "
            f"holding the new weights: {', '.join(self.updated) or 'none'})"
        )


@dataclass
class CycleReport:
    """What :meth:`DynamoRefitClient.refit` did, per worker (system URL)."""

    version: int | None
    workers: tuple[str, ...]
    weight_version: str | None = None
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)  # finish replies


class _RouteError(MxRefitError):
    pass


class DynamoRefitClient:
    """Drives the ``mx`` backend on Dynamo vLLM workers (see the module docstring).

    :param workers: system URLs (``http://host:DYN_SYSTEM_PORT``) or :class:`DynamoWorker`s;
        :meth:`from_frontend` discovers them instead.
    :param timeout_s: per worker and per route call (an ``update_weights`` pulls a whole
        version, so give it the transfer budget).
    :param init_timeout_s: per worker for the init call; keep it below the workers'
        ``DYN_RL_INIT_WEIGHTS_TIMEOUT_S`` (default 30 s), after which Dynamo kills the worker.
    :param pause: ``True`` (default): pause each worker (``pause_mode``) around the update, as
        Dynamo's routes require. ``False`` is the documented opt-in for updating while
        generation continues: start/update/finish carry ``"allow_unpaused": true`` and
        ``"reset_prefix_cache": false`` (Dynamo refuses a cache reset without a pause), so KV
        cached under the old weights stays reusable — only for callers that accept that.
    """

    def __init__(
        self,
        workers: Sequence[str | DynamoWorker],
        *,
        timeout_s: float = 600.0,
        init_timeout_s: float = 25.0,
        pause: bool = True,
        pause_mode: str = "keep",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if isinstance(workers, str) or not workers:
            raise InvalidArgument(f"workers: expected a non-empty list of system URLs, got {workers!r}")
        self.workers = tuple(w if isinstance(w, DynamoWorker) else DynamoWorker.from_url(w) for w in workers)
        urls = [w.system_url for w in self.workers]
        if len(set(urls)) != len(urls):
            raise InvalidArgument(f"workers: duplicate system URLs in {urls}")
        self.timeout_s = check_seconds(timeout_s, "timeout_s")
        self.init_timeout_s = check_seconds(init_timeout_s, "init_timeout_s")
        self.pause_mode = check_mode(pause_mode, "pause_mode", _PAUSE_MODES)
        self.pause = check_flag(pause, "pause")
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self._initialized: dict[str, dict[str, Any]] = {}  # system_url -> init info sent
        self._paused: set[str] = set()
        self._started: set[str] = set()
        self._updated: set[str] = set()
        self._unpaused_stage = False  # refit_staged: the session opened and staged unpaused

    @property
    def pauses_generation(self) -> bool:
        """Whether this client pauses the workers around its own update session (``pause``):
        vLLM's trainer engine then adds no pause of its own."""
        return self.pause

    @classmethod
    def from_frontend(
        cls,
        frontend_url: str,
        *,
        component: str | None = None,
        model: str | None = None,
        discovery_timeout_s: float = 30.0,
        **kwargs: Any,
    ) -> DynamoRefitClient:
        """Discover the workers from the frontend's ``GET /v1/rl/workers`` (Dynamo started with
        ``--enable-rl``/``DYN_ENABLE_RL``), optionally only one component or model.

        ``frontend_url`` is the frontend's RL server, ``http://host:DYN_RL_PORT`` (8001 unless
        set; a URL without a port gets 8001), not its OpenAI HTTP port (8000)."""
        workers = fetch_workers(
            frontend_url,
            component=component,
            model=model,
            timeout_s=discovery_timeout_s,
            headers=kwargs.get("headers"),
        )
        return cls(workers, **kwargs)

    # -- vLLM's VLLMWeightSyncClient protocol ---------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialise every worker's weight-transfer engine, once per worker and init info."""
        if not isinstance(init_info, Mapping):
            raise InvalidArgument(f"init_info: expected a JSON object, got {type(init_info).__name__}")
        info = json.loads(json.dumps(dict(init_info)))  # JSON-safe, and a private copy
        todo = [w for w in self.workers if self._initialized.get(w.system_url) != info]
        body = {"engine_rpc": "init_weight_transfer_engine", "init_info": info}
        ok, failures = self._each(
            todo, lambda w: self._post(w, "init_weights_update_group", body, self.init_timeout_s)
        )
        for url in ok:
            self._initialized[url] = info
        for url, message in failures.items():
            if "Invalid init_info" in message:  # the worker's backend parsed it as someone else's
                failures[url] = (
                    f"{message} -- the worker's weight-transfer backend is not mx-refit's; where "
                    f"another package also registers 'mx', start workers with backend {ALIAS!r}"
                )
        if failures:
            raise DynamoRefitError("init_weight_transfer_engine", failures)

    def start_weight_update(self) -> None:
        """Pause every worker (unless ``pause=False``) and open its update session. On any
        failure, every worker that started is finished and every paused one resumed."""
        self._require_initialized()
        if self._started:
            raise InvalidArgument(
                f"start_weight_update: an update is already open on {sorted(self._started)}; "
                "call finish_weight_update first"
            )
        self._updated.clear()

        def start(worker: DynamoWorker) -> None:
            if self.pause:
                self._post(worker, "pause_generation", {"mode": self.pause_mode, "clear_cache": False})
                self._paused.add(worker.system_url)
            self._post(worker, "update_weights_from_distributed", self._update_body("start_weight_update"))
            self._started.add(worker.system_url)

        _, failures = self._each(self.workers, start)
        if failures:
            self._abort("start_weight_update", failures)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Every worker pulls and loads the version. ``update_info`` is one dict for all, or a
        list with one entry per vLLM rank across the workers (in worker order), of which each
        worker gets its own ``world_size`` entries (vLLM then indexes them by rank).

        On failure the cycle ends here: workers whose update succeeded are finished (they hold
        the new weights), workers whose update failed keep their previous weights (vLLM ended
        their session), and every paused worker is resumed; then it raises.
        """
        payloads = self._split(update_info)
        missing = [w.system_url for w in self.workers if w.system_url not in self._started]
        if missing:
            raise InvalidArgument(
                f"update_weights: no update session is open on {missing}; call start_weight_update"
            )

        def update(worker: DynamoWorker) -> None:
            self._post_update(worker, payloads[worker.system_url])

        _, failures = self._each(self.workers, update)
        if failures:
            self._abort("update_weights", failures)

    def _post_update(self, worker: DynamoWorker, update_info: Any) -> None:
        """One ``update_weights`` call into ``worker``'s open session."""
        body = self._update_body("update_weights", update_info=update_info)
        try:
            self._post(worker, "update_weights_from_distributed", body)
        except _RouteError:
            self._started.discard(worker.system_url)  # vLLM closed the session itself
            raise
        self._updated.add(worker.system_url)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish every open session (Dynamo records ``weight_version`` and resets the prefix
        cache unless ``pause=False``), then resume every paused worker, whatever happened."""
        extra = {} if weight_version is None else {"weight_version": str(weight_version)}
        open_ = [w for w in self.workers if w.system_url in self._started]
        _, failures = self._each(
            open_,
            lambda w: self._post(
                w, "update_weights_from_distributed", self._update_body("finish_weight_update", **extra)
            ),
        )
        self._started.clear()
        resumed, resume_failures = self._resume_all()
        failures.update(resume_failures)
        if failures:
            raise DynamoRefitError(
                "finish_weight_update", failures, resumed=resumed, updated=sorted(self._updated)
            )

    # -- one whole cycle --------------------------------------------------------------------------
    def refit(
        self,
        version: int | None = None,
        *,
        update_info: dict[str, Any] | list[dict[str, Any]] | None = None,
        init_info: dict[str, Any] | None = None,
        weight_version: str | None = None,
    ) -> CycleReport:
        """start -> update -> finish on every worker, resumed whatever happens.

        ``update_info`` defaults to ``{"version": version}``; ``weight_version`` to
        ``str(version)``. ``init_info`` initialises workers not yet initialised with it.
        """
        if update_info is None:
            if version is None:
                raise InvalidArgument("refit: pass version=N or update_info=...")
            update_info = {"version": version}
        if init_info is not None:
            self.init_weight_transfer_engine(init_info)
        label = weight_version if weight_version is not None else (None if version is None else str(version))
        self.start_weight_update()
        self.update_weights(update_info)
        self.finish_weight_update(label)
        return CycleReport(
            version=version, workers=tuple(w.system_url for w in self.workers), weight_version=label
        )

    def refit_staged(
        self,
        version: int,
        *,
        init_info: dict[str, Any] | None = None,
        weight_version: str | None = None,
        wait_s: float | None = None,
    ) -> CycleReport:
        """Stage before the pause, commit between pause and resume: every worker opens its
        session and starts pulling ``version`` in the background (``phase: "stage"``, unpaused,
        so generation goes on), then each is paused, commits (``phase: "commit"``: places the
        staged bytes), finishes (prefix cache reset) and is resumed. The pause covers the
        commit only. A stage that failed raises at the commit; that worker keeps its weights.
        """
        if init_info is not None:
            self.init_weight_transfer_engine(init_info)
        self._require_initialized()
        if self._started:
            raise InvalidArgument(
                f"refit_staged: an update is already open on {sorted(self._started)}; "
                "call finish_weight_update first"
            )
        self._updated.clear()
        stage_info: dict[str, Any] = {"version": version, "phase": "stage"}
        if wait_s is not None:
            stage_info["wait_s"] = wait_s

        def stage(worker: DynamoWorker) -> None:
            self._post(worker, "update_weights_from_distributed", self._update_body("start_weight_update"))
            self._started.add(worker.system_url)
            body = self._update_body("update_weights", update_info=stage_info)
            self._post(worker, "update_weights_from_distributed", body)

        self._unpaused_stage = True
        try:
            _, failures = self._each(self.workers, stage)
            if failures:
                self._abort("refit_staged (stage)", failures)
        finally:
            self._unpaused_stage = False

        def commit(worker: DynamoWorker) -> None:
            if self.pause:
                self._post(worker, "pause_generation", {"mode": self.pause_mode, "clear_cache": False})
                self._paused.add(worker.system_url)
            self._post_update(worker, {"phase": "commit"})

        _, failures = self._each(self.workers, commit)
        if failures:
            self._abort("refit_staged (commit)", failures)
        label = weight_version if weight_version is not None else str(version)
        self.finish_weight_update(label)
        workers = tuple(w.system_url for w in self.workers)
        return CycleReport(version=version, workers=workers, weight_version=label)

    def refit_via_extension(
        self, version: int, *, mx_config: dict[str, Any] | None = None, weight_version: str | None = None
    ) -> None:
        """The worker-extension way in: pause -> ``update_weights_from_distributed
        {"engine_rpc": "update_weights_via_mx", "version": ..., "mx_config": ...}`` (which keeps
        Dynamo's prefix-cache reset) -> resume, always. Needs workers started with
        ``--worker-extension-cls`` naming :class:`~mx_refit_dynamo.MxRefitWorkerExtension` (or a
        class composed from it); ``mx_config`` takes the upstream keys."""
        check_count(version, "version", minimum=0)
        label = str(version) if weight_version is None else str(weight_version)
        body: dict[str, Any] = {
            "engine_rpc": "update_weights_via_mx",
            "version": version,
            "weight_version": label,
        }
        if mx_config is not None:
            body["mx_config"] = json.loads(json.dumps(dict(mx_config)))
        if not self.pause:
            body.update(allow_unpaused=True, reset_prefix_cache=False)

        def one(worker: DynamoWorker) -> None:
            if self.pause:
                self._post(worker, "pause_generation", {"mode": self.pause_mode, "clear_cache": False})
                self._paused.add(worker.system_url)
            self._post(worker, "update_weights_from_distributed", body)
            self._updated.add(worker.system_url)

        self._updated.clear()
        _, failures = self._each(self.workers, one)
        resumed, resume_failures = self._resume_all()
        for url, message in resume_failures.items():
            failures[url] = f"{failures[url]}; {message}" if url in failures else message
        if failures:
            raise DynamoRefitError(
                "update_weights_via_mx", failures, resumed=resumed, updated=sorted(self._updated)
            )

    def weight_versions(self) -> dict[str, Any]:
        """Each worker's declared weight version (``get_weight_version``)."""
        replies, failures = self._each(self.workers, lambda w: self._post(w, "get_weight_version", {}))
        if failures:
            raise DynamoRefitError("get_weight_version", failures)
        return {url: reply.get("version") for url, reply in replies.items()}

    # -- internals ----------------------------------------------------------------------------------
    def _require_initialized(self) -> None:
        missing = [w.system_url for w in self.workers if w.system_url not in self._initialized]
        if missing:
            raise InvalidArgument(
                f"start_weight_update: workers {missing} were never initialised; call "
                "init_weight_transfer_engine(init_info) first"
            )

    def _update_body(self, rpc: str, **kwargs: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"engine_rpc": rpc, **kwargs}
        if not self.pause or self._unpaused_stage:
            body.update(allow_unpaused=True, reset_prefix_cache=False)
        elif rpc != "finish_weight_update":
            body["reset_prefix_cache"] = False  # only the finished weights make the cache stale
        return body

    def _split(self, update_info: Any) -> dict[str, Any]:
        if isinstance(update_info, Mapping):
            return {w.system_url: dict(update_info) for w in self.workers}
        if not isinstance(update_info, list):
            raise InvalidArgument(
                f"update_info: expected a dict or a per-rank list, got {type(update_info).__name__}"
            )
        unknown = [w.system_url for w in self.workers if w.world_size is None]
        if unknown:
            raise InvalidArgument(
                f"update_info: a per-rank list needs each worker's world_size, unknown for {unknown}; "
                "give DynamoWorker.from_url(url, world_size=N), discover the workers with "
                "DynamoRefitClient.from_frontend, or pass one dict for all ranks"
            )
        sizes = [w.world_size or 0 for w in self.workers]
        total = sum(sizes)
        if len(update_info) != total:
            raise InvalidArgument(
                f"update_info: a per-rank list needs {total} entries (world sizes {sizes}), "
                f"got {len(update_info)}"
            )
        out, offset = {}, 0
        for w, size in zip(self.workers, sizes, strict=True):
            out[w.system_url] = update_info[offset : offset + size]
            offset += size
        return out

    def _abort(self, step: str, failures: dict[str, str]) -> None:
        """End a failed cycle: finish what is open, resume what is paused, then raise."""
        open_ = [w for w in self.workers if w.system_url in self._started]
        _, finish_failures = self._each(
            open_,
            lambda w: self._post(
                w, "update_weights_from_distributed", self._update_body("finish_weight_update")
            ),
        )
        self._started.clear()
        for url, message in finish_failures.items():
            failures.setdefault(url, f"finish after failure: {message}")
            self._updated.discard(url)
        resumed, resume_failures = self._resume_all()
        for url, message in resume_failures.items():
            failures[url] = f"{failures[url]}; {message}" if url in failures else message
        raise DynamoRefitError(step, failures, resumed=resumed, updated=sorted(self._updated))

    def _resume_all(self) -> tuple[list[str], dict[str, str]]:
        paused = [w for w in self.workers if w.system_url in self._paused]
        ok, failures = self._each(paused, lambda w: self._post(w, "resume_generation", {}))
        self._paused.difference_update(ok)
        return list(ok), {url: f"resume_generation: {m}" for url, m in failures.items()}

    def _each(
        self, workers: Sequence[DynamoWorker], call: Callable[[DynamoWorker], Any]
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Run ``call`` on every worker concurrently: ({URL: result}, {URL: error})."""
        if not workers:
            return {}, {}
        with ThreadPoolExecutor(len(workers), thread_name_prefix="mx-dynamo") as pool:
            futures = [(w, pool.submit(call, w)) for w in workers]
        results, failures = {}, {}
        for worker, future in futures:
            exc = future.exception()
            if exc is None:
                results[worker.system_url] = future.result()
            else:
                failures[worker.system_url] = str(exc)
        return results, failures

    def _post(
        self, worker: DynamoWorker, route: str, body: Mapping[str, Any], timeout_s: float | None = None
    ) -> dict[str, Any]:
        """POST one engine route; raise :class:`_RouteError` naming the route on any failure."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        url = f"{worker.system_url}/engine/{route}"
        request = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers=self.headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise _RouteError(f"{route}: HTTP {exc.code} {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise _RouteError(f"{route}: no reply within {timeout:g}s") from None
            raise _RouteError(f"{route}: {url} unreachable ({reason})") from None
        try:
            reply = json.loads(raw or b"{}")
        except ValueError:
            raise _RouteError(f"{route}: reply is not JSON: {raw[:200]!r}") from None
        if not isinstance(reply, dict) or reply.get("status", "ok") != "ok":
            message = reply.get("message", reply) if isinstance(reply, dict) else reply
            raise _RouteError(f"{route}: {message}")
        log.debug("%s %s -> %s", worker.system_url, route, reply)
        return reply
