"""``CatalogServer``: gRPC server lifecycle, bearer-token check and the reaper thread.

* :class:`CatalogServer` serves one :class:`CatalogService` (``start``/``stop``/context manager).
* :func:`start_embedded` is the in-process default: loopback, ephemeral port.
* :func:`serve_forever` backs ``mx-refit serve``: runs until SIGINT/SIGTERM.

Every server also carries the standard gRPC health service (``grpc.health.v1.Health``), which
answers without the token so that load balancers and Kubernetes probes can use it.

The token travels as ``authorization: Bearer <token>`` metadata over a plaintext channel: it
guards against stray clients, not against an attacker on the network. Bind to loopback (the
default) or to an isolated cluster network.
"""

from __future__ import annotations

import hmac
import logging
import signal
import threading
from collections.abc import Callable
from concurrent import futures
from types import FrameType, TracebackType
from typing import Any

import grpc

from mx_refit.catalog.api import DEFAULT_MAX_MESSAGE_BYTES
from mx_refit.catalog.express.server import ExpressServer
from mx_refit.catalog.service import CatalogService
from mx_refit.catalog.servicer import CatalogServicer
from mx_refit.catalog.v1 import catalog_pb2_grpc
from mx_refit.catalog.validation import check_token
from mx_refit.errors import InvalidArgument, Unavailable

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_PORT",
    "CatalogServer",
    "routable_host",
    "serve_forever",
    "start_catalog",
    "start_embedded",
]

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50551
# Accept the clients' keepalive pings (every 10 s, client.CHANNEL_RECONNECT_OPTIONS); gRPC's
# default would answer them with GOAWAY "too_many_pings".
KEEPALIVE_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
)
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_ANY_HOST = ("0.0.0.0", "::", "[::]", "")


def routable_host() -> str:
    """An address of this machine that other machines can dial: the source address of the
    default route (found without sending a packet), else the host name's address, else
    loopback."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # UDP connect only picks a route
            address = probe.getsockname()[0]
            if address and not address.startswith("0."):
                return str(address)
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
_HEALTH_PREFIX = "/grpc.health.v1.Health/"
# The name the standard health service reports the catalog under ("" is the whole server).
HEALTH_SERVICE_NAME = "mx_refit.catalog.v1.CatalogService"


def format_address(host: str, port: int) -> str:
    """``host:port``, bracketing IPv6 literals."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class _BearerTokenInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Rejects every call whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._missing = self._deny("missing 'authorization: Bearer <token>' metadata")
        self._wrong = self._deny("wrong bearer token")

    @staticmethod
    def _deny(message: str) -> grpc.RpcMethodHandler[Any, Any]:
        def abort(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"catalog: {message}")

        return grpc.unary_unary_rpc_method_handler(abort)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if handler_call_details.method.startswith(_HEALTH_PREFIX):  # probes carry no token
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(presented, self._expected):  # constant time
                    return continuation(handler_call_details)
                return self._wrong
        return self._missing


