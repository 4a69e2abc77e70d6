"""Prometheus metrics, optional (``pip install "mx-refit[metrics]"``).

* The catalog: ``mx-refit serve --metrics-port PORT`` exposes gauges of its state
  (``mx_refit_catalog_models``, ``mx_refit_catalog_versions{state}``, ``mx_refit_catalog_sources``,
  ``mx_refit_catalog_leases``), read at scrape time.
* Refits: in an inference process, set ``MX_REFIT_METRICS_PORT`` (the plugin loader then
  registers :class:`RefitMetrics` and serves ``/metrics`` on that port) or register
  ``RefitMetrics()`` on your own :class:`~mx_refit.plugins.Hooks` and export the default
  registry yourself. Counters per model: ``mx_refit_refits_total``,
  ``mx_refit_refit_failures_total``, ``mx_refit_refit_bytes_total``,
  ``mx_refit_refit_seconds_total``, ``mx_refit_refit_descriptors_total``,
  ``mx_refit_refit_registrations_total``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mx_refit.errors import InvalidArgument, require
from mx_refit.hookspecs import hookimpl

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.catalog.service import CatalogService
    from mx_refit.types import RefitStats

__all__ = ["METRICS_PORT_ENV", "RefitMetrics", "require_prometheus", "serve_catalog_metrics", "start_metrics_server"]

log = logging.getLogger(__name__)

METRICS_PORT_ENV = "MX_REFIT_METRICS_PORT"


def require_prometheus() -> None:
    require("prometheus_client", purpose="for the Prometheus metrics endpoint")


def start_metrics_server(port: int, host: str = "127.0.0.1", registry: Any = None) -> tuple[Any, str]:
    """Serve ``registry`` (default: prometheus_client's global one) on ``http://host:port/metrics``;
    returns the HTTP server (``.shutdown()``) and its URL. Raises ``OSError`` if the port is taken."""
    require_prometheus()
    import prometheus_client

    kwargs = {"registry": registry} if registry is not None else {}
    server, _thread = prometheus_client.start_http_server(port, addr=host, **kwargs)
    bound = server.server_address[1]
    shown = f"[{host}]" if ":" in host else host
    return server, f"http://{shown}:{bound}/metrics"


class _CatalogCollector:
    """Reads the catalog's counts at scrape time (no bookkeeping on the hot path)."""

    def __init__(self, service: CatalogService) -> None:
        self._service = service

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        counts = self._service.counts()
        yield GaugeMetricFamily("mx_refit_catalog_models", "models the catalog knows", value=counts["models"])
        versions = GaugeMetricFamily("mx_refit_catalog_versions", "versions by state", labels=["state"])
        for state, count in counts["versions"].items():
            versions.add_metric([state], count)
        yield versions
        yield GaugeMetricFamily("mx_refit_catalog_sources", "live publishing sources", value=counts["sources"])
        yield GaugeMetricFamily("mx_refit_catalog_leases", "live reader leases", value=counts["leases"])


def serve_catalog_metrics(service: CatalogService, host: str, port: int) -> tuple[Any, str]:
    """Expose ``service``'s gauges on their own registry; returns (HTTP server, URL)."""
    require_prometheus()
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(_CatalogCollector(service))  # type: ignore[arg-type]
    return start_metrics_server(port, host, registry)


class RefitMetrics:
    """A plugin that counts refits into Prometheus counters (labelled by model)."""

    def __init__(self, registry: Any = None) -> None:
        require_prometheus()
        from prometheus_client import REGISTRY, Counter

        registry = registry if registry is not None else REGISTRY

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["model"], registry=registry)

        self.refits = counter("mx_refit_refits", "completed refits")
        self.failures = counter("mx_refit_refit_failures", "refits that raised")
        self.bytes = counter("mx_refit_refit_bytes", "bytes pulled over NIXL")
        self.seconds = counter("mx_refit_refit_seconds", "seconds spent pulling")
        self.descriptors = counter("mx_refit_refit_descriptors", "NIXL descriptors posted")
        self.registrations = counter("mx_refit_refit_registrations", "new NIXL memory registrations")

    @hookimpl
    def mx_refit_refit_done(self, stats: RefitStats) -> None:
        self.refits.labels(stats.model).inc()
        self.bytes.labels(stats.model).inc(stats.bytes_pulled)
        self.seconds.labels(stats.model).inc(stats.seconds)
        self.descriptors.labels(stats.model).inc(stats.descriptors)
        self.registrations.labels(stats.model).inc(stats.new_registrations)

    @hookimpl
    def mx_refit_refit_failed(self, model: str, version: int | None, error: BaseException) -> None:
        self.failures.labels(model).inc()


_from_env_lock = threading.Lock()
_from_env: RefitMetrics | None = None
_from_env_port_taken = False  # this process found the port taken and said so once


def refit_metrics_from_env() -> RefitMetrics | None:
    """The process-wide :class:`RefitMetrics` when ``MX_REFIT_METRICS_PORT`` is set (its HTTP
    endpoint started once, on 127.0.0.1 unless ``MX_REFIT_METRICS_HOST`` says otherwise).

    Every worker process of a multi-process engine inherits the variable: the first to bind the
    port serves its refits there; each other process logs one warning naming the port and runs
    on without metrics (None), rather than failing its start on "Address already in use"."""
    global _from_env, _from_env_port_taken
    raw = os.environ.get(METRICS_PORT_ENV, "").strip()
    if not raw:
        return None
    with _from_env_lock:
        if _from_env is None and not _from_env_port_taken:
            if not raw.isdigit() or not 0 <= int(raw) <= 65535:
                raise InvalidArgument(f"{METRICS_PORT_ENV}: {raw!r} is not a port number (0-65535)")
            host = os.environ.get("MX_REFIT_METRICS_HOST", "127.0.0.1")
            try:
                _server, url = start_metrics_server(int(raw), host)
            except OSError as exc:
                _from_env_port_taken = True
                log.warning("%s=%s: %s:%s is taken (%s), most likely by another process of this engine that "
                            "serves its refit metrics there; this process (pid %d) runs without refit metrics "
                            "(give each process its own port to see them all)",
                            METRICS_PORT_ENV, raw, host, raw, exc.strerror or exc, os.getpid())
                return None
            log.info("mx-refit refit metrics on %s", url)
            _from_env = RefitMetrics()
        return _from_env
