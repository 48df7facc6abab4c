"""A real Prometheus scrapes a live stack and evaluates dracap's recording rules and alerts.

The in-process stack (the services of ``dracap up``) serves ``/metrics`` on a free port;
a ``prometheus`` process (Debian's package; the test skips, saying so, without it)
scrapes it every second with ``deploy/prometheus/rules.yaml`` loaded, rules evaluated
every second. A claim waits for capacity once, then claims flow through the stack until
*every* recording rule of the file has produced a series, read back through
Prometheus's HTTP API. Then one message is forged on a reservation consumer's subject:
``DracapUnconfirmedMessages`` must fire on that first one (its counter is exported at 0
from the start, so ``increase()`` sees it; a series that appears at 1 would not).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from events.subjects import BusNames
from services import durables
from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground.metrics import start_metrics_server
from services.runtime.ground.settings import Settings
from services.runtime.ops.embedded import free_port
from tests.integration.cluster import running_cluster
from tests.integration.test_class_modes import GPU_CLASS, INVENTORY
from tests.integration.test_policy import NAMESPACE, _ready, claim_doc, view_when

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
#: every recording rule of the file
RECORDED = tuple(
    rule["record"]
    for group in yaml.safe_load(RULES.read_text())["groups"]
    for rule in group["rules"]
    if "record" in rule
)


def _query(port: int, expr: str) -> list[Any]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    result: list[Any] = body["data"]["result"]
    return result


async def test_prometheus_scrapes_the_stack_and_the_recording_rules_produce_series(
    settings: Settings, nats_url: str, tmp_path: Path
) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (Debian's prometheus package)")
    metrics, _ = start_metrics_server(0, addr="127.0.0.1")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "dracap",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{metrics.server_port}"],
                        "labels": {"service": "dracap-metrics"},
                    }
                ],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    server = await asyncio.create_subprocess_exec(
        binary, f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
        stdout=log, stderr=log,
    )  # fmt: skip
    log.close()
    try:
        async with running_cluster(settings, nats_url, tmp_path, INVENTORY) as cluster:
            api = cluster.api
            # Prometheus holds the class's series (at 0) before the first observation
            await _scraped(port, f'dracap_capacity_wait_seconds_count{{class="{GPU_CLASS}"}}')
            await _wait_for_capacity_once(api)
            found: dict[str, list[Any]] = {}
            with contextlib.suppress(TimeoutError):
                await _until_recorded(api, port, found)
            missing = set(RECORDED) - found.keys()
            assert not missing, f"no series from {sorted(missing)}"
            up = await asyncio.to_thread(_query, port, 'up{service="dracap-metrics"}')
            fired = await _first_forgery_fires(cluster.stack.names, nats_url, port)
    finally:
        server.terminate()
        async with asyncio.timeout(30):
            await server.wait()
        metrics.shutdown()
        metrics.server_close()
    assert [sample["value"][1] for sample in up] == ["1"], (tmp_path / "prometheus.log").read_text()
    for expr in RECORDED:
        value = float(found[expr][0]["value"][1])
        assert value > 0 if expr.endswith(("p99_5m", "p99_15m")) else value >= 0, expr
    classes = {r["metric"]["class"] for r in found["dracap:claim_convergence_seconds:p99_5m"]}
    assert "gpu.dracap.io" in classes
    assert fired, "DracapUnconfirmedMessages did not fire on the first forged message"


async def _scraped(port: int, series: str) -> None:
    """Until Prometheus holds ``series`` (bounded)."""
    async with asyncio.timeout(60):
        while True:
            with contextlib.suppress(OSError):
                if await asyncio.to_thread(_query, port, series):
                    return
            await asyncio.sleep(0.5)


async def _until_recorded(api: Any, port: int, found: dict[str, list[Any]]) -> None:
    """Claims flow until every recording rule has a number (bounded: 120 s)."""
    async with asyncio.timeout(120):
        i = 0
        while len(found) < len(RECORDED):
            name = f"c{i}"
            await api.claims(NAMESPACE, "apply", claim_doc(name, "5Gi"))
            await view_when(api, name, _ready)
            await api.claims(NAMESPACE, "delete", {"name": name})
            i += 1
            for expr in RECORDED:
                with contextlib.suppress(OSError):
                    result = await asyncio.to_thread(_query, port, expr)
                    # series of earlier tests in this process may be NaN (no recent
                    # observations): only a number counts
                    numbers = [r for r in result if r["value"][1] != "NaN"]
                    if numbers:
                        found[expr] = numbers


async def _wait_for_capacity_once(api: Any) -> None:
    """Both GPUs full, a third claim waits for capacity, gets it when one is freed (the
    capacity-wait histogram observes it)."""
    for name in ("fill-0", "fill-1"):
        await api.claims(NAMESPACE, "apply", claim_doc(name, "40Gi"))
        await view_when(api, name, _ready)
    await api.claims(NAMESPACE, "apply", claim_doc("waiter", "40Gi"))
    await view_when(api, "waiter", lambda view: view.get("phase") == "unschedulable")
    await api.claims(NAMESPACE, "delete", {"name": "fill-0"})
    await view_when(api, "waiter", _ready)
    for name in ("fill-1", "waiter"):
        await api.claims(NAMESPACE, "delete", {"name": name})


async def _first_forgery_fires(names: BusNames, nats_url: str, port: int) -> bool:
    """Once Prometheus holds the reservation consumer's unconfirmed counter (at 0), forge
    one message on its subject; whether the alert fires within a minute."""
    (durable, *_) = durables.reservation(names)
    await _scraped(port, f'dracap_unconfirmed_messages_total{{consumer="{durable.name}"}}')
    subject = ".".join(
        "forged" if t in ("*", ">") else t for t in durable.filter_subject.split(".")
    )
    nc, js = await connect_bus(nats_url)
    try:  # not JSON, an id the log never held: the consumer drops it and counts it
        await js.publish(subject, b"forged", headers={"Nats-Msg-Id": str(uuid.uuid4())})
    finally:
        await nc.close()
    alert = 'ALERTS{alertname="DracapUnconfirmedMessages", alertstate="firing"}'
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(60):
            while not await asyncio.to_thread(_query, port, alert):  # noqa: ASYNC110
                await asyncio.sleep(0.5)
            return True
    return False
