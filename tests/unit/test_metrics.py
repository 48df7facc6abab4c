"""Every metric of the services sketch is served by the metrics endpoint."""

from __future__ import annotations

import urllib.request

from services.runtime import metrics

NAMES = [
    "dracap_scheduling_latency_seconds_bucket",
    "dracap_claims_total",
    "dracap_rejections_total",
    "dracap_capacity_allocated_ratio",
    "dracap_enforcement_latency_seconds_bucket",
    "dracap_relay_lag_events",
    "dracap_consumer_redeliveries_total",
    "dracap_dead_letters_total",
    "dracap_build_info",
]


def test_metrics_server_serves_every_metric() -> None:
    metrics.CLAIMS.labels(outcome="admitted").inc()
    metrics.REJECTIONS.labels(reason="class").inc()
    metrics.CAPACITY_ALLOCATED_RATIO.labels("gpu.example.com", "memory").set(0.5)
    metrics.CONSUMER_REDELIVERIES.labels(consumer="t").inc(0)
    metrics.DEAD_LETTERS.labels(consumer="t").inc(0)
    server, thread = metrics.start_metrics_server(0, addr="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    lines = text.splitlines()
    for name in NAMES:
        assert any(line.startswith(name) for line in lines), name
    assert f'dracap_build_info{{version="{metrics.version()}"}} 1.0' in lines
