"""Every metric of docs/operations.md is served; the capacity gauges follow the state."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, Gauge

from events.catalog import DeviceClassApplied, DeviceClassRemoved, Event, ResourceSlicePublished
from events.envelopes import Envelope
from events.model import (
    CELDeviceSelector,
    DeviceClass,
    DeviceClassSpec,
    DeviceSelector,
    ObjectMeta,
)
from events.state import ClusterState
from services.runtime.ground import metrics
from services.runtime.ground.settings import SettingsError
from services.runtime.ops.gauges import (
    CLAIM_OUTCOMES,
    CapacityGauges,
    allocated_ratios,
    class_members,
    initialise_series,
    stranded_ratios,
)
from tests.unit.test_fold import (
    DRIVER,
    POOL,
    Log,
    device,
    policy,
    release,
    reserve,
    rslice,
    submitted,
)

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
    metrics.SCHEDULING_LATENCY.labels("gpu.example.com").observe(0.01)
    metrics.ENFORCEMENT_LATENCY.labels("gpu.example.com").observe(0.1)
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


def test_no_claim_or_share_labels() -> None:
    """Only low-cardinality labels: never a claim, share or event id.

    ``namespace`` (the usage counter: chargeback is per tenant) is bounded by the
    installation's tenants, like ``class`` by its DeviceClasses."""
    allowed = {"outcome", "reason", "class", "capacity", "consumer", "version", "server", "check"}
    allowed |= {"namespace", "state"}
    allowed |= {"method"}  # the kubelet's gRPC methods: five
    allowed |= {"verb"}  # a node agent's requests: four (lease, heartbeat, view, report)
    allowed |= {"service"}  # the single-active services: two (relay, snapshots)
    for name in metrics.__all__:
        labelnames = getattr(getattr(metrics, name), "_labelnames", None)
        if labelnames is not None:
            assert set(labelnames) <= allowed, (name, labelnames)


# --- the capacity gauges (services.runtime.ops.gauges) ----------------------------------------


def device_class(name: str, expression: str | None) -> DeviceClass:
    selectors = [DeviceSelector(cel=CELDeviceSelector(expression=expression))] if expression else []
    return DeviceClass(metadata=ObjectMeta(name=name), spec=DeviceClassSpec(selectors=selectors))