class CatalogServer:
    """A gRPC catalog server around a :class:`CatalogService`.

    :param host: interface to bind; loopback by default, ``0.0.0.0`` for every interface.
    :param port: TCP port; 0 picks a free one (read it back from :attr:`address`).
    :param advertise_host: the host name or address :attr:`address` gives to clients; by default
        the bind host, or :func:`routable_host` when binding every interface.
    :param token: when set, every call must carry ``authorization: Bearer <token>``.
    :param max_message_bytes: largest request/reply (manifests of ~1M descriptors must fit).
    :param service: the state machine to serve (a fresh one by default; tests inject one with
        a fake clock).
    :param reap_interval_s: how often the reaper thread expires lapsed sources and leases.
    :param max_workers: server threads; WaitDrained calls each hold one for up to 30 s, so keep
        it well above the number of publishing ranks.
    :param express: also serve the express lane (:mod:`mx_refit.catalog.express`: a steady
        refit's catalog calls over one TCP connection, on an ephemeral port of ``host``, offered
        to readers in ``LeaseVersion`` replies; a reader that cannot reach it uses gRPC).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        *,
        service: CatalogService | None = None,
        reap_interval_s: float = 1.0,
        max_workers: int = 256,
        advertise_host: str | None = None,
        express: bool = True,
    ) -> None:
        if reap_interval_s <= 0:
            raise InvalidArgument(f"reap_interval_s: {reap_interval_s} must be > 0")
        self.host = host
        self.advertise_host = advertise_host or (routable_host() if host in _ANY_HOST else host)
        self.service = service if service is not None else CatalogService()
        self._port = port
        self._token = check_token(token)
        self._max_message_bytes = max_message_bytes
        self._reap_interval_s = reap_interval_s
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self._stopping = threading.Event()
        self._reaper: threading.Thread | None = None
        self._lock = threading.Lock()
        self._health: Any = None
        self._express_enabled = express
        self._express: ExpressServer | None = None

    @property
    def address(self) -> str:
        """``host:port`` clients connect to: the advertised host and the real port once started."""
        return format_address(self.advertise_host, self._port)

    @property
    def port(self) -> int:
        return self._port

    @property
    def express(self) -> ExpressServer | None:
        """The express lane while serving (``express=True``), else None."""
        return self._express

    def start(self) -> CatalogServer:
        """Bind, start serving and start the reaper; returns ``self``.

        Raises ``OSError`` when the address cannot be bound (e.g. the port is taken).
        """
        with self._lock:
            if self._server is not None:
                raise RuntimeError(f"catalog server on {self.address} is already started")
            options = [
                ("grpc.max_send_message_length", self._max_message_bytes),
                ("grpc.max_receive_message_length", self._max_message_bytes),
                # Without this, Linux lets a second server bind the same port and silently
                # steal half of the connections.
                ("grpc.so_reuseport", 0),
                *KEEPALIVE_SERVER_OPTIONS,
            ]
            interceptors: list[grpc.ServerInterceptor[Any, Any]] = (
                [_BearerTokenInterceptor(self._token)] if self._token else []
            )
            server = grpc.server(
                futures.ThreadPoolExecutor(
                    max_workers=self._max_workers, thread_name_prefix="mx-refit-catalog"
                ),
                interceptors=interceptors,
                options=options,
            )
            self._stopping.clear()
            servicer = CatalogServicer(self.service, stopping=self._stopping)
            catalog_pb2_grpc.add_CatalogServiceServicer_to_server(  # type: ignore[no-untyped-call]
                servicer, server
            )
            self._health = _add_health_service(server)
            wanted = format_address(self.host or "0.0.0.0", self._port)
            try:
                port = server.add_insecure_port(wanted)
            except RuntimeError as exc:
                cause = str(exc).split(";")[0]  # drop gRPC's "set GRPC_VERBOSITY" hint
                raise OSError(f"cannot bind the catalog server to {wanted}: {cause} (is the port already in use?)") from None
            if port == 0:  # older grpc reports bind failures this way
                raise OSError(f"cannot bind the catalog server to {wanted} (is the port already in use?)")
            self._port = port
            if self._express_enabled:
                self._express = ExpressServer(servicer, self.host, self._token)
                servicer.express_port = self._express.start()
            server.start()
            self._server = server
            self._reaper = threading.Thread(
                target=self._reap_loop, name="mx-refit-catalog-reaper", daemon=True
            )
            self._reaper.start()
            logger.debug("catalog server listening on %s", self.address)
            return self

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting calls, let in-flight ones finish for ``grace`` s, stop the reaper.

        Idempotent.
        """
        with self._lock:
            server, self._server = self._server, None
            reaper, self._reaper = self._reaper, None
        if server is None:
            return
        if self._health is not None:
            self._health.enter_graceful_shutdown()  # probes see NOT_SERVING while in-flight calls finish
        self._stopping.set()
        if self._express is not None:
            self._express.stop()
            self._express = None
        server.stop(grace).wait()
        if reaper is not None:
            reaper.join()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Block until the server stops; True if it did within ``timeout``."""
        server = self._server
        return True if server is None else server.wait_for_termination(timeout)

    def __enter__(self) -> CatalogServer:
        return self if self._server is not None else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        running = "running" if self._server is not None else "stopped"
        return f"CatalogServer({self.address}, {running}, token={'set' if self._token else 'none'})"

    def _reap_loop(self) -> None:
        # Event.wait, not sleep: stop() interrupts the loop at once.
        while not self._stopping.wait(self._reap_interval_s):
            try:
                report = self.service.reap()
            except Unavailable as exc:  # the store is down: the next pass tries again
                logger.warning("catalog reaper: %s", exc)
                continue
            except Exception:  # keep reaping: one bad pass must not leave leases live forever
                logger.exception("catalog reaper pass failed")
                continue
            if report.sources:
                logger.warning(
                    "catalog: sources %s missed their heartbeats; expired versions %s",
                    list(report.sources),
                    [f"{m}@{v}" for m, v in report.versions],
                )
            if report.leases:
                logger.info("catalog: %d reader lease(s) expired", len(report.leases))


def _add_health_service(server: grpc.Server) -> Any:
    """The standard ``grpc.health.v1.Health`` service: SERVING for "" and the catalog."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    servicer = health.HealthServicer()
    for name in ("", HEALTH_SERVICE_NAME):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


def start_embedded(token: str | None = None, **kwargs: Any) -> CatalogServer:
    """Start an in-process catalog on 127.0.0.1 and an ephemeral port; returns it running.

    ``kwargs`` go to :class:`CatalogServer` (e.g. ``service=``). Stop it with ``.stop()``.
    """
    return CatalogServer(host="127.0.0.1", port=0, token=token, **kwargs).start()


def _check_store(store: Any) -> None:
    """Before anything binds: an unreachable store is a clean error, and a Redis whose settings
    put the catalog at risk is named (warned; refused when it evicts keys)."""
    for check in ("ping", "check_settings"):
        call = getattr(store, check, None)
        if call is not None:
            call()


