"""Contracts of the event log, run against the real PostgreSQL backend.

The contract is written once (:class:`EventStoreContract`); each backend subclasses it
and provides a ``store`` fixture (today: PostgreSQL).
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import msgspec
import pytest

from events import catalog
from events.envelopes import Envelope
from events.fold import apply, fold
from events.state import ClusterState
from events.statecodec import snapshot_decode, snapshot_encode, to_builtins
from services.replay import verify as verifying
from services.runtime.ground.errors import (
    CapacityExceeded,
    CapacityNotPublished,
    ConflictError,
    InvalidEvent,
    map_database_error,
)
from services.runtime.ground.metrics import REGISTRY
from services.runtime.ground.settings import Settings
from services.runtime.ground.waiting import Signal, wait_for
from services.runtime.store.appends import Batch, Metadata
from services.runtime.store.eventstore import CHANNEL, EventStore, connect
from tests.fixtures.polling import until
from tests.integration import sample as s
from tests.integration import scenario
from tests.integration.scenario import put

_T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


async def _count(store: EventStore) -> tuple[int, int]:
    row = await store.pool.fetchrow("SELECT count(*), coalesce(max(position), 0) FROM events")
    assert row is not None
    return row[0], row[1]


class EventStoreContract:
    """Behaviour every event-store backend must show."""

    async def test_append_assigns_versions_and_positions(self, store: EventStore) -> None:
        envs = await store.append(
            "claim:a/x",
            0,
            [s.claim_submitted("a", "x"), catalog.ClaimAdmitted(namespace="a", name="x")],
            actor="t",
        )
        assert [(e.stream_version, e.position) for e in envs] == [(1, 1), (2, 2)]
        read = await store.read_stream("claim:a/x")
        assert [e.event for e in read] == [e.event for e in envs]
        assert await store.stream_version("claim:a/x") == 2

    async def test_concurrent_same_expected_version_one_wins(self, store: EventStore) -> None:
        async def attempt(i: int) -> list[Envelope]:
            return await store.append(
                "claim:a/race",
                0,
                [s.claim_submitted("a", "race"), catalog.ClaimAdmitted(namespace="a", name="race")],
                actor=f"writer-{i}",
            )

        results = await asyncio.gather(*(attempt(i) for i in range(12)), return_exceptions=True)
        wins = [r for r in results if isinstance(r, list)]
        assert len(wins) == 1
        assert all(isinstance(r, ConflictError) for r in results if not isinstance(r, list))
        assert await _count(store) == (2, 2)  # nothing half-written
        assert await store.head() == 2

    async def test_every_append_statement_is_timed_whatever_its_answer(
        self, store: EventStore
    ) -> None:
        def observed() -> tuple[float, float]:
            count = REGISTRY.get_sample_value("dracap_log_append_duration_seconds_count")
            total = REGISTRY.get_sample_value("dracap_log_append_duration_seconds_sum")
            return count or 0.0, total or 0.0

        count, total = observed()
        events = [s.claim_submitted("a", "timed")]
        await store.append("claim:a/timed", 0, events, actor="t")
        with pytest.raises(ConflictError):  # refused: still a statement answered
            await store.append("claim:a/timed", 0, events, actor="t")
        after_count, after_total = observed()
        assert after_count == count + 2
        assert after_total > total

    async def test_tailing_reader_sees_late_commit_in_order(self, store: EventStore) -> None:
        gate, entered = asyncio.Event(), asyncio.Event()

        async def slow_writer() -> None:
            # the append holds the head lock; its transaction stays open: a late commit
            async with store.pool.acquire() as connection, connection.transaction():
                event = catalog.ClaimAdmitted(namespace="a", name="slow")
                await store.append("claim:a/slow", 0, [event], actor="slow", connection=connection)
                entered.set()
                await gate.wait()

        seen: list[int] = []

        async def tail(total: int) -> None:
            last = 0
            while last < total:
                await store.wait_for_new(last, 0.05)
                async for rows in store.read_rows(last, 3):
                    for row in rows:
                        assert row[0] == last + 1, f"reader skipped from {last} to {row[0]}"
                        last = row[0]
                        seen.append(row[0])

        reader = asyncio.create_task(tail(21))
        slow = asyncio.create_task(slow_writer())
        await entered.wait()
        others = [
            asyncio.create_task(
                store.append(
                    f"claim:a/o{i}",
                    0,
                    [
                        catalog.ClaimAdmitted(namespace="a", name=f"o{i}"),
                        catalog.ClaimAdmitted(namespace="a", name=f"o{i}"),
                    ],
                    actor="fast",
                )
            )
            for i in range(10)
        ]
        await asyncio.sleep(0.2)
        assert seen == []  # nobody committed past the open transaction
        gate.set()
        await asyncio.gather(slow, *others)
        await asyncio.wait_for(reader, 10)
        assert seen == list(range(1, 22))
        envs = [e async for e in store.read_all(0, 4)]
        assert envs[0].stream == "claim:a/slow"

    async def test_capacity_exceeded_writes_nothing(self, store: EventStore) -> None:
        await put(store, s.slice_published(devices={"gpu-0": {"memory": "16Gi"}}))
        await put(store, s.reserved(name="c1", consumed="10Gi"))
        before = await _count(store)
        with pytest.raises(CapacityExceeded):
            await put(store, s.reserved(name="c2", consumed="8Gi"))
        assert await _count(store) == before
        allocated = await store.pool.fetchval("SELECT allocated FROM capacity_ledger")
        assert allocated == 10 * 2**30

    async def test_unpublished_device_is_refused(self, store: EventStore) -> None:
        with pytest.raises(CapacityNotPublished):
            await put(store, s.reserved(device="nowhere"))
        assert await _count(store) == (0, 0)

    async def test_second_exclusive_hold_conflicts(self, store: EventStore) -> None:
        await put(store, s.slice_published(devices={"gpu-1": {"memory": "40Gi"}}, shared=False))
        await put(store, s.reserved(name="c1", device="gpu-1", consumed="1Gi", shared=False))
        with pytest.raises(ConflictError):
            await put(store, s.reserved(name="c2", device="gpu-1", consumed="1Gi", shared=False))
        assert await store.pool.fetchval("SELECT count(*) FROM device_holds") == 1

    async def test_bad_input_leaves_log_unchanged(self, store: EventStore) -> None:
        await put(store, s.claim_submitted())
        before = await _count(store)

        class Stranger(msgspec.Struct, frozen=True, tag="x.stranger"):
            name: str

        bad_type: Any = Stranger(name="x")
        bad_payload: Any = catalog.ClaimAdmitted(namespace=1, name="x")  # type: ignore[arg-type]
        bad_quantity: Any = msgspec.structs.replace(s.reserved(), consumed={"memory": "lots"})
        for bad in (bad_type, bad_payload, bad_quantity):
            with pytest.raises(InvalidEvent):
                await store.append("claim:team-a/c1", None, [bad], actor="t")
        with pytest.raises(ConflictError):  # wrong expected version
            await store.append("claim:team-a/c1", 5, [s.claim_submitted()], actor="t")
        with pytest.raises(ConflictError):  # one bad batch sinks the whole append
            await store.append_many(
                [
                    Batch("claim:z/new", 0, [catalog.ClaimAdmitted(namespace="z", name="new")]),
                    Batch("claim:team-a/c1", 0, [s.claim_submitted()]),
                ],
                Metadata(actor="t"),
            )
        assert await _count(store) == before
        assert await store.stream_version("claim:z/new") == 0

    async def test_wait_for_new_times_out_then_wakes(self, store: EventStore) -> None:
        assert await store.wait_for_new(0, 0.05) == 0
        waiter = asyncio.create_task(store.wait_for_new(0, 5))
        await asyncio.sleep(0.05)
        await put(store, s.claim_submitted())
        assert await asyncio.wait_for(waiter, 5) == 1

    async def test_a_signal_ends_a_wait_for_new_without_a_notification(
        self, store: EventStore
    ) -> None:
        head = await store.head()
        offered = Signal()
        waiter = asyncio.create_task(store.wait_for_new(head, 30, wakes=(offered,)))
        await until(lambda: bool(store._waiters), what="the waiter to listen")
        offered.set()  # no append, no NOTIFY: only the signal
        assert await wait_for(waiter, 10) == head
        assert not store._waiters and offered._futures == []
        # set before the wait: it returns at once, whatever the timeout
        assert await wait_for(store.wait_for_new(head, 30, wakes=(Signal(), offered)), 10) == head

    async def test_a_waiter_cancelled_as_its_notification_arrives_ends(
        self, store: EventStore
    ) -> None:
        # A service told to stop while a NOTIFY wakes it must stop: on Python 3.11,
        # asyncio.wait_for returned the notification instead (the cancellation lost),
        # and a killed reservation worker went on running, its test waiting forever.
        head = await store.head()
        waiter = asyncio.create_task(store.wait_for_new(head, 30))
        await until(lambda: bool(store._waiters), what="the waiter to listen")
        store._notified(None, 0, CHANNEL, str(head + 1))  # the listener's callback
        waiter.cancel()  # in the same turn of the loop
        with pytest.raises(asyncio.CancelledError):
            await waiter


class TestPostgresEventStore(EventStoreContract):
    @pytest.fixture
    async def store(self, settings: Settings) -> AsyncIterator[EventStore]:
        async with await EventStore.open(settings) as store:
            yield store


# --- database-level guarantees --------------------------------------------------------------


@pytest.fixture
async def app_connection(settings: Settings) -> AsyncIterator[asyncpg.Connection]:
    connection = await connect(settings)
    try:
        assert await connection.fetchval("SELECT current_user") == "dracap_app"
        yield connection
    finally:
        await connection.close()


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[EventStore]:
    async with await EventStore.open(settings) as store:
        yield store


async def test_direct_sql_over_capacity_is_refused(
    store: EventStore, app_connection: asyncpg.Connection
) -> None:
    await put(store, s.slice_published(devices={"gpu-0": {"memory": "1Gi"}}))
    with pytest.raises(asyncpg.CheckViolationError) as info:
        await app_connection.execute("UPDATE capacity_ledger SET allocated = total + 1")
    assert isinstance(map_database_error(info.value), CapacityExceeded)
    with pytest.raises(asyncpg.CheckViolationError):
        await app_connection.execute("UPDATE capacity_ledger SET allocated = -1")


@pytest.mark.parametrize(
    "sql", ["UPDATE events SET actor = 'evil'", "DELETE FROM events", "TRUNCATE events"]
)
async def test_events_are_append_only(
    store: EventStore, app_connection: asyncpg.Connection, database_url: str, sql: str
) -> None:
    await put(store, s.claim_submitted())
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await app_connection.execute(sql)
    admin = await asyncpg.connect(database_url)  # a superuser: stopped by the trigger
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
            await admin.execute(sql)
        assert await admin.fetchval("SELECT count(*) FROM events") == 1
    finally:
        await admin.close()


# --- replay -----------------------------------------------------------------------------------


async def test_replay_equals_projections_at_every_step(
    store: EventStore, settings: Settings
) -> None:
    """The guards the database derives (0011: there is one append path) match the fold."""
    live = ClusterState()
    recorded: dict[int, dict[str, Any]] = {}

    async def check(envs: list[Envelope]) -> None:
        fold(envs, live)
        recorded[live.position] = to_builtins(live)
        report = await verifying.verify(settings, from_start=True)
        assert report.ok, verifying.summary(report)

    await scenario.run(store, check)
    final = await verifying.verify(settings, from_start=True)
    assert final.ok and final.folded == live.position, verifying.summary(final)

    connection = await connect(settings)  # replay up to p equals the state recorded at p
    try:
        for position, expected in recorded.items():
            state = await verifying.fold_log(
                connection, ClusterState(), verifying.Report(), to_position=position
            )
            assert to_builtins(state) == expected
    finally:
        await connection.close()


async def test_snapshot_plus_tail_equals_full_replay(store: EventStore, settings: Settings) -> None:
    live = ClusterState()
    snapshot_taken = False

    async def step(envs: list[Envelope]) -> None:
        nonlocal snapshot_taken
        fold(envs, live)
        if not snapshot_taken and live.position > 20:
            await store.save_snapshot(live.position, snapshot_encode(live))
            snapshot_taken = True

    await scenario.run(store, step, unit="Mi")  # see test_snapshot_of_large_totals
    snap = await store.load_latest_snapshot()
    assert snap is not None and 20 < snap.position < live.position
    checked = await verifying.verify(settings)  # folds from 0: the snapshot is checked
    assert checked.ok and checked.snapshots == [
        verifying.SnapshotCheck(position=snap.position, outcome="same")
    ]
    full = await verifying.verify(settings, from_start=True)
    assert full.ok and full.folded == live.position
    state = ClusterState()
    async for envelope in store.read_all(0, 7):
        apply(state, envelope)
    assert to_builtins(state) == to_builtins(live)


def test_snapshot_of_large_totals() -> None:
    """Nanos of an 80Gi device exceed 64-bit integers; the snapshot must still round-trip."""
    events: list[catalog.Event] = [
        s.slice_published(devices={"gpu-0": {"memory": "80Gi"}}),
        s.reserved(consumed="20Gi"),
    ]
    state = fold(
        Envelope(
            event_id=str(i),
            stream="x",
            stream_version=i,
            position=i,
            actor="t",
            correlation_id="c",
            recorded_at=_T0,
            schema_version=1,
            event=event,
        )
        for i, event in enumerate(events, start=1)
    )
    assert to_builtins(snapshot_decode(snapshot_encode(state))) == to_builtins(state)


async def test_verify_reports_first_violating_position(
    store: EventStore, settings: Settings, database_url: str
) -> None:
    await put(
        store,
        s.slice_published(devices={"gpu-0": {"memory": "8Gi"}}),
        s.reserved(consumed="1Gi"),
        s.claim_submitted("x", "y"),
    )
    admin = await asyncpg.connect(database_url)
    try:
        await admin.execute('UPDATE held_shares SET amounts = \'{"memory": "2"}\'')
    finally:
        await admin.close()
    report = await verifying.verify(settings, from_start=True)
    assert not report.ok and report.first_violation == 2
    assert "first violating position 2" in verifying.summary(report)


# --- the live state -------------------------------------------------------------------------


async def test_fresh_waits_for_the_tailer_instead_of_reading(
    store: EventStore, settings: Settings
) -> None:
    from services.runtime.store.livestate import SEEN, LiveState

    live = LiveState(store)
    meta = Metadata(actor="test")
    stop = asyncio.Event()
    tailer = asyncio.create_task(live.run(stop, poll_s=5.0))
    other = await EventStore.open(settings)  # another process's store
    try:
        await asyncio.sleep(0.1)  # the tailer listens
        reads = live._reads_started
        [env] = await store.append_many(
            [Batch("claim:t/a", 0, [catalog.ClaimAdmitted(namespace="t", name="a")])], meta
        )
        assert store.committed_head() == env.position  # its own commit, before any NOTIFY
        state = await live.fresh(SEEN)  # folded by the tailer
        assert state.position >= env.position
        assert live._reads_started == reads  # handed over: no read at all
        # another process's commit is announced, and the tailer reads it
        [foreign] = await other.append_many(
            [Batch("claim:t/c", 0, [catalog.ClaimAdmitted(namespace="t", name="c")])], meta
        )
        state = await live.fresh(foreign.position, timeout=5.0)
        assert state.claim("t", "c") is not None
        assert live._reads_started >= reads + 1
    finally:
        stop.set()
        await tailer
        await other.close()
    # without a tailer the caller reads itself
    reads = live._reads_started
    [env] = await store.append_many(
        [Batch("claim:t/b", 0, [catalog.ClaimAdmitted(namespace="t", name="b")])], meta
    )
    state = await live.fresh(env.position)
    assert state.claim("t", "b") is not None
    assert live._reads_started == reads + 1


async def test_a_notification_of_a_head_reached_ends_no_wait(store: EventStore) -> None:
    """A NOTIFY of the head the waiter is at (its own append, taken from the commit
    before the NOTIFY came) is no news: the wait goes on, and the head is not read from
    the database for it; the next append ends the wait."""
    await put(store, s.claim_submitted())
    assert await store.wait_for_new(0, 5) == 1  # listening, the head known
    reads: list[int] = []
    read_head = store._read_head

    async def counted(connection: Any) -> int:
        reads.append(await read_head(connection))
        return reads[-1]

    store._read_head = counted  # type: ignore[method-assign]
    waiter = asyncio.create_task(store.wait_for_new(1, 60))
    await until(lambda: store._waiters, what="the wait to begin")
    [first] = store._waiters
    await store.pool.execute("SELECT pg_notify($1, '1')", CHANNEL)
    await until(first.done, what="the notification")
    await until(lambda: waiter.done() or store._waiters, what="the waiter to go on or end")
    assert not waiter.done() and reads == []
    await put(store, s.claim_submitted())
    assert await asyncio.wait_for(waiter, 30) == 2
    assert reads == []


async def test_a_listener_lost_with_its_server_is_opened_again(
    store: EventStore, postgres_admin_url: str
) -> None:
    await store.wait_for_new(0, 0.01)  # opens the LISTEN connection
    first = store._listener
    assert first is not None
    admin = await asyncpg.connect(postgres_admin_url)
    try:  # what a server restart does to it
        await admin.execute("SELECT pg_terminate_backend($1)", first.get_server_pid())
    finally:
        await admin.close()
    async with asyncio.timeout(30):
        while not first.is_closed():  # noqa: ASYNC110 (asyncpg notices the end by itself)
            await asyncio.sleep(0.02)
    await store.wait_for_new(0, 0.01)
    assert store._listener is not None and store._listener is not first
    assert not store._listener.is_closed()


async def test_a_read_whose_session_is_lost_is_asked_again_on_a_new_one(
    store: EventStore, app_connection: asyncpg.Connection, postgres_admin_url: str
) -> None:
    """What a service reads as it starts (its snapshot, its checkpoint) rides out a
    session lost mid-read, as in a failover, instead of ending the process."""
    database = await app_connection.fetchval("SELECT current_database()")
    admin = await asyncpg.connect(postgres_admin_url)
    try:
        async with app_connection.transaction():
            await app_connection.execute("LOCK TABLE snapshots IN ACCESS EXCLUSIVE MODE")
            read = asyncio.create_task(store.load_latest_snapshot())
            waiting: int | None = None
            async with asyncio.timeout(30):
                while waiting is None:  # the read waits behind the lock: end its session
                    waiting = await admin.fetchval(
                        "SELECT pid FROM pg_stat_activity WHERE datname = $1 "
                        "AND wait_event_type = 'Lock'",
                        database,
                    )
            await admin.execute("SELECT pg_terminate_backend($1)", waiting)
        async with asyncio.timeout(30):
            assert await read is None  # asked again on a new session: no snapshot yet
    finally:
        await admin.close()
