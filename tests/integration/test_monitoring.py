"""Every series the alert rules and the dashboard use is one a live stack exports.

The in-process stack (the services of ``dracap up``) takes a claim through apply ->
Ready -> delete -> released; then ``/metrics`` is scraped over HTTP, as Prometheus
would, and every ``dracap_*`` name in ``deploy/prometheus/rules.yaml``, the Kubernetes
PrometheusRule and ``deploy/grafana/dracap.json`` must be among the exported families.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

from services.runtime.ground.metrics import start_metrics_server
from services.runtime.ground.settings import Settings
from tests.integration.cluster import running_cluster
from tests.integration.test_class_modes import INVENTORY
from tests.integration.test_policy import NAMESPACE, _ready, claim_doc, view_when

ROOT = Path(__file__).resolve().parents[2]
_SUFFIX = re.compile(r"_(total|bucket|sum|count|created)$")


def _used() -> set[str]:
    texts = [
        (ROOT / "deploy" / "prometheus" / "rules.yaml").read_text(),
        (ROOT / "deploy" / "kubernetes" / "base" / "monitoring.yaml").read_text(),
    ]
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dracap.json").read_text())
    texts += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    return {_SUFFIX.sub("", n) for text in texts for n in re.findall(r"\bdracap_[a-z_]+", text)}


def _scrape(port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    names = set(re.findall(r"^# TYPE (dracap_[a-z_]+) ", text, re.M))
    names |= set(re.findall(r"^(dracap_[a-z_]+)", text, re.M))
    return {_SUFFIX.sub("", n) for n in names}


async def test_every_series_of_the_rules_and_the_dashboard_is_exported(
    settings: Settings, nats_url: str, tmp_path: Path
) -> None:
    server, _ = start_metrics_server(0, addr="127.0.0.1")
    try:
        async with running_cluster(settings, nats_url, tmp_path, INVENTORY) as cluster:
            api = cluster.api
            await api.claims(NAMESPACE, "apply", claim_doc("watched", "10Gi"))
            await view_when(api, "watched", _ready)
            await api.claims(NAMESPACE, "delete", {"name": "watched"})
            await view_when(api, "watched", lambda v: v["phase"] == "released")
            exported = await asyncio.to_thread(_scrape, server.server_port)
    finally:
        server.shutdown()
        server.server_close()
    missing = _used() - exported
    assert not missing, f"used by the rules or the dashboard, not exported: {sorted(missing)}"
    assert {"dracap_claim_convergence_seconds", "dracap_unknown_shares"} <= exported