class FakeLive:
    """What CapacityGauges uses of a LiveState: ``state``, ``subscribe``, ``on_replaced``."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.state = log.state
        self.listeners: list[Callable[[Envelope], None]] = []

    def subscribe(self, listener: Callable[[Envelope], None]) -> Callable[[], None]:
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)

    def on_replaced(self, callback: Callable[[ClusterState], None]) -> Callable[[], None]:
        return lambda: None

    def add(self, event: Event) -> None:
        self.log.add(event)
        for listener in self.listeners:
            listener(self.log.envelopes[-1])


def gauge_value(gauge: Gauge, class_name: str, capacity: str) -> float | None:
    for metric in gauge.collect():
        for sample in metric.samples:
            if sample.labels == {"class": class_name, "capacity": capacity}:
                return float(sample.value)
    return None


def test_allocated_ratio_follows_the_state() -> None:
    gauge = Gauge("t_ratio", "test", ["class", "capacity"], registry=CollectorRegistry())
    log = Log(
        DeviceClassApplied(
            device_class=device_class("gpu", f'device.driver == "{DRIVER}"'), rollout="immediate"
        ),
        DeviceClassApplied(
            device_class=device_class("none", 'device.driver == "x"'), rollout="immediate"
        ),
        ResourceSlicePublished(
            slice=rslice(device("gpu-0"), device("gpu-1"), device("gpu-2", shared=False))
        ),
    )
    live = FakeLive(log)
    gauges = CapacityGauges(live, gauge=gauge)  # type: ignore[arg-type]
    gauges.start()
    assert gauge_value(gauge, "gpu", "memory") == 0
    assert gauge_value(gauge, "none", "memory") is None  # selects no device: no series

    live.add(reserve("s1", "20Gi"))
    gauges.refresh()  # what the scheduled flush does on the event loop
    assert gauge_value(gauge, "gpu", "memory") == pytest.approx(20 / 240)
    live.add(reserve("s2", "0", dev="gpu-2", shared=False, claim="other"))
    gauges.refresh()  # a dedicated device counts as fully allocated
    assert gauge_value(gauge, "gpu", "memory") == pytest.approx(100 / 240)
    live.add(release("s1", "20Gi"))
    gauges.refresh()
    assert gauge_value(gauge, "gpu", "memory") == pytest.approx(80 / 240)

    live.add(DeviceClassRemoved(name="gpu"))
    gauges.refresh()
    assert gauge_value(gauge, "gpu", "memory") is None  # a removed class loses its series
    gauges.stop()
    assert live.listeners == []


async def test_changes_are_coalesced_on_the_loop() -> None:
    gauge = Gauge("t_ratio2", "test", ["class", "capacity"], registry=CollectorRegistry())
    log = Log(
        DeviceClassApplied(device_class=device_class("gpu", None), rollout="immediate"),
        ResourceSlicePublished(slice=rslice(device("gpu-0"))),
    )
    live = FakeLive(log)
    gauges = CapacityGauges(live, gauge=gauge)  # type: ignore[arg-type]
    gauges.start()
    before = gauges.refreshes
    for i in range(10):
        live.add(reserve(f"s{i}", "4Gi"))
    live.add(submitted())  # not a capacity event: nothing scheduled for it
    assert gauges.refreshes == before  # nothing recomputed synchronously
    await asyncio.sleep(0)
    assert gauges.refreshes == before + 1
    assert gauge_value(gauge, "gpu", "memory") == pytest.approx(40 / 80)


def test_updates_touch_only_the_changed_devices_and_agree_with_a_recomputation() -> None:
    """Same answers as computing every ratio from scratch (the gauges' rule before they
    kept sums), at the cost of the devices an event touches."""
    gauge = Gauge("t_ratio3", "test", ["class", "capacity"], registry=CollectorRegistry())
    least = policy(min="8Gi", step=None)  # a device left with 4Gi free strands it
    devices = [device(f"gpu-{i}", memory="40Gi", pol=least if i % 2 else None) for i in range(12)]
    log = Log(
        DeviceClassApplied(device_class=device_class("gpu", None), rollout="immediate"),
        DeviceClassApplied(
            device_class=device_class("odd", 'device.attributes["x"].string == "y"'),
            rollout="immediate",
        ),
        ResourceSlicePublished(slice=rslice(*devices, device("solo", shared=False))),
    )
    live = FakeLive(log)
    gauges = CapacityGauges(live, gauge=gauge)  # type: ignore[arg-type]
    gauges.start()
    steps = [reserve(f"s{i}", f"{8 + i // 12 * 4}Gi", dev=f"gpu-{i % 12}") for i in range(30)]
    steps.append(reserve("x", "0", dev="solo", shared=False, claim="other"))
    steps += [
        release(f"s{i}", f"{8 + i // 12 * 4}Gi", dev=f"gpu-{i % 12}") for i in range(0, 30, 4)
    ]
    touched: list[tuple[str, str, str]] = []
    update = gauges._update
    gauges._update = lambda state, key: touched.append(key) or update(state, key)  # type: ignore[method-assign]
    for event in steps:
        live.add(event)  # outside a loop: the update runs at once
        assert touched == [(DRIVER, POOL, getattr(event, "device", ""))]  # the one device
        touched.clear()
        members = class_members(live.state)
        for (cls, capacity), ratio in allocated_ratios(live.state, members).items():
            assert gauge_value(gauge, cls, capacity) == ratio
        for (cls, capacity), ratio in stranded_ratios(live.state, members).items():
            assert gauge_value(metrics.CAPACITY_STRANDED_RATIO, cls, capacity) == ratio
    assert gauges.rebuilds == 1  # from scratch only at the start


def test_initialise_series_creates_zero_samples() -> None:
    initialise_series(["unit-consumer"])
    families = {m.name: m for m in metrics.REGISTRY.collect()}
    for family in ("consumer_redeliveries", "dead_letters", "unconfirmed_messages"):
        samples = families[f"dracap_{family}"].samples
        assert any(s.labels == {"consumer": "unit-consumer"} for s in samples), family
    outcomes = {s.labels.get("outcome") for s in families["dracap_claims"].samples}
    assert set(CLAIM_OUTCOMES) <= outcomes


def test_every_known_label_value_starts_at_zero() -> None:
    """What a service process creates at start: an ``increase()`` over a series that
    appears at 1 reads 0, so the first event of each would raise no alert."""
    initialise_series()
    value = metrics.REGISTRY.get_sample_value
    for outcome in ("returned", "fenced"):  # the node-recovery panel after the first one
        assert value("dracap_node_recovery_seconds_count", {"outcome": outcome}) is not None
    for outcome in ("evaluated", "deadline"):
        assert value("dracap_selector_jobs_total", {"outcome": outcome}) is not None
    for outcome in ("held", "lost"):
        assert value("dracap_lease_renewals_total", {"outcome": outcome}) is not None
    # the registry is the process's: another test may have counted one already
    assert (
        value("dracap_node_requests_total", {"verb": "report", "outcome": "forbidden"}) is not None
    )
    assert value("dracap_kubernetes_mirror_decisions_total", {"outcome": "refused"}) is not None
    assert value("dracap_fence_hook_runs_total", {"outcome": "timeout"}) is not None


def test_every_rejection_reason_of_admission_is_listed() -> None:
    """``dracap_rejections_total{reason}`` starts at 0 for each kind admission refuses
    with; a new kind must join the list."""
    import ast
    import inspect

    from services.claims import admission

    kinds = {
        node.args[1].value
        for node in ast.walk(ast.parse(inspect.getsource(admission)))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "refuse"
        and isinstance(node.args[1], ast.Constant)
    }
    assert kinds and kinds <= set(admission.REJECTION_REASONS)


def test_a_metrics_port_in_use_is_a_setting_error_naming_it() -> None:
    """A busy port is one line from the command (a setting), not a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(metrics.MetricsPortError, match=f"--metrics-port {port} on 127.0.0.1"):
            metrics.start_metrics_server(port, addr="127.0.0.1")
    assert issubclass(metrics.MetricsPortError, SettingsError)  # run_service: one line, exit 2
