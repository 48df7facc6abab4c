"""``dracap report`` on a recorded log (real PostgreSQL) and on its exported file, and
the Prometheus metrics of the same log agreeing with it.

The log, appended through the event store with the actors the services use: a
DeviceClass and a node's slice, a lease, two tenants' claims admitted, reserved, bound
and applied (Ready), a third claim rejected, then the node's lease expires (its shares
Unknown) and an operator fences it. The report's panels must hold what that log says
(per class, per tenant, per rule), and the command must write a PNG from the database
and from ``dracap replay export``'s file; expected failures are one line.

On that log and more (the node's next lease, a claim waiting for capacity then holding
70 Gi, another released), the services' SLO metrics (a :class:`SloTracker` and the
``dracap_capacity_held`` gauge on a live state) and the report's panels must give the
same figure wherever both give one: decisions per outcome, the count and sum of every
span, each percentile the report draws inside a histogram bucket that holds a span,
node recovery, and what each tenant holds at the end. They once disagreed (a report's
scheduling p99 under 0.37 s where Prometheus said 2.4-10 s; a held panel at 0 for a
tenant holding 70 Gi).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

import pytest

from events import catalog as c
from events import model
from services.cli import main
from services.replay.sources import DatabaseSource, FileSource
from services.report.panels import Panel, Report, build_report
from services.runtime.ground.metrics import REGISTRY
from services.runtime.ground.settings import Settings
from services.runtime.ops.holdings import GAUGE, HeldCapacity
from services.runtime.ops.slos import SloTracker
from services.runtime.store.eventstore import EventStore
from services.runtime.store.livestate import HEAD, LiveState
from tests.integration import sample as s
from tests.integration.scenario import lease, put

pytest.importorskip("matplotlib")
pytestmark = pytest.mark.integration

CLASS = s.DRIVER  # the samples' claims ask for a class named like the driver
NODE = s.POOL
PNG = b"\x89PNG\r\n\x1a\n"


async def _record(store: EventStore) -> None:
    device_class = model.convert(
        {
            "metadata": {"name": CLASS},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{CLASS}"'}}]},
        },
        model.DeviceClass,
    )
    await put(store, c.DeviceClassApplied(device_class=device_class, rollout="immediate"))
    devices = {"gpu-0": {"memory": "80Gi"}, "gpu-1": {"memory": "80Gi"}}
    await put(store, s.slice_published(devices=devices), actor="operator:ops")
    agent = await lease(store, NODE)
    shares = []
    for ns, name, device in (("team-a", "c1", "gpu-0"), ("team-b", "c2", "gpu-1")):
        await put(store, s.claim_submitted(ns, name), actor=f"tenant:{ns}")
        await put(store, c.ClaimAdmitted(namespace=ns, name=name), actor="system:claims")
        r = s.reserved(ns, name, device, "10Gi")
        await put(store, r, s.bound(r), actor="system:reservation-0")
        applied = c.LimitApplied(share_id=r.share_id, node=NODE, level="hard", actual=r.consumed)
        await put(store, applied, actor=agent)
        shares.append(r.share_id)
    await put(store, s.claim_submitted("team-a", "huge"), actor="tenant:team-a")
    rejected = c.ClaimRejected(
        namespace="team-a",
        name="huge",
        field="metadata.namespace",
        rule="namespace 'team-a' may hold at most 2 live claims (quota 2)",
        reason="",
    )
    await put(store, rejected, actor="system:claims")
    await put(store, c.NodeLeaseExpired(node=NODE, epoch=1), actor="system:reclamation")
    for share_id in shares:
        unknown = c.ShareMarkedUnknown(share_id=share_id, node=NODE)
        await put(store, unknown, actor="system:reclamation")
    await put(store, c.NodeFenced(node=NODE, epoch=1, reason="powered off"), actor="operator:ops")


async def _record_more(store: EventStore) -> None:
    """After the fence: the node's next lease; a claim found unschedulable waits for
    capacity, then holds 70 Gi (Ready); another is Ready, then released."""
    agent = await lease(store, NODE)
    await put(store, s.claim_submitted("team-b", "c3"), actor="tenant:team-b")
    await put(store, c.ClaimAdmitted(namespace="team-b", name="c3"), actor="system:claims")
    full = c.ClaimUnschedulable(namespace="team-b", name="c3", reason="no capacity")
    await put(store, full, actor="system:reservation-0")
    for ns, name, device, amount in (
        ("team-b", "c3", "gpu-1", "70Gi"),
        ("team-c", "c4", "gpu-0", "5Gi"),
    ):
        if name == "c4":
            await put(store, s.claim_submitted(ns, name), actor=f"tenant:{ns}")
            await put(store, c.ClaimAdmitted(namespace=ns, name=name), actor="system:claims")
        r = s.reserved(ns, name, device, amount)
        await put(store, r, s.bound(r), actor="system:reservation-0")
        applied = c.LimitApplied(share_id=r.share_id, node=NODE, level="hard", actual=r.consumed)
        await put(store, applied, actor=agent)
    c4 = await store.pool.fetchval(
        "SELECT payload->>'share_id' FROM events WHERE type = 'reservation.capacity_reserved'"
        " AND payload->>'name' = 'c4'"
    )
    ask = c.ReleaseRequested(namespace="team-c", name="c4", allocation_version=1, node=NODE)
    await put(store, ask, actor="tenant:team-c")
    await put(store, c.LimitRemoved(share_id=c4, node=NODE), actor=agent)
    gone = c.CapacityReleased(
        share_id=c4,
        driver=s.DRIVER,
        pool=s.POOL,
        device="gpu-0",
        allocation_version=1,
        consumed={"memory": s.q("5Gi")},
        admin_access=False,
    )
    await put(store, gone, actor=agent)


@pytest.fixture
async def recorded(settings: Settings) -> AsyncIterator[EventStore]:
    async with await EventStore.open(settings) as store:
        await _record(store)
        yield store


async def dracap(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _panel(report: Report, title: str) -> Panel:
    [panel] = [p for p in report.panels if p.title.startswith(title)]
    return panel


def _labels(panel: Panel) -> set[str]:
    return {series.label for series in panel.series if series.times}


async def test_the_panels_hold_what_the_log_says(recorded: EventStore) -> None:
    async with (
        recorded.pool.acquire() as connection,
        DatabaseSource(connection, snapshots=False) as source,
    ):
        report = await build_report(source, buckets=20)
    assert report.events == report.positions[1] == await recorded.head()
    assert _labels(_panel(report, "Capacity allocated")) == {f"{CLASS} memory"}
    held = _panel(report, "Capacity held")
    assert _labels(held) == {f"team-a {CLASS} memory (GiB)", f"team-b {CLASS} memory (GiB)"}
    assert max(max(series.values) for series in held.series) == 10  # GiB per tenant
    assert {"admitted", "rejected", "ready", "failed"} <= _labels(_panel(report, "Claims by"))
    assert _labels(_panel(report, "Rejections by rule")) == {
        "namespace … may hold at most N live claims (quota N)"
    }
    for title in ("Scheduling latency", "Enforcement latency"):
        assert _labels(_panel(report, title)) == {f"{CLASS} p50", f"{CLASS} p99"}, title
    assert _labels(_panel(report, "Convergence")) == {f"{CLASS} p99"}
    unknown = _panel(report, "Unknown shares")
    assert max(unknown.series[0].values) == 2, "both shares were Unknown until the fence"
    assert _labels(_panel(report, "Node recovery")) == {"fenced"}
    ratio = _panel(report, "Rejected or unschedulable")
    assert _labels(ratio) == {CLASS} and max(ratio.series[0].values) > 0
    devices = _panel(report, "Allocated / total per device")
    assert set(devices.bars) == {f"{NODE}/gpu-0 memory of 80Gi", f"{NODE}/gpu-1 memory of 80Gi"}
    assert "failed: 2" in _panel(report, "At the window's end").note


async def test_the_command_writes_a_png_from_the_database_and_from_an_export(
    recorded: EventStore, database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "report.png"
    db = ("--database-url", database_url)
    code, out, err = await dracap(capsys, "report", "--out", str(png), *db)
    assert code == 0, err
    assert "18 panels" in out and png.read_bytes()[:8] == PNG

    log = tmp_path / "log.ndjson"
    code, _, err = await dracap(capsys, "replay", "export", "--out", str(log), *db)
    assert code == 0, err
    from_file = tmp_path / "from-file.png"
    code, out, err = await dracap(capsys, "report", "--out", str(from_file), "--log", str(log))
    assert code == 0, err
    assert from_file.read_bytes()[:8] == PNG
    report = await build_report(FileSource(log), buckets=20)
    assert _labels(_panel(report, "Rejections by rule")), "the file holds the same log"


async def test_expected_failures_are_one_line(
    recorded: EventStore, database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "r.png")
    db = ("--database-url", database_url)
    cases = [
        (("--out", str(tmp_path / "r.jpg"), *db), 2, "must end in .png"),
        (("--out", str(tmp_path / "no" / "r.png"), *db), 2, "does not exist"),
        (("--out", out, "--since", "yesterday", *db), 2, "--since"),
        (("--out", out, "--since", "2099-01-01T00:00:00Z", *db), 2, "no event was recorded"),
        (("--out", out, "--steps", "1", *db), 2, "--steps"),
        (("--out", out, "--log", str(tmp_path / "missing.ndjson")), 2, "missing.ndjson"),
        (("--out", out, "--database-url", "postgresql://u@127.0.0.1:1/x"), 1, "PostgreSQL"),
    ]
    for argv, want, says in cases:
        code, _, err = await dracap(capsys, "report", *argv)
        assert (code, err.count("\n")) == (want, 1), (argv, err)
        assert err.startswith("error: ") and says in err, (argv, err)
        assert "Traceback" not in err
    assert not await asyncio.to_thread(Path(out).exists)


#: each kind of span both give -> the histogram the services export it as
HISTOGRAMS: Final = {
    "scheduling": "dracap_scheduling_latency_seconds",
    "capacity_wait": "dracap_capacity_wait_seconds",
    "convergence": "dracap_claim_convergence_seconds",
}
#: the report's percentile panel of each kind
LATENCY_PANELS: Final = {
    "scheduling": "Scheduling latency",
    "capacity_wait": "Waiting for capacity",
    "convergence": "Convergence",
}


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _metrics() -> Samples:
    """Every sample of the SLO series in this process now, by name and labels."""
    wanted = (*HISTOGRAMS.values(), "dracap_claim_decisions", "dracap_node_recovery_seconds")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in REGISTRY.collect()
        if family.name.startswith(wanted)
        for sample in family.samples
    }


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def _buckets(before: Samples, after: Samples, name: str) -> list[tuple[float, float]]:
    """``(upper bound, spans the log added to that bucket)`` of a histogram for CLASS."""
    les = sorted(
        (float(labels["le"]), labels["le"])
        for key, pairs in after
        if key == f"{name}_bucket" and (labels := dict(pairs)).get("class") == CLASS
    )
    out, below = [], 0.0
    for bound, le in les:
        cumulative = _delta(before, after, f"{name}_bucket", **{"class": CLASS, "le": le})
        out.append((bound, cumulative - below))
        below = cumulative
    return out


async def _agreement(store: EventStore) -> tuple[Report, Samples, Samples, float]:
    """The report of the log, the SLO series before and after a tracker folds it, and what
    the held gauge says team-b holds (bytes)."""
    before = _metrics()
    live = LiveState(store)
    tracker, held = SloTracker(live), HeldCapacity(live)
    tracker.start()
    held.start()
    try:
        await live.fresh(HEAD)
        [gauge] = [f for f in held.collect() if f.name == GAUGE]
        team_b = sum(x.value for x in gauge.samples if x.labels["namespace"] == "team-b")
    finally:
        tracker.stop()
        held.stop()
    after = _metrics()
    async with (
        store.pool.acquire() as connection,
        DatabaseSource(connection, snapshots=False) as source,
    ):
        report = await build_report(source, buckets=20)
    return report, before, after, team_b


async def test_the_metrics_and_the_report_agree_on_one_log(recorded: EventStore) -> None:
    await _record_more(recorded)
    report, before, after, team_b = await _agreement(recorded)

    for outcome in ("admitted", "rejected", "unschedulable"):
        counted = _delta(
            before, after, "dracap_claim_decisions_total", **{"class": CLASS, "outcome": outcome}
        )
        assert counted == report.decisions.get(outcome, {}).get(CLASS, 0), outcome
    assert (
        report.decisions["unschedulable"][CLASS] == 1 and report.decisions["rejected"][CLASS] == 1
    )

    for kind, name in HISTOGRAMS.items():
        labels = {"class": CLASS}
        count = _delta(before, after, f"{name}_count", **labels)
        total = _delta(before, after, f"{name}_sum", **labels)
        spans, seconds = report.spans[kind][CLASS]
        assert count == spans, kind
        assert total == pytest.approx(seconds, rel=1e-9, abs=1e-12), kind
        buckets = _buckets(before, after, name)
        holding = [bound for bound, n in buckets if n]
        for series in _panel(report, LATENCY_PANELS[kind]).series:
            for value in series.values:  # each percentile is a span the histogram holds
                bucket = min(bound for bound, _ in buckets if value <= bound)
                assert bucket in holding, (kind, series.label, value, holding)
    assert report.spans["capacity_wait"][CLASS][0] == 1  # c3 waited, then was allocated

    recovery = _panel(report, "Node recovery")
    [fenced] = [series.values for series in recovery.series if series.label == "fenced"]
    labels = {"outcome": "fenced"}
    assert _delta(before, after, "dracap_node_recovery_seconds_count", **labels) == len(fenced)
    assert _delta(before, after, "dracap_node_recovery_seconds_sum", **labels) == pytest.approx(
        sum(fenced)
    )

    held = _panel(report, "Capacity held")
    [b] = [series for series in held.series if series.label.startswith("team-b ")]
    assert b.values[-1] == team_b / 2**30 == 70  # GiB at the window's end, both ways
    [c_] = [series for series in held.series if series.label.startswith("team-c ")]
    assert c_.values[-1] == 0  # released
