"""Forensic replay against a recorded scenario (real PostgreSQL, no mocks).

The scenario, appended through the event store with the actors the services use:
an inventory, a node lease, three claims of two tenants reserved and bound, one claim
released, then the node's lease expires and an operator fences it (reclamation.md).
The tests run ``dracap replay`` in-process (``services.cli.main`` in a thread) against
the database and against an exported file; the snapshot writer's service mode runs as
its own process, as the deployments run it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from events import catalog as c
from events import model
from events.envelopes import stream_of
from events.eventcodec import encode_payload
from events.state import ClusterState
from services.cli import main
from services.exitcodes import ExitCode
from services.replay.history import state_at
from services.replay.logfile import LogWriter, read_end, read_rows
from services.replay.sources import DatabaseSource
from services.replay.verify import summary, verify
from services.runtime.ground.settings import ServiceKind, Settings
from services.runtime.ops.embedded import free_port
from services.runtime.store.eventstore import EventStore, iter_rows
from services.runtime.store.livestate import HEAD, LiveState
from services.runtime.store.snapshots import SnapshotWriter, load_verified, write_snapshot
from tests.fixtures.clock import FakeClock
from tests.fixtures.logins import login_users
from tests.fixtures.polling import until
from tests.fixtures.services import fresh_database
from tests.integration import sample as s
from tests.integration.scenario import lease, put

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

NODE = s.POOL
TENANT_A = "tenant:alice@team-a"
TENANT_B = "tenant:bob@team-b"
SYSTEM = "system:reservation-0"
OPERATOR = "operator:ops"


class Scenario(msgspec.Struct):
    r1: c.CapacityReserved
    r2: c.CapacityReserved
    r3: c.CapacityReserved
    before_release: int
    after_release: int
    head: int


async def _claim(
    store: EventStore, ns: str, name: str, device: str, amount: str
) -> c.CapacityReserved:
    actor = TENANT_A if ns == "team-a" else TENANT_B
    await put(store, s.claim_submitted(ns, name), actor=actor)
    await put(store, c.ClaimAdmitted(namespace=ns, name=name), actor="system:claims")
    r = s.reserved(ns, name, device, amount)
    await put(store, r, s.bound(r), actor=SYSTEM)
    return r


async def record(store: EventStore) -> Scenario:
    devices = {"gpu-0": {"memory": "80Gi"}, "gpu-1": {"memory": "80Gi"}}
    await put(store, s.slice_published(devices=devices), actor=OPERATOR)
    agent = await lease(store, NODE)
    r1 = await _claim(store, "team-a", "c1", "gpu-0", "10Gi")
    r2 = await _claim(store, "team-b", "c2", "gpu-0", "20Gi")
    r3 = await _claim(store, "team-a", "c3", "gpu-1", "30Gi")
    await put(
        store,
        c.LimitApplied(share_id=r2.share_id, node=NODE, level="hard", actual=dict(r2.consumed)),
        actor=agent,
    )
    await put(
        store,
        c.ReleaseRequested(namespace="team-a", name="c1", allocation_version=1),
        actor=TENANT_A,
    )
    before = await store.head()
    await put(store, s.released(r1), actor="system:reclamation")
    after = await store.head()
    await put(store, c.NodeLeaseExpired(node=NODE, epoch=1), actor="system:reclamation")
    await put(store, c.NodeFenced(node=NODE, epoch=1, reason="powered off"), actor=OPERATOR)
    return Scenario(
        r1=r1, r2=r2, r3=r3, before_release=before, after_release=after, head=await store.head()
    )


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[EventStore]:
    async with await EventStore.open(settings) as store:
        yield store


@pytest.fixture
async def scenario(store: EventStore) -> Scenario:
    return await record(store)


async def dracap(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _json(out: str) -> Any:
    return msgspec.json.decode(out)


async def test_timeline_shows_each_step_with_who_did_it(
    scenario: Scenario, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    db = ("--database-url", database_url)
    code, out, _ = await dracap(
        capsys, "replay", "timeline", scenario.r2.share_id, "-o", "json", *db
    )
    assert code == 0
    steps = _json(out)["steps"]
    assert [(st["type"], st["actor"]) for st in steps] == [
        ("reservation.capacity_reserved", SYSTEM),
        ("reservation.allocation_bound", SYSTEM),
        ("enforcement.limit_applied", f"agent:{NODE}#1"),
        ("reclamation.node_lease_expired", "system:reclamation"),  # names the node only
        ("reclamation.node_fenced", OPERATOR),
    ]
    assert steps[3]["changes"]["state"] == ["ready", "unknown"]
    assert steps[4]["changes"]["state"] == ["unknown", "released"]

    code, out, _ = await dracap(capsys, "replay", "timeline", "team-a/c1", "-o", "json", *db)
    types = [st["type"] for st in _json(out)["steps"]]
    assert types == [
        "claims.submitted",
        "claims.admitted",
        "reservation.capacity_reserved",
        "reservation.allocation_bound",
        "reclamation.release_requested",
        "reclamation.capacity_released",
    ]
    code, out, _ = await dracap(capsys, "replay", "timeline", f"node:{NODE}", *db)
    assert code == 0
    for kind in ("node_lease_acquired", "node_lease_expired", "node_fenced"):
        assert f"reclamation.{kind}" in out
    code, _, err = await dracap(capsys, "replay", "timeline", "no-such-thing", *db)
    assert code == 3 and len(err.strip().splitlines()) == 1


async def test_state_before_and_after_a_release_differ_by_exactly_that_share(
    scenario: Scenario, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    db = ("--database-url", database_url)
    views = []
    for at in (scenario.before_release, scenario.after_release):
        code, out, _ = await dracap(capsys, "replay", "state", "--at", str(at), "-o", "json", *db)
        assert code == 0
        views.append(_json(out))
    before, after = views
    changed_shares = {
        sid for sid in before["shares"] if before["shares"][sid] != after["shares"][sid]
    }
    assert changed_shares == {scenario.r1.share_id}
    assert after["shares"][scenario.r1.share_id]["state"] == "released"
    key = f"{s.DRIVER}/{s.POOL}/gpu-0"
    freed = (
        before["devices"][key]["consumed_nanos"]["memory"]
        - after["devices"][key]["consumed_nanos"]["memory"]
    )
    assert freed == s.q("10Gi").nanos
    others = {k for k in before["devices"] if before["devices"][k] != after["devices"][k]}
    assert others == {key}
    code, out, _ = await dracap(
        capsys,
        "replay",
        "diff",
        str(scenario.before_release),
        str(scenario.after_release),
        "-o",
        "json",
        *db,
    )
    changes = {(ch["section"], ch["key"]) for ch in _json(out)["changes"]}
    assert changes == {
        ("shares", scenario.r1.share_id),
        ("devices", key),
        ("claims", "team-a/c1"),
        ("nodes", NODE),
    }
    code, out, _ = await dracap(capsys, "replay", "state", "--at", "1", "-o", "yaml", *db)
    assert code == 0 and "devices:" in out


async def test_verify_export_import_round_trip_and_a_tampered_file(
    scenario: Scenario,
    database_url: str,
    postgres_admin_url: str,
    migrated_template: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    db = ("--database-url", database_url)
    code, out, _ = await dracap(capsys, "replay", "verify", *db)
    assert code == 0, out
    exported = tmp_path / "log.ndjson"  # checkpoints every 4 events and at the head
    code, out, _ = await dracap(
        capsys, "replay", "export", "--out", str(exported), "--checkpoint-every", "4", *db
    )
    assert code == 0 and f"{scenario.head} events" in out
    marks = [position for position, _ in read_end(exported)[0].checkpoints]
    assert marks == [*range(4, scenario.head, 4), scenario.head]
    code, out, err = await dracap(capsys, "replay", "verify", "--log", str(exported))
    assert code == 0 and "every checkpoint is the fold at its position" in out, (out, err)
    plain = tmp_path / "plain.ndjson"
    code, _, _ = await dracap(
        capsys, "replay", "export", "--out", str(plain), "--checkpoint-every", "0", *db
    )
    assert code == 0 and read_end(plain)[0].checkpoints == []
    for position in range(1, scenario.head + 1):  # before, at and after each checkpoint
        answers = [
            (await dracap(capsys, "replay", "state", "--at", str(position), "-o", "json", *f))[1]
            for f in (("--log", str(exported)), ("--log", str(plain)))
        ]
        assert _json(answers[0]) == _json(answers[1]), position
    code, _, err = await dracap(
        capsys, "replay", "export", "--out", str(plain), "--checkpoint-every", "-1", *db
    )
    assert code == 2 and "--checkpoint-every -1: must be >= 0" in err
    code, from_db, _ = await dracap(capsys, "replay", "state", "--at", "9999", "-o", "json", *db)
    code, from_file, _ = await dracap(
        capsys, "replay", "state", "--at", "9999", "-o", "json", "--log", str(exported)
    )
    assert _json(from_db) == _json(from_file)

    async with fresh_database(postgres_admin_url, migrated_template) as other:
        code, out = await round_trip(capsys, exported, other, tmp_path)
        assert code == 0, out  # the guard rows were rebuilt as the fold says
        code, _, err = await dracap(
            capsys, "replay", "import", str(exported), "--database-url", other
        )
        assert code == 4 and "not empty" in err and len(err.strip().splitlines()) == 1

    tampered = tmp_path / "tampered.ndjson"
    data = exported.read_bytes()
    tampered.write_bytes(data.replace(b'"10Gi"', b'"11Gi"', 1))
    for verb in (("verify",), ("state", "--at", "3"), ("timeline", NODE)):
        code, out, err = await dracap(capsys, "replay", *verb, "--log", str(tampered))
        assert code == 2, (verb, out, err)
        assert "checksum mismatch" in err and len(err.strip().splitlines()) == 1
        assert "Traceback" not in err
    code, _, err = await dracap(capsys, "replay", "verify", "--log", str(tmp_path / "missing"))
    assert code == 2 and len(err.strip().splitlines()) == 1


async def round_trip(
    capsys: pytest.CaptureFixture[str], exported: Path, other: str, tmp_path: Path
) -> tuple[int, str]:
    """Import ``exported`` into the database ``other``, check that exporting it again
    gives the same event lines, and verify it: verify's exit code and output."""
    code, _, err = await dracap(capsys, "replay", "import", str(exported), "--database-url", other)
    assert code == 0, err
    again = tmp_path / "again.ndjson"
    await dracap(capsys, "replay", "export", "--out", str(again), "--database-url", other)
    rows = [r for page in read_rows(exported) for r in page]
    assert rows == [r for page in read_rows(again) for r in page]
    code, out, _ = await dracap(capsys, "replay", "verify", "--database-url", other)
    return code, out


