"""The metrics endpoint of a running stack reports every metric of the issue.

The stack is :class:`services.stack.Stack` (what ``dracap up`` runs), so this also checks
the wiring: the capacity gauges listen to the stack's live state and the per-consumer
series exist from the start. Counters are process-wide, so the checks compare a scrape
after the claim is ready with one taken before it was applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from events.subjects import BusNames
from services.replay.verify import summary, verify
from services.reservation.service import FEEDS
from services.runtime.bus.apiclient import ApiClient, ApiError
from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground.metrics import start_metrics_server
from services.runtime.ground.settings import Settings
from services.stack import Stack
from tests.integration.test_pipeline import (
    GPU,
    INVENTORY_CLASSES,
    INVENTORY_SLICES,
    NODE,
    claim_manifest,
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """Every sample of the endpoint, keyed by (sample name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def has(samples: Samples, name: str, **labels: str) -> bool:
    return (name, frozenset(labels.items())) in samples


@pytest.fixture
def metrics_port() -> Iterator[int]:
    server, thread = start_metrics_server(0, addr="127.0.0.1")
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
async def stack(settings: Settings, nats_url: str) -> AsyncIterator[Stack]:
    settings = msgspec.structs.replace(settings, nats_url=nats_url, pool_max_size=8)
    names = BusNames(f"t{uuid.uuid4().hex[:12]}")
    async with Stack.running(settings, names, nodes=[NODE], workers=2) as running:
        try:
            yield running
        finally:
            _, js = running.nc, running.js
            with contextlib.suppress(Exception):
                await js.delete_stream(names.stream)


async def wait_ready(api: ApiClient, namespace: str, name: str, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        view = (await api.claims(namespace, "get", {"name": name}))["claim"]
        if view["ready"]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{namespace}/{name} did not become ready")


async def test_every_required_metric_has_a_value(
    stack: Stack, metrics_port: int, settings: Settings, nats_url: str
) -> None:
    nc, _ = await connect_bus(nats_url)
    api = ApiClient(nc, stack.names)
    try:
        await api.admin("deviceclasses.apply", INVENTORY_CLASSES.encode())
        await api.admin("slices.apply", INVENTORY_SLICES.encode())
        access = {"namespace": "tenant-a", "classes": ["*"], "admin_access": False}
        await api.admin("namespaces.access", access)
        before = scrape(metrics_port)

        await api.claims("tenant-a", "apply", claim_manifest("train", "tenant-a", "10Gi"))
        with pytest.raises(ApiError):
            await api.claims("tenant-a", "apply", claim_manifest("nope", "tenant-a", "64Gi"))
        await wait_ready(api, "tenant-a", "train")

        deadline = time.monotonic() + 30
        while True:  # the gauges, the relay lag and what is counted after a commit follow
            after = scrape(metrics_port)  # the log asynchronously
            counted = "dracap_enforcement_latency_seconds_count"
            by_class = {"class": GPU}
            settled = (
                value(after, "dracap_relay_lag_events") == 0
                and value(
                    after, "dracap_capacity_allocated_ratio", **{"class": GPU, "capacity": "memory"}
                )
                == pytest.approx(10 / 80)
                and value(after, counted, **by_class) > value(before, counted, **by_class)
            )
            if settled or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
    finally:
        await nc.close()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # scheduling and enforcement latency of the claim's class: one observation each, in s
    by_class = {"class": GPU}
    assert delta("dracap_scheduling_latency_seconds_count", **by_class) >= 1
    assert 0 <= delta("dracap_scheduling_latency_seconds_sum", **by_class) < 10
    assert delta("dracap_enforcement_latency_seconds_count", **by_class) >= 1
    assert 0 <= delta("dracap_enforcement_latency_seconds_sum", **by_class) < 10
    # claims by outcome, rejections by reason
    for outcome in ("admitted", "allocated", "ready", "rejected"):
        assert delta("dracap_claims_total", outcome=outcome) >= 1, outcome
    assert has(after, "dracap_claims_total", outcome="released")
    rejections = {
        dict(labels)["reason"]: v - before.get((name, labels), 0.0)
        for (name, labels), v in after.items()
        if name == "dracap_rejections_total"
    }
    assert sum(rejections.values()) >= 1, rejections
    # the same decisions from the log, by class: the rejection rate of each DeviceClass
    for outcome in ("admitted", "rejected"):
        got = delta("dracap_claim_decisions_total", outcome=outcome, **by_class)
        assert got >= 1, outcome
    # allocated / total capacity per class: 10Gi of 2 x 40Gi; the unused class has 0
    ratio = value(after, "dracap_capacity_allocated_ratio", **{"class": GPU, "capacity": "memory"})
    assert ratio == pytest.approx(10 / 80)
    race = {"class": "race-memory.dracap.io", "capacity": "memory"}
    assert value(after, "dracap_capacity_allocated_ratio", **race) == 0
    assert has(after, "dracap_capacity_allocated_ratio", **race)
    # the relay caught up
    assert has(after, "dracap_relay_lag_events")
    assert value(after, "dracap_relay_lag_events") == 0
    # per consumer: redeliveries and dead letters exist from the start, none dead-lettered
    ours = [f"reservation-{feed}" for feed in FEEDS] + [f"agent-{NODE}"]
    for consumer in ours:
        assert has(after, "dracap_consumer_redeliveries_total", consumer=consumer), consumer
        assert has(after, "dracap_dead_letters_total", consumer=consumer), consumer
        assert delta("dracap_dead_letters_total", consumer=consumer) == 0, consumer
    assert any(name == "dracap_build_info" for name, _ in after)

    report = await verify(settings, from_start=True)
    assert report.ok, summary(report)