def start_catalog(
    *,
    host: str | None = None,
    port: int | None = None,
    advertise_host: str | None = None,
    token: str | None = None,
    config: Any = None,
    store: str | None = None,
    **kwargs: Any,
) -> CatalogServer:
    """Start the embedded catalog in this process; returns it running (``.address``, ``.stop()``).

    :param host: interface to bind (default ``127.0.0.1``; ``0.0.0.0`` serves other machines).
    :param port: 0 (the default) picks a free port.
    :param advertise_host: what ``.address`` tells clients to dial; by default the bind host, or
        a routable address of this machine when binding every interface.
    :param token: when set, every call must carry it.
    :param store: where the catalog keeps its state: ``memory`` (the default) or
        ``redis://HOST:PORT/DB`` (kept across restarts, shared with other catalog processes).
    :param config: a :class:`~mx_refit.config.WeightSyncConfig`: ``catalog.host``, ``port``,
        ``advertise_host``, ``token`` and ``store`` fill in what is not passed, and ``catalog.address`` is
        set to the started server's address, so the same config can be handed to every rank.
    ``kwargs`` go to :class:`CatalogServer`.
    """
    section = getattr(config, "catalog", None)
    field = "store" if store is not None else "weight_sync.catalog.store"
    store_url = store if store is not None else getattr(section, "store", "memory")
    if store_url != "memory" and "service" not in kwargs:
        from mx_refit.catalog.store import open_store

        kwargs["service"] = CatalogService(store=open_store(store_url, field=field))
    server = CatalogServer(
        host=host if host is not None else getattr(section, "host", "127.0.0.1"),
        port=port if port is not None else getattr(section, "port", 0),
        token=token if token is not None else getattr(section, "token", None),
        advertise_host=advertise_host or getattr(section, "advertise_host", None),
        **kwargs,
    ).start()
    if section is not None:
        section.address = server.address
    return server


def serve_forever(
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    stop_event: threading.Event | None = None,
    grace_s: float = 5.0,
    metrics_port: int | None = None,
    on_listening: Callable[[dict[str, Any]], None] | None = None,
    store: str = "memory",
    express: bool = True,
) -> None:
    """Run a catalog server until SIGINT/SIGTERM (or ``stop_event``), then stop cleanly.

    Binds loopback unless told otherwise. Once it listens, ``on_listening`` gets
    ``{"address", "host", "port", "token", "health", "metrics"}`` (``token``: whether one is
    required; ``metrics``: the Prometheus URL with ``metrics_port``, else None). Signal handlers
    are installed only when called from the main thread, and restored on return.

    ``store``: where the catalog keeps its state, ``memory`` (lost when the process ends) or
    ``redis://HOST:PORT/DB`` (shared by every catalog process on it, kept across restarts; the
    Redis server must be reachable at start). ``on_listening`` also gets ``"store"`` and
    ``"express_port"`` (the express lane's port; 0 with ``express=False``).
    """
    if not 0 <= port <= 65535:
        raise InvalidArgument(f"port: {port} is out of range (0-65535; 0 picks a free port)")
    stop = stop_event if stop_event is not None else threading.Event()
    metrics_url = None
    if metrics_port is not None:
        from mx_refit.metrics import require_prometheus

        require_prometheus()  # before binding anything: a missing extra is a clean error
    from mx_refit.catalog.store import open_store

    state_store = open_store(store, field="store")
    # Handlers before the server starts: every sign of life (an answered call, the log line,
    # on_listening) then comes after them, so a supervisor that stops us as soon as it sees one
    # gets a clean shutdown, not death by SIGTERM (CI saw exit -15 in that window).
    previous = _stop_on_signals(stop)
    try:
        _check_store(state_store)
        server = CatalogServer(host, port, token, max_message_bytes,
                               service=CatalogService(store=state_store), express=express).start()
    except BaseException:
        _restore_signals(previous)
        state_store.close()
        raise
    metrics_server = None
    try:
        if metrics_port is not None:
            from mx_refit.metrics import serve_catalog_metrics

            metrics_server, metrics_url = serve_catalog_metrics(server.service, host, metrics_port)
    except BaseException:
        server.stop(0)
        _restore_signals(previous)
        state_store.close()
        raise
    if host not in _LOOPBACK and token is None:
        logger.warning(
            "catalog on %s accepts unauthenticated calls from the network; set a token",
            server.address,
        )
    logger.info("mx-refit catalog serving on %s", server.address)
    try:
        if on_listening is not None:
            on_listening({"address": server.address, "host": host, "port": server.port, "token": token is not None,
                          "health": "grpc.health.v1.Health", "metrics": metrics_url, "store": state_store.url,
                          "express_port": server.express.port if server.express else 0})
        stop.wait()
    finally:
        _restore_signals(previous)
        if metrics_server is not None:
            metrics_server.shutdown()
        server.stop(grace_s)
        state_store.close()
        logger.info("mx-refit catalog on %s stopped", server.address)


def _stop_on_signals(stop: threading.Event) -> dict[int, Any]:
    """SIGINT/SIGTERM set ``stop`` (main thread only: elsewhere Python allows no handlers);
    returns the handlers they replaced."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():

        def on_signal(signum: int, frame: FrameType | None) -> None:
            logger.info("catalog: received %s, stopping", signal.Signals(signum).name)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    return previous


def _restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)
