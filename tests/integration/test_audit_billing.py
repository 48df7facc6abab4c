"""The audit and billing subscribers on real PostgreSQL and nats-server.

A recorded scenario (:mod:`tests.integration.scenario`: lifecycles, a rejection,
releases, a duplicate release, an admin share, a node lease expiry and fence, a share
marked unknown and confirmed, a stale fence) goes through the relay to both
subscribers. Shown here:

* killed mid-stream (their task cancelled abruptly, their connection closed, as a dead
  process) and started again, their tables equal the pure functions of the whole log
  (:func:`services.audit.records.build`, :func:`services.billing.usage.apply`) taken in
  one go: nothing lost, nothing twice;
* started again, twice at once (two replicas taking turns on their positions), they
  read nothing twice: every table exactly as it was;
* a tenant's query (tenant subject, ``dracap audit -n`` / ``dracap usage -n``) shows its
  own namespace only, and asking for another namespace is refused naming the field;
* ``usage`` totals equal amount x time the test computes from the events' timestamps;
* ``dracap audit verify`` and ``dracap usage verify`` find every row the ledger's login
  rewrote (issue 24, finding 10), and nothing on untouched tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import datetime
import io
import json
import time
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from events import catalog
from events.envelopes import Envelope
from events.subjects import BusNames
from services.audit.records import build
from services.audit.service import AuditService
from services.billing.service import BillingService
from services.billing.usage import apply
from services.cli import main
from services.runtime.bus.apiclient import ApiClient, ApiError
from services.runtime.bus.jetstream import connect_bus, ensure_stream
from services.runtime.delivery.relaying import Relay
from services.runtime.ground.metrics import REGISTRY
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import EventStore
from tests.fixtures.contexts import handed
from tests.integration import scenario

pytestmark = pytest.mark.integration

GI = 2**30

AUDIT = (
    "SELECT position, seq, event_id::text, type, decision, reason, namespace, claim, request, "
    "share_id, device, node, amounts::text, policy_version, actor, actor_kind, actor_name, "
    "actor_epoch FROM audit_records ORDER BY position, seq"
)
TABLES = {
    "audit_records": AUDIT,
    "audit_shares": (
        "SELECT share_id, namespace, claim, device, node, amounts::text, live "
        "FROM audit_shares ORDER BY share_id"
    ),
    "audit_nodes": "SELECT * FROM audit_nodes ORDER BY node",
    "billing_claims": "SELECT namespace, name, classes::text FROM billing_claims ORDER BY 1, 2",
    "billing_shares": (
        "SELECT share_id, namespace, device_class, node, amounts::text, billed, state, since, "
        "position FROM billing_shares ORDER BY share_id"
    ),
    "billing_nodes": "SELECT * FROM billing_nodes ORDER BY node",
    "billing_usage": "SELECT * FROM billing_usage ORDER BY 1, 2, 3, 4, 5",
}


class Subscribers:
    """Relay, audit and billing over one test's database and stream."""

    def __init__(self, settings: Settings, nats_url: str) -> None:
        self.settings = settings
        self.nats_url = nats_url
        self.names = BusNames(prefix=f"t{uuid.uuid4().hex[:10]}")
        self.stop = asyncio.Event()
        self.stores: list[EventStore] = []
        self.connections: list[Client] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.victims: list[tuple[asyncio.Task[None], Client]] = []

    async def bus(self) -> tuple[Client, JetStreamContext]:
        nc, js = await connect_bus(self.nats_url)
        self.connections.append(nc)
        return nc, js

    async def open_store(self) -> EventStore:
        store = await EventStore.open(self.settings)
        self.stores.append(store)
        return store

    async def start(self) -> None:
        self.store = await self.open_store()
        self.nc, self.js = await self.bus()
        await ensure_stream(self.js, self.names)
        relay = Relay(handed(await self.open_store(), self.names, js=self.js))
        self.tasks.append(asyncio.ensure_future(relay.run(self.stop)))
        await self.start_subscribers()

    async def start_subscribers(self, serve: bool = False) -> None:
        """A fresh audit and billing (new store, new connection: a restarted process)."""
        store = await self.open_store()
        nc, _ = await self.bus()
        for make in (AuditService, BillingService):
            service = make(handed(store, self.names, nc if serve else None))
            task = asyncio.ensure_future(service.run(self.stop))
            self.tasks.append(task)
            self.victims.append((task, nc))

    async def kill_subscribers(self) -> None:
        """Cancel both abruptly and close their connection, as a dead process."""
        for task, nc in self.victims:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            with contextlib.suppress(Exception):
                await nc.close()
        self.victims.clear()

    async def caught_up(self, within: float = 60.0) -> None:
        """Until both projectors have applied the whole log."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            head = await self.store.head()
            rows = await self.store.pool.fetch(
                "SELECT subscriber, position FROM ledger_positions "
                "WHERE subscriber IN ('audit', 'billing')"
            )
            if len(rows) == 2 and all(row[1] >= head for row in rows):
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the subscribers did not catch up")

    async def tables(self) -> dict[str, list[tuple[Any, ...]]]:
        async with self.store.pool.acquire() as connection:
            return {
                name: [tuple(row) for row in await connection.fetch(sql)]
                for name, sql in TABLES.items()
            }

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for nc in self.connections:
            with contextlib.suppress(Exception):
                await nc.close()
        with contextlib.suppress(Exception):
            await self.js.delete_stream(self.names.stream)
        for store in self.stores:
            await store.close()


@pytest.fixture
async def subscribers(settings: Settings, nats_url: str) -> AsyncIterator[Subscribers]:
    running = Subscribers(settings, nats_url)
    try:
        await running.start()
        yield running
    finally:
        await running.close()


async def _log(store: EventStore) -> list[Envelope]:
    return [env async for env in store.read_all()]


async def test_tables_survive_a_kill_mid_stream_and_a_full_redelivery(
    subscribers: Subscribers,
) -> None:
    steps = 0

    async def on_step(envs: list[Envelope]) -> None:
        nonlocal steps
        steps += 1
        if steps == 4:  # mid-stream: some handled, some in flight, the rest to come
            await subscribers.kill_subscribers()
        if steps == 7:
            await subscribers.start_subscribers()

    await scenario.run(subscribers.store, on_step)
    await subscribers.caught_up()
    after_kill = await subscribers.tables()

    log = await _log(subscribers.store)
    expected = build(log, {}, {}, {})
    print("SHARES", after_kill["audit_shares"])
    print(
        "RES",
        [
            (r[0], r[1], r[4], r[6], r[9])
            for r in after_kill["audit_records"]
            if r[4] in ("capacity_reserved", "capacity_released")
        ],
    )
    print(
        "TABLE", [(r[0], r[1], r[4], r[6], r[9]) for r in after_kill["audit_records"] if r[0] > 38]
    )
    print(
        "EXPECTED",
        [
            (r.position, r.seq, r.decision, r.namespace, r.share_id)
            for r in expected.records
            if r.position > 38
        ],
    )
    assert [(r[0], r[1]) for r in after_kill["audit_records"]] == [
        (r.position, r.seq) for r in expected.records
    ]
    assert len(after_kill["audit_records"]) > len(log)  # the fence of node-b: a row per share
    billed = apply(log, {}, {}, {})
    assert sorted(
        (r.namespace, r.device_class, r.capacity, r.hour, r.state, r.unit_seconds)
        for r in billed.usage()
    ) == sorted(tuple(row) for row in after_kill["billing_usage"])

    await subscribers.kill_subscribers()
    await subscribers.start_subscribers()  # two replicas at once: they take turns
    await subscribers.start_subscribers()
    await subscribers.caught_up()
    assert await subscribers.tables() == after_kill


async def test_usage_equals_amount_times_time_and_tenants_see_their_own(
    subscribers: Subscribers, nats_url: str
) -> None:
    await subscribers.kill_subscribers()
    await subscribers.start_subscribers(serve=True)  # with the query endpoints
    flags = ["--nats", nats_url, "--prefix", subscribers.names.prefix]
    deadline = time.monotonic() + 30  # until the query endpoints answer (started above)
    while (await _cli(["usage", "-o", "json", *flags]))[0] != 0:
        assert time.monotonic() < deadline, "the usage endpoint never answered"
        await asyncio.sleep(0.05)
    for output, nothing in (("table", "NAMESPACE"), ("json", "[]"), ("csv", "namespace,")):
        code, out = await _cli(["usage", "-o", output, *flags])  # no usage yet: no error
        assert code == 0 and out.strip().startswith(nothing), out
    at: dict[str, datetime.datetime] = {}

    async def on_step(envs: list[Envelope]) -> None:
        for env in envs:
            event = env.event
            key = type(event).__name__
            if isinstance(event, catalog.CapacityReserved | catalog.CapacityReleased):
                key += ":" + str(getattr(event, "name", None) or event.share_id)
            if isinstance(event, catalog.NodeLeaseExpired | catalog.NodeFenced):
                key += f":{event.node}:{event.epoch}"
            at.setdefault(key, env.recorded_at)

    await scenario.run(subscribers.store, on_step)
    await subscribers.caught_up()
    log = await _log(subscribers.store)
    reserved = {e.event.name: e for e in log if isinstance(e.event, catalog.CapacityReserved)}
    released: dict[str, datetime.datetime] = {}  # the first release counts (then: no-ops)
    for e in log:
        if isinstance(e.event, catalog.CapacityReleased):
            released.setdefault(e.event.share_id, e.recorded_at)

    def seconds(a: datetime.datetime, b: datetime.datetime) -> Decimal:
        return Decimal((b - a) // datetime.timedelta(microseconds=1)) / 10**6

    def t(name: str) -> datetime.datetime:
        return reserved[name].recorded_at

    def rel(name: str) -> datetime.datetime:
        event = reserved[name].event
        assert isinstance(event, catalog.CapacityReserved)
        return released[event.share_id]

    expired_b, fenced_b = at["NodeLeaseExpired:node-b:1"], at["NodeFenced:node-b:1"]
    expired_a = at["NodeLeaseExpired:node-a:3"]
    unknown_c7, confirmed_c7 = at["ShareMarkedUnknown"], at["ShareConfirmed"]
    by_hand = {  # (namespace, state) -> bytes x seconds, from the timestamps above
        ("team-a", "held"): 10 * GI * seconds(t("c1"), rel("c1")),  # the admin share: free
        ("team-c", "held"): 40 * GI * seconds(t("c3"), rel("c3")),
        ("team-f", "held"): 20 * GI * seconds(t("on-b"), expired_b),
        ("team-f", "unknown"): 20 * GI * seconds(expired_b, fenced_b),
        ("team-b", "held"): 30 * GI * seconds(t("c2"), expired_a),
        ("team-g", "held"): 5
        * GI
        * (seconds(t("c7"), unknown_c7) + seconds(confirmed_c7, expired_a)),
        ("team-g", "unknown"): 5 * GI * seconds(unknown_c7, confirmed_c7),
    }
    async with ApiClient.connect(nats_url, subscribers.names.prefix) as api:
        reply = await api.admin("usage.list", {"open": False})
        got: dict[tuple[str, str], Decimal] = {}
        for row in reply["usage"]:
            key = (row["namespace"], row["state"])
            got[key] = got.get(key, Decimal(0)) + Decimal(row["unit_seconds"])
        assert {k: v for k, v in got.items() if v} == {k: v for k, v in by_hand.items() if v}
        counted = REGISTRY.get_sample_value(
            "dracap_usage_unit_seconds_total",
            {"namespace": "team-c", "class": "gpu.example.com", "capacity": "memory"}
            | {"state": "held"},
        )
        assert counted is not None and counted > 0

        for op, rows in (("usage", "usage"), ("audit", "records")):
            mine = (await api.claims("team-a", op, {}))[rows]
            assert mine, op
            assert {row["namespace"] for row in mine} == {"team-a"}, op
            with pytest.raises(ApiError) as refused:
                await api.claims("team-a", op, {"namespace": "team-b"})
            assert (refused.value.code, refused.value.field) == ("invalid", "namespace")
        everyone = (await api.admin("audit.list", {}))["records"]
        assert len({row["namespace"] for row in everyone}) > 2
        newest = (await api.admin("audit.list", {"limit": 3}))["records"]
        assert newest == everyone[-3:]  # the newest, in log order
        device = next(row["device"] for row in everyone if row["device"])
        full = (await api.admin("audit.list", {"device": device}))["records"]
        short = device.split("/", 1)[1]  # POOL/DEVICE, as `dracap devices` prints it
        assert full and (await api.admin("audit.list", {"device": short}))["records"] == full

    code, out = await _cli(["usage", "-o", "csv", *flags])
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert rows and {row["open"] for row in rows} <= {"true", "false"}
    for row in rows:  # plain decimals, as a spreadsheet reads them
        for column in ("amount", "unit_seconds"):
            assert "E" not in row[column] and Decimal(row[column]) >= 0, row
    for command in (["audit", "-n", "team-b"], ["usage", "-n", "team-b"]):
        code, out = await _cli([*command, "-o", "json", *flags])
        assert code == 0, out
        assert {row["namespace"] for row in json.loads(out)} == {"team-b"}
    code, out = await _cli(["audit", "--since", "yesterday", *flags])
    assert code == 2


async def _cli(argv: list[str]) -> tuple[int, str]:
    """``dracap ARGV`` in a thread (it runs its own event loop); its exit code and stdout."""
    import io
    from contextlib import redirect_stdout

    buffer = io.StringIO()

    def run() -> int:
        with redirect_stdout(buffer):
            return main(argv)

    code = await asyncio.to_thread(run)
    return code, buffer.getvalue()


async def test_verify_finds_every_row_rewritten_behind_the_log(
    subscribers: Subscribers, settings: Settings
) -> None:
    async def nothing(envs: list[Envelope]) -> None:
        return None

    await scenario.run(subscribers.store, nothing)
    await subscribers.caught_up()
    flags = ["--database-url", settings.database_url, "-o", "json"]
    for command in ("audit", "usage"):
        code, out = await _cli([command, "verify", *flags])
        assert (code, json.loads(out)) == (0, {"ok": True, "differences": []}), out

    async with subscribers.store.pool.acquire() as connection:
        # as the ledger's login could: another tenant's name on a record, a usage row
        # lowered, a share moved, a record added
        position, seq = await connection.fetchrow(
            "UPDATE audit_records SET namespace = 'team-x' WHERE (position, seq) = "
            "(SELECT position, seq FROM audit_records WHERE namespace = 'team-c' "
            "ORDER BY position LIMIT 1) RETURNING position, seq"
        )
        await connection.execute(
            "INSERT INTO audit_records (position, seq, event_id, recorded_at, type, decision, "
            "actor, actor_kind, actor_name) SELECT position, 99, event_id, recorded_at, type, "
            "decision, actor, actor_kind, actor_name FROM audit_records WHERE seq = 0 LIMIT 1"
        )
        usage = await connection.fetchrow(
            "UPDATE billing_usage SET unit_seconds = unit_seconds / 2 WHERE (namespace, "
            "device_class, capacity, hour, state) = (SELECT namespace, device_class, capacity, "
            "hour, state FROM billing_usage WHERE namespace = 'team-c' LIMIT 1) "
            "RETURNING namespace, state"
        )
        await connection.execute(
            "UPDATE billing_shares SET node = 'node-x' WHERE share_id = "
            "(SELECT min(share_id) FROM billing_shares)"
        )

    code, out = await _cli(["audit", "verify", *flags])
    found = json.loads(out)["differences"]
    assert code == 5
    assert {(d["table"], d["problem"], tuple(d["columns"])) for d in found} == {
        ("audit_records", "differs", ("namespace",)),
        ("audit_records", "extra", ()),
    }
    differs = next(d for d in found if d["problem"] == "differs")
    assert differs["key"] == f"{position}/{seq}"
    assert (differs["expected"], differs["found"]) == (
        {"namespace": "team-c"},
        {"namespace": "team-x"},
    )

    code, out = await _cli(["usage", "verify", *flags])
    found = json.loads(out)["differences"]
    assert code == 5
    assert {(d["table"], d["problem"], tuple(d["columns"])) for d in found} == {
        ("billing_usage", "differs", ("unit_seconds",)),
        ("billing_shares", "differs", ("node",)),
    }
    (lowered,) = [d for d in found if d["table"] == "billing_usage"]
    assert lowered["key"].startswith(f"{usage['namespace']}/")
    assert lowered["key"].endswith(f"/{usage['state']}")
