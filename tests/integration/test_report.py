"""``dracap report`` on a recorded log (real PostgreSQL) and on its exported file.

The log, appended through the event store with the actors the services use: a
DeviceClass and a node's slice, a lease, two tenants' claims admitted, reserved, bound
and applied (Ready), a third claim rejected, then the node's lease expires (its shares
Unknown) and an operator fences it. The report's panels must hold what that log says
(per class, per tenant, per rule), and the command must write a PNG from the database
and from ``dracap replay export``'s file; expected failures are one line.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from events import catalog as c
from events import model
from services.cli import main
from services.replay.sources import DatabaseSource, FileSource
from services.report.panels import Panel, Report, build_report
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import EventStore
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