async def _rows(store: EventStore) -> list[Any]:
    async with store.pool.acquire() as connection:
        return [r async for page in iter_rows(connection) for r in page]


async def test_verify_names_an_injected_oversubscription_as_refused(
    scenario: Scenario, store: EventStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = await _rows(store)
    over = s.reserved("team-b", "greedy", "gpu-1", "81Gi")
    bad = list(rows[-1])
    bad[0] = scenario.head + 1
    bad[1] = uuid.uuid4()
    bad[2] = stream_of(over)
    bad[3] = 1
    bad[4] = c.tag_of(over)
    bad[5] = c.schema_version_of(over)
    bad[11] = encode_payload(over)
    path = tmp_path / "injected.ndjson"
    writer = LogWriter(path)
    writer.write([*rows, bad])
    writer.close()
    code, out, _ = await dracap(capsys, "replay", "verify", "--log", str(path))
    assert code == ExitCode.EVENTS_REFUSED  # refused and skipped by every reader, named here
    assert f"REFUSED EVENT at position {scenario.head + 1}: reservation.capacity_reserved" in out
    assert "invariant 'capacity'" in out


async def test_an_export_of_an_older_schema_version_replays(
    store: EventStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await put(store, s.slice_published(), actor=OPERATOR)
    rows = await _rows(store)
    old = msgspec.json.decode(encode_payload(s.reserved("team-a", "old", "gpu-0", "5Gi")))
    del old["shared"], old["policy_version"]  # as schema version 1 wrote it
    v1 = list(rows[0])
    v1[0], v1[1], v1[2], v1[3] = 2, uuid.uuid4(), "device:old", 1
    v1[4], v1[5], v1[11] = "reservation.capacity_reserved", 1, msgspec.json.encode(old)
    path = tmp_path / "v1.ndjson"
    writer = LogWriter(path)
    writer.write([rows[0], v1])
    writer.close()
    code, out, _ = await dracap(
        capsys, "replay", "state", "--at", "2", "-o", "json", "--log", str(path)
    )
    assert code == 0
    shares = _json(out)["shares"]
    assert [(sh["claim"], sh["shared"]) for sh in shares.values()] == [(["team-a", "old"], True)]
    assert next(iter(shares.values()))["policy_version"] == 1  # recorded when replayed


async def test_plot_writes_a_png(
    scenario: Scenario, database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "gpu0.png"
    code, _out, err = await dracap(
        capsys, "replay", "plot", "gpu-0", "--out", str(png), "--database-url", database_url
    )
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = await dracap(
        capsys,
        "replay",
        "plot",
        NODE,
        "--out",
        str(tmp_path / "n.png"),
        "--database-url",
        database_url,
    )
    assert code == 0, err


async def _state_at(store: EventStore, position: int) -> ClusterState:
    async with (
        store.pool.acquire() as connection,
        DatabaseSource(connection, snapshots=False) as source,
    ):
        return await state_at(source, position)


async def test_live_state_starts_from_the_newest_snapshot_that_verifies(
    scenario: Scenario, store: EventStore, settings: Settings
) -> None:
    full = LiveState(store)
    await full.fresh(HEAD)
    # a snapshot at the head, and an older one
    older = await _state_at(store, scenario.before_release)
    await write_snapshot(store.pool, older)
    await write_snapshot(store.pool, full.state)
    started = LiveState(store)
    assert await started.load_snapshot()
    assert started.state.position == scenario.head
    # break the newest one: the older one is used and the result is the same
    await store.pool.execute(
        "UPDATE snapshots SET payload = overlay(payload placing '\\x00'::bytea from 200 for 1)"
        " WHERE position = $1",
        scenario.head,
    )
    restarted = LiveState(store)
    assert await restarted.load_snapshot()
    assert restarted.state.position == scenario.before_release
    await restarted.fresh(HEAD)
    assert restarted.state == full.state
    # a snapshot of another log (same position, other event id) does not verify
    await store.pool.execute(
        "UPDATE snapshots SET payload = overlay(payload placing convert_to($2, 'UTF8')"
        " from 84 for 36) WHERE position = $1",  # the event id in the frame's header
        scenario.before_release,
        str(uuid.uuid4()),
    )
    async with store.pool.acquire() as connection:
        assert await load_verified(connection) is None
    report = await verify(settings)
    assert report.ok, summary(report)
    # pruning keeps the newest three
    await store.pool.execute("DELETE FROM snapshots")
    for at in (2, 3, 4, 5):
        await write_snapshot(store.pool, await _state_at(store, at))
    kept = await store.pool.fetch("SELECT position FROM snapshots ORDER BY position")
    assert [r[0] for r in kept] == [3, 4, 5]


async def test_the_writer_snapshots_every_n_events_as_the_live_state_moves(
    scenario: Scenario, store: EventStore
) -> None:
    live = LiveState(store)
    await live.fresh(HEAD)
    writer = SnapshotWriter(store.pool, lambda: live.state, every_events=5, check_every_s=0.05)
    stop = asyncio.Event()
    tail = asyncio.create_task(live.run(stop))
    task = asyncio.create_task(writer.run(stop))
    try:

        async def newest() -> int:
            return int(
                await store.pool.fetchval("SELECT coalesce(max(position), 0) FROM snapshots")
            )

        deadline = asyncio.get_running_loop().time() + 30
        # a condition, not a sleep: the row is committed before the writer notes it
        while writer.last_position != scenario.head or await newest() != scenario.head:
            assert asyncio.get_running_loop().time() < deadline, "no snapshot written"
            await asyncio.sleep(0.05)
        assert not writer.due()  # nothing folded since the snapshot
    finally:
        stop.set()
        await asyncio.gather(tail, task)
    started = LiveState(store)
    assert await started.load_snapshot()
    assert started.state.position == scenario.head


async def test_the_writer_snapshots_once_its_interval_passed_on_its_clock(
    scenario: Scenario, store: EventStore
) -> None:
    """The ``every_seconds`` rule, with time moved by the test instead of waited for."""
    live = LiveState(store)
    await live.fresh(HEAD)
    clock = FakeClock()
    writer = SnapshotWriter(
        store.pool, lambda: live.state, every_events=10**9, every_seconds=600, clock=clock
    )
    stop = asyncio.Event()
    task = asyncio.create_task(writer.run(stop))
    try:
        await until(lambda: clock.waiting == 1, what="the writer's first check")
        await clock.advance(599)  # a check every second on the way, none due yet
        assert writer.written == 0
        await clock.advance(1)
        await until(lambda: writer.written == 1, what="the snapshot of the interval")
        assert writer.last_position == scenario.head
    finally:
        stop.set()
        await task


async def test_the_writer_snapshots_what_was_folded_when_it_stops(
    scenario: Scenario, store: EventStore
) -> None:
    live = LiveState(store)
    await live.fresh(HEAD)
    writer = SnapshotWriter(store.pool, lambda: live.state, every_events=10**9)
    await write_snapshot(store.pool, live.state)
    stop = asyncio.Event()
    stop.set()  # nothing folded since the snapshot: stopping writes none
    await writer.run(stop)
    assert writer.written == 0
    await put(store, c.ClaimAdmitted(namespace="team-a", name="late"), actor="system:claims")
    await live.fresh(HEAD)
    await writer.run(stop)  # a clean stop: one snapshot of what was folded
    assert writer.written == 1
    newest = await store.pool.fetchval("SELECT max(position) FROM snapshots")
    assert newest == scenario.head + 1 == live.state.position


# --- the writer as a service: `dracap replay snapshot` as its own process ----------------


class SnapshotService:
    """``dracap replay snapshot`` run as the deployments run it, as a member of
    ``dracap_snapshots`` (migration 0010), with its metrics on a free port."""

    def __init__(self, store: EventStore, url: str, tmp: Path) -> None:
        self.store, self.url, self.tmp = store, url, tmp
        self.port = free_port()
        self.process: asyncio.subprocess.Process | None = None

    async def start(self, every_events: int) -> None:
        argv = ["replay", "snapshot", "--every-events", str(every_events)]
        argv += ["--every-minutes", "600", "--metrics-port", str(self.port)]
        env = {**os.environ, "DRACAP_DATABASE_URL_SNAPSHOTS": self.url}
        for name in ("DRACAP_DATABASE_URL", "DRACAP_APP_ROLE"):
            env.pop(name, None)  # its own user, nothing else
        with (self.tmp / "snapshots.log").open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.cli", *argv, "--data-dir", str(self.tmp),
                cwd=ROOT, env=env, stdout=log, stderr=log,
            )  # fmt: skip

    def log(self) -> str:
        return (self.tmp / "snapshots.log").read_text(errors="replace")[-3000:]

    async def newest(self) -> int:
        return int(
            await self.store.pool.fetchval("SELECT coalesce(max(position), 0) FROM snapshots")
        )

    def _scrape(self) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                return str(r.read().decode())
        except OSError:
            return None  # not serving yet

    async def metrics_show(self, *lines: str) -> str:
        """Scrape until every one of ``lines`` is in the page (the process is up)."""
        deadline = asyncio.get_running_loop().time() + 60
        while True:
            assert self.process is not None and self.process.returncode is None, self.log()
            text = await asyncio.to_thread(self._scrape)
            if text is not None and all(line in text.splitlines() for line in lines):
                return text
            assert asyncio.get_running_loop().time() < deadline, f"{lines} never shown\n{text}"
            await asyncio.sleep(0.05)

    async def started(self, count: int) -> None:
        """Wait until the log says ``count`` starts: each folded to the head first (the
        metrics port answers before that fold)."""
        deadline = asyncio.get_running_loop().time() + 60
        path = self.tmp / "snapshots.log"
        while path.read_text(errors="replace").count("snapshot writer started at") < count:
            assert self.process is not None and self.process.returncode is None, self.log()
            assert asyncio.get_running_loop().time() < deadline, self.log()
            await asyncio.sleep(0.05)

    async def logged(self, text: str) -> None:
        """Wait until the process's log holds ``text``."""
        deadline = asyncio.get_running_loop().time() + 120
        path = self.tmp / "snapshots.log"
        while text not in path.read_text(errors="replace"):
            assert self.process is not None and self.process.returncode is None, self.log()
            assert asyncio.get_running_loop().time() < deadline, self.log()
            await asyncio.sleep(0.05)

    async def stop(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            return await self.process.wait()


@pytest.fixture
async def snapshots_user(database_url: str, postgres_admin_url: str) -> AsyncIterator[str]:
    """The URL of a login user of ``dracap_snapshots`` (dropped afterwards)."""
    async with login_users(database_url, postgres_admin_url, [ServiceKind.SNAPSHOTS]) as urls:
        yield urls[ServiceKind.SNAPSHOTS.value]


async def _admit(store: EventStore, count: int) -> None:
    for _ in range(count):
        name = f"late-{uuid.uuid4().hex[:6]}"
        await put(store, c.ClaimAdmitted(namespace="team-a", name=name), actor="system:claims")


async def test_the_snapshot_service_writes_every_n_events_serves_metrics_and_stops_cleanly(
    scenario: Scenario, store: EventStore, snapshots_user: str, tmp_path: Path
) -> None:
    head = scenario.head
    service = SnapshotService(store, snapshots_user, tmp_path)
    await service.start(every_events=5)
    try:
        # the log is more than 5 events past "no snapshot": one at once, at the head
        await service.metrics_show("dracap_snapshots_written_total 1.0")
        assert await service.newest() == head
        await _admit(store, 5)  # 5 more: the next one
        await service.metrics_show(
            "dracap_snapshots_written_total 2.0", f"dracap_snapshot_position {head + 5}.0"
        )
        assert await service.newest() == head + 5
    finally:
        code = await service.stop()
    assert code == ExitCode.OK, service.log()
    assert "snapshot writer stopped" in service.log() and "Traceback" not in service.log()
    # a clean stop snapshots what was folded since the last snapshot: a start after the
    # signal folds nothing
    await _admit(store, 2)
    await service.start(every_events=10**6)  # never due by count
    try:
        # the writer started (it knows the newest snapshot), after the fold to the head
        await service.metrics_show(
            f"dracap_snapshot_position {head + 5}.0", "dracap_snapshots_written_total 0.0"
        )
        await service.started(2)
        # and its snapshot was checked against the log: until then it writes none, not
        # even when it stops (a snapshot is never built on an unchecked one)
        await service.logged("this state started from is the fold of the log")
    finally:
        code = await service.stop()
    assert code == ExitCode.OK, service.log()
    kept = await store.pool.fetch("SELECT position FROM snapshots ORDER BY position")
    assert [r[0] for r in kept] == [head, head + 5, head + 7]
    started = LiveState(store)
    assert await started.load_snapshot()
    assert started.state.position == head + 7


async def test_plot_names_devices_as_devices_prints_them_and_a_class_counts_every_device(
    store: EventStore, database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.replay.history import usage_series

    selector = {"cel": {"expression": f'device.driver == "{s.DRIVER}"'}}
    gpu_class = model.convert(
        {"metadata": {"name": s.DRIVER}, "spec": {"selectors": [selector]}}, model.DeviceClass
    )
    await put(
        store, c.DeviceClassApplied(device_class=gpu_class, rollout="immediate"), actor=OPERATOR
    )
    three = {f"gpu-{i}": {"memory": "80Gi"} for i in range(3)}
    await put(store, s.slice_published(devices=three), actor=OPERATOR)
    other = s.slice_published("node-b-gpus", {"gpu-0": {"memory": "80Gi"}}, pool="node-b")
    await put(store, other, actor=OPERATOR)
    await _claim(store, "team-a", "c1", "gpu-1", "10Gi")  # one device of four holds a share

    async with (
        store.pool.acquire() as connection,
        DatabaseSource(connection, snapshots=False) as source,
    ):
        samples, unit = await usage_series(source, "class", s.DRIVER, "memory")
    assert unit == "GiB" and samples[-1].total == 4 * 80 and samples[-1].by_tenant == {"team-a": 10}

    flags = ("--database-url", database_url)
    png = tmp_path / "one.png"
    code, out, err = await dracap(
        capsys, "replay", "plot", f"{s.POOL}/gpu-1", "--out", str(png), *flags
    )
    assert code == 0, err
    code, out, err = await dracap(capsys, "replay", "plot", "gpu-0", "--out", str(png), *flags)
    assert code == ExitCode.BAD_INPUT and len(err.splitlines()) == 1, err
    assert "ambiguous" in err and f"{s.POOL}/gpu-0" in err and "node-b/gpu-0" in err
    code, out, err = await dracap(capsys, "replay", "timeline", "gpu-0", *flags)
    assert code == ExitCode.BAD_INPUT and "ambiguous" in err

    nowhere = tmp_path / "no" / "such" / "dir" / "x.png"
    code, out, err = await dracap(capsys, "replay", "plot", s.DRIVER, "--out", str(nowhere), *flags)
    assert code == ExitCode.BAD_INPUT and err.count("\n") == 1 and "does not exist" in err
    code, out, err = await dracap(
        capsys, "replay", "import", str(tmp_path / "missing.ndjson"), *flags
    )
    assert code == ExitCode.BAD_INPUT and err.count("\n") == 1 and "no such file" in err

    code, out, err = await dracap(capsys, "replay", "state", "-o", "json", *flags)  # the head
    assert code == 0, err
    assert _json(out)["position"] == await store.head()
