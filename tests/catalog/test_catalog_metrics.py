"""Prometheus metrics (the `metrics` extra): the catalog's gauges and the refit counters, scraped
over real HTTP from a real prometheus_client server."""

from __future__ import annotations

import urllib.request

import pytest
from catalog_factories import tp_source

pytest.importorskip("prometheus_client", reason="the `metrics` extra is not installed")

from mx_refit.metrics import RefitMetrics, serve_catalog_metrics  # noqa: E402
from mx_refit.plugins import Hooks  # noqa: E402
from mx_refit.types import RefitStats  # noqa: E402


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_catalog_gauges_follow_the_state(service):
    server, url = serve_catalog_metrics(service, "127.0.0.1", 0)
    try:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        empty = _scrape(url)
        assert empty["mx_refit_catalog_models"] == 0 and empty["mx_refit_catalog_sources"] == 0
        service.register_source("m", 1, 2, tp_source(0, 2, ready=True))
        service.register_source("m", 1, 2, tp_source(1, 2, ready=True))
        service.register_source("m", 2, 2, tp_source(0, 2))
        samples = _scrape(url)
        assert samples["mx_refit_catalog_models"] == 1
        assert samples['mx_refit_catalog_versions{state="READY"}'] == 1
        assert samples['mx_refit_catalog_versions{state="PENDING"}'] == 1
        assert samples["mx_refit_catalog_sources"] == 2
        assert samples["mx_refit_catalog_leases"] == 0
    finally:
        server.shutdown()


def test_refit_counters_through_the_hooks():
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    hooks = Hooks()
    hooks.register(RefitMetrics(registry), name="metrics")
    stats = RefitStats(model="m", version=3, tensors=10, bytes_pulled=4096, bytes_needed=4096, descriptors=7,
                       seconds=0.5, new_registrations=1, sources=2)
    hooks.refit_done(stats)
    hooks.refit_done(stats)
    text = generate_latest(registry).decode()
    assert 'mx_refit_refits_total{model="m"} 2.0' in text
    assert 'mx_refit_refit_bytes_total{model="m"} 8192.0' in text
    assert 'mx_refit_refit_descriptors_total{model="m"} 14.0' in text
    assert 'mx_refit_refit_registrations_total{model="m"} 2.0' in text
    assert 'mx_refit_refit_seconds_total{model="m"} 1.0' in text
    hooks.refit_failed("m", 4, TimeoutError("version 4 never became READY"))
    assert 'mx_refit_refit_failures_total{model="m"} 1.0' in generate_latest(registry).decode()
