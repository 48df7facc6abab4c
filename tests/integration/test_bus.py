"""The bus against real PostgreSQL and nats-server: relay, consumers, dead letters.

Each test has its own database and its own subject prefix (so its own stream), and
deletes the stream at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, cast

import asyncpg
import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from events import catalog as c
from events.catalog import EVENT_TYPES
from events.envelopes import Envelope, stream_of
from events.eventcodec import decode_envelope, encode_event
from events.subjects import NODE_TAGS, BusNames
from services import durables
from services.runtime.bus.jetstream import Durable, connect_bus, durable_config, ensure_stream
from services.runtime.delivery import consuming, relaying
from services.runtime.delivery.confirming import LogConfirmation
from services.runtime.delivery.consuming import Consumer, take_lock
from services.runtime.delivery.handlers import Handled, HandlerContext
from services.runtime.delivery.highwater import SAVE_CHECKPOINT, HighWaterMark
from services.runtime.delivery.projecting import Projector
from services.runtime.delivery.rebuilding import BusKeeper
from services.runtime.delivery.relaying import Relay, outgoing
from services.runtime.ground.errors import ConflictError, InvalidEvent
from services.runtime.ground.metrics import REGISTRY, RELAY_LAG
from services.runtime.ground.settings import Settings
from services.runtime.ground.waiting import wait_for
from services.runtime.store import livestate
from services.runtime.store.appends import Batch, Cause, Metadata
from services.runtime.store.committing import GroupCommitter
from services.runtime.store.eventstore import EventStore, session_gone
from services.runtime.store.livestate import HEAD, LiveState
from tests.fixtures.contexts import handed
from tests.fixtures.polling import until
from tests.integration.injecting import inject, row
from tests.unit import oldlog


class Bus(msgspec.Struct):
    store: EventStore
    nc: Client
    js: JetStreamContext
    names: BusNames


@pytest.fixture
async def bus(settings: Settings, nats_url: str) -> AsyncIterator[Bus]:
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:8]}")
    nc, js = await connect_bus(nats_url)
    store = await EventStore.open(settings)
    try:
        await ensure_stream(js, names)
        yield Bus(store, nc, js, names)
    finally:
        await js.delete_stream(names.stream)
        await nc.close()
        await store.close()


class Running:
    """A ``run(stop)`` coroutine as a task, stopped (and awaited) on exit."""

    def __init__(self, run: Callable[[asyncio.Event], Awaitable[None]]) -> None:
        self.stop = asyncio.Event()
        self._run = run

    async def __aenter__(self) -> asyncio.Task[None]:
        self.task: asyncio.Task[None] = asyncio.create_task(self._run(self.stop))  # type: ignore[arg-type]
        return self.task

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        async with asyncio.timeout(10):
            await asyncio.wait([self.task])
        if not self.task.cancelled():
            self.task.result()


def access(i: int) -> c.NamespaceAccessSet:
    return c.NamespaceAccessSet(namespace=f"ns-{i}", classes=["*"])


async def append_burst(store: EventStore, count: int, per_append: int = 50) -> None:
    meta = Metadata(actor="test")
    burst = uuid.uuid4().hex[:8]
    for start in range(0, count, per_append):
        events = [access(i) for i in range(start, min(count, start + per_append))]
        await store.append_many([Batch(f"burst:{burst}:{start}", 0, events)], meta)


async def stream_messages(b: Bus, expected: int) -> list[Msg]:
    """Every message of the test's stream, in stream order."""
    info = await b.js.stream_info(b.names.stream)
    assert info.state.messages == expected
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=5.0)
    sub = await b.js.pull_subscribe(b.names.events_subjects, stream=b.names.stream, config=config)
    messages: list[Msg] = []
    while len(messages) < expected:
        messages += await sub.fetch(min(1000, expected - len(messages)), timeout=5)
    await sub.unsubscribe()
    return messages


async def assert_stream_is_the_log(b: Bus) -> None:
    log = [env async for env in b.store.read_all()]
    messages = await stream_messages(b, len(log))
    assert [m.headers and m.headers["Nats-Msg-Id"] for m in messages] == [e.event_id for e in log]
    assert [decode_envelope(m.data) for m in messages] == log
    assert [m.subject for m in messages] == [b.names.event_subject(e) for e in log]


def relay(b: Bus, window: int = 64, js: JetStreamContext | None = None, **kwargs: Any) -> Relay:
    return Relay(handed(b.store, b.names, js=js or b.js), window=window, idle_poll=0.2, **kwargs)


# --- relay ----------------------------------------------------------------------------------


class RecordingJetStream:
    """Delegates to the real context; records how the relay publishes."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self.async_publishes = 0
        self.max_pending = 0

    def __getattr__(self, name: str) -> Any:
        if name == "publish":
            raise AssertionError("the relay must not await one publish per message")
        return getattr(self._js, name)

    async def publish_async(self, *args: Any, **kwargs: Any) -> Any:
        future = await self._js.publish_async(*args, **kwargs)
        self.async_publishes += 1
        self.max_pending = max(self.max_pending, self._js.publish_async_pending())
        return future


async def test_relay_publishes_every_event_once_in_order(bus: Bus) -> None:
    meta = Metadata(actor="test")
    await append_burst(bus.store, 300)
    node_events = [c.LimitRemoved(share_id=f"s-{i}", node="ip-1.zone") for i in range(3)]
    await bus.store.append_many([Batch("node:ip-1.zone", 0, node_events)], meta)
    recording = RecordingJetStream(bus.js)
    r = Relay(
        handed(bus.store, bus.names, js=cast(JetStreamContext, recording)), window=64, idle_poll=0.2
    )
    async with Running(r.run):
        await until(lambda: r.position == 303)
        await append_burst(bus.store, 40)  # the relay wakes on NOTIFY and goes on
        await until(lambda: r.position == 343)
    await assert_stream_is_the_log(bus)
    assert r.published == 343 and r.duplicates == 0
    assert await relay(bus).load_checkpoint() == 343
    # windowed: all 343 went through publish_async, many acks outstanding at once
    assert recording.async_publishes == 343
    assert recording.max_pending > 1
    assert r.windows == 6  # ceil(303 / 64) + 1: one ack round per window, not per message


async def test_relay_hands_over_own_appends_and_reads_the_others(
    bus: Bus, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This process's appends go out from memory; another process's are read; one order.

    The test waits for the relay after each foreign append: a relay that heard of a
    foreign append while one of its own was in flight waits for that one's answer and
    reads both (``EventStore.appends_answered``), which would leave what is handed over
    to the timing.
    """
    monkeypatch.setattr(relaying, "ANSWER_WAIT_S", 60.0)  # however slow the machine is

    class Slow(Relay):  # appends pile up while a window is out: gaps in the hand-over
        async def _publish_window(self, messages: Any, events: int) -> None:
            await asyncio.sleep(0.02)
            await super()._publish_window(messages, events)

    other = await EventStore.open(settings)  # another process, as far as the relay knows
    meta = Metadata(actor="test")
    try:
        r = Slow(handed(bus.store, bus.names, js=bus.js), window=8, idle_poll=0.2)
        async with Running(r.run):
            await until(lambda: r.position == 0 and bus.store.committed_head() is not None)
            for i in range(30):
                store = bus.store if i % 3 else other  # every third append is foreign
                [*_, last] = await store.append_many(
                    [Batch(f"mix:{i}", 0, [access(i), access(i + 1)])], meta
                )
                if store is other:
                    await until(lambda at=last.position: r.position == at)
            await until(lambda: r.position == 60)
    finally:
        await other.close()
    await assert_stream_is_the_log(bus)
    assert r.published == 60 and r.duplicates == 0
    assert r.handed_over == 40  # own appends were handed over, foreign ones read


async def test_an_append_announced_before_it_was_answered_is_handed_over_not_read(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its NOTIFY may reach the process before the append's own answer does: the relay
    and the live view then wait for this process's append in flight, whose commit is
    handed over as it is answered, and read nothing from the log for it."""
    monkeypatch.setattr(relaying, "ANSWER_WAIT_S", 60.0)  # however slow the machine is
    monkeypatch.setattr(livestate, "ANSWER_WAIT_S", 60.0)
    store, gate = bus.store, asyncio.Event()
    write, read_rows = store._write, store.read_rows
    reads: list[int] = []

    async def answered_late(*args: Any) -> Any:
        stored = await write(*args)
        await gate.wait()  # committed (and announced): the answer is held back
        return stored

    def counted(after: int, *args: Any, **kwargs: Any) -> Any:
        reads.append(after)
        return read_rows(after, *args, **kwargs)

    r, live = relay(bus), LiveState(store)
    async with Running(r.run), Running(live.run):
        await until(lambda: live._reads_done == 1 and store.committed_head() is not None)
        store._write = answered_late  # type: ignore[method-assign]
        store.read_rows = counted  # type: ignore[method-assign]
        append = asyncio.create_task(
            store.append_many([Batch("mine:0", 0, [access(0)])], Metadata(actor="test"))
        )
        await until(lambda: store.known_head == 1, what="the NOTIFY before the answer")
        gate.set()
        await append
        await until(lambda: r.position == 1 and live.state.position == 1)
    assert r.handed_over == 1 and live._reads_done == 1 and reads == []


async def test_readers_wait_for_the_appends_announced_not_for_every_one_in_flight(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An append of this process announced before it was answered is waited for, but
    not the other appends in flight with it, which nobody announced: one still on its
    way to the database (here: held before its statement, as one waiting for a
    connection of the pool is) does not hold the relay and the live view once the
    commits up to the head they heard of are handed over. (They
    waited for every append in flight, up to ``ANSWER_WAIT_S``: under load a wait of tens
    of milliseconds on every stage of every claim, issue 25's half-rate tail.)"""
    monkeypatch.setattr(relaying, "ANSWER_WAIT_S", 60.0)  # longer than `until` waits
    monkeypatch.setattr(livestate, "ANSWER_WAIT_S", 60.0)
    store, gate, held = bus.store, asyncio.Event(), asyncio.Event()
    write, read_rows = store._write, store.read_rows
    reads: list[int] = []

    async def slow_or_late(connection: Any, batches: Any, pending: Any) -> Any:
        if batches[0].stream == "slow:0":
            await held.wait()  # not sent yet: on its way to the database
            return await write(connection, batches, pending)
        stored = await write(connection, batches, pending)
        await gate.wait()  # committed (and announced): the answer is held back
        return stored

    def counted(after: int, *args: Any, **kwargs: Any) -> Any:
        reads.append(after)
        return read_rows(after, *args, **kwargs)

    r, live = relay(bus), LiveState(store)
    meta = Metadata(actor="test")
    async with Running(r.run), Running(live.run):
        await until(lambda: live._reads_done == 1 and store.committed_head() is not None)
        store._write = slow_or_late  # type: ignore[method-assign]
        store.read_rows = counted  # type: ignore[method-assign]
        slow = asyncio.create_task(store.append_many([Batch("slow:0", 0, [access(1)])], meta))
        try:
            mine = store.append_many([Batch("mine:0", 0, [access(0)])], meta)
            mine_task = asyncio.create_task(mine)
            await until(lambda: store.known_head == 1, what="the NOTIFY before the answer")
            gate.set()
            await mine_task
            await until(lambda: r.position == 1 and live.state.position == 1, what="handed over")
            assert not slow.done()  # the readers went on while it was still in flight
        finally:
            gate.set()
            held.set()
            await slow
        await until(lambda: r.position == 2 and live.state.position == 2)
    assert r.handed_over == 2 and live._reads_done == 1 and reads == []


async def test_relay_crash_between_acks_and_checkpoint_duplicates_nothing(bus: Bus) -> None:
    class Stalled(Relay):
        async def _save_checkpoint(self, position: int) -> None:
            if position > 100:  # the checkpoint never gets past 100: acks outrun it
                await asyncio.Event().wait()
            await super()._save_checkpoint(position)

    await append_burst(bus.store, 500)
    first = Stalled(handed(bus.store, bus.names, js=bus.js), window=50, idle_poll=0.2)
    task = asyncio.create_task(first.run(asyncio.Event()))
    await until(lambda: first.position == 500)
    task.cancel()  # the process dies: no clean stop, no final checkpoint
    with contextlib.suppress(asyncio.CancelledError):
        await task
    checkpoint = await relay(bus).load_checkpoint()
    assert 0 < checkpoint <= 100 and checkpoint % 50 == 0
    second = relay(bus, window=50)
    async with Running(second.run):
        await until(lambda: second.position == 500)
    # everything past the checkpoint again, each recognised by its Nats-Msg-Id
    assert second.duplicates == 500 - checkpoint
    assert second.published == 0
    await assert_stream_is_the_log(bus)


async def test_relay_killed_in_the_middle_of_a_burst_resumes(bus: Bus) -> None:
    first = relay(bus, window=32)
    async with Running(first.run) as task:
        writer = asyncio.create_task(append_burst(bus.store, 1200, per_append=40))
        await until(lambda: first.windows >= 3)
        task.cancel()  # a kill at an arbitrary point, publishes possibly in flight
        with pytest.raises(asyncio.CancelledError):
            await task
        await writer
    second = relay(bus, window=32)
    async with Running(second.run):
        await until(lambda: second.position == 1200)
    await assert_stream_is_the_log(bus)


async def test_relay_lag_grows_while_the_broker_does_not_answer(bus: Bus, nats_url: str) -> None:
    """The lag is read from the log's head on a timer, not only after a publish: with the
    broker away (here: a connection closed for good) it counts every event unpublished,
    so DracapRelayLag fires."""
    nc, js = await connect_bus(nats_url)
    await nc.close()
    metric = "dracap_relay_lag_events"
    async with Running(relay(bus, js=js).run):
        await append_burst(bus.store, 7, per_append=1)
        head = await bus.store.head()
        await until(lambda: REGISTRY.get_sample_value(metric) == head)
    RELAY_LAG.set(0)  # others of this process read it


# --- the stream rebuilt from the log (services.runtime.delivery.rebuilding)
# ----------------------------


async def reached(store: EventStore, consumer: str, position: int) -> None:
    await store.pool.execute(SAVE_CHECKPOINT, consumer, position)


def keeper(b: Bus, **kwargs: Any) -> BusKeeper:
    return BusKeeper(b.store, b.js, b.names, interval=0.1, **kwargs)


async def publish_log(b: Bus, upto: int) -> None:
    """Publish the log's first ``upto`` events as the relay would (ids, subjects)."""
    async for page in b.store.read_rows(0, batch_size=upto):
        for stored in page[:upto]:
            out = outgoing(b.names, stored)
            headers = {"Nats-Msg-Id": out.event_id}
            await b.js.publish(out.subject, out.data, stream=b.names.stream, headers=headers)
        return


async def test_a_stream_that_lost_its_newest_events_gets_them_again(bus: Bus) -> None:
    """nats-server came back without the messages it had not written to disk: the relay
    finds the stream's last event in the log and publishes what follows it."""
    await append_burst(bus.store, 100)
    first = relay(bus)
    async with Running(first.run):
        await until(lambda: first.position == 100)
    await reached(bus.store, "a-consumer", 50)
    await bus.js.delete_stream(bus.names.stream)
    await ensure_stream(bus.js, bus.names)
    await publish_log(bus, 60)  # what the broker kept
    second = relay(bus, keeper=keeper(bus))
    async with Running(second.run):
        await until(lambda: second.position == 100 and second.published == 40)
    await assert_stream_is_the_log(bus)


async def test_a_deleted_stream_is_created_again_from_what_consumers_need(bus: Bus) -> None:
    await append_burst(bus.store, 80)
    owned = Durable("owned-by-relay", bus.names.events_subjects)
    await reached(bus.store, "slow", 30)
    await reached(bus.store, owned.name, 80)
    r = relay(bus, keeper=keeper(bus, durables=[owned]))
    async with Running(r.run):
        await until(lambda: r.position == 80)
        await bus.js.delete_stream(bus.names.stream)  # the broker lost it
        await append_burst(bus.store, 10)  # the next publish finds no stream
        await until(lambda: r.position == 90 and r.published == 80 + 60)
    # the stream holds the log from the slowest consumer's position on
    log = [env async for env in bus.store.read_all()]
    messages = await stream_messages(bus, 60)
    assert [m.headers and m.headers["Nats-Msg-Id"] for m in messages] == [
        e.event_id for e in log[30:]
    ]
    info = await bus.js.consumer_info(bus.names.stream, owned.name)  # created again too
    assert info.config.filter_subject == bus.names.events_subjects


async def test_the_floor_is_the_lowest_consumer_position_within_max_age(bus: Bus) -> None:
    await append_burst(bus.store, 40)
    await reached(bus.store, "a", 25)
    await reached(bus.store, "b", 12)
    await reached(bus.store, "relay", 40)  # the relay's own position does not count
    assert await keeper(bus).floor(40) == 13
    # an owned durable with no position yet needs everything
    assert await keeper(bus, durables=[Durable("new", ">")]).floor(40) == 1
    # nothing recorded within max_age: the lost stream held none of it either
    assert await keeper(bus, max_age=1e-6).floor(40) == 41


def unread(i: int) -> c.LimitRemoved:
    """An event no durable reads: an agent's report travels under no node."""
    return c.LimitRemoved(share_id=f"share-{i}", node="node-a")


def unread_messages() -> float:
    labels = {"outcome": "unread"}
    return REGISTRY.get_sample_value("dracap_relay_messages_total", labels) or 0.0


async def test_the_relay_publishes_what_a_durable_reads_and_passes_over_the_rest(
    bus: Bus,
) -> None:
    carried = durables.carried(bus.names)
    owned = Durable("owned-by-relay", bus.names.events_subjects)
    meta = Metadata(actor="test")
    counted = unread_messages()
    # read from the log: appended before the relay runs
    await bus.store.append_many([Batch("mixed:1", 0, [access(0), unread(1), unread(2)])], meta)
    r = relay(bus, carried=carried, keeper=keeper(bus, durables=[owned], carried=carried))
    async with Running(r.run):
        await until(lambda: r.position == 3)
        # handed over: appended by the relay's own store while it runs
        await bus.store.append_many([Batch("mixed:2", 0, [access(1), unread(3)])], meta)
        await until(lambda: r.position == 5)
    assert r.handed_over == 2
    log = [env async for env in bus.store.read_all()]
    messages = await stream_messages(bus, 2)
    assert [m.headers and m.headers["Nats-Msg-Id"] for m in messages] == [
        log[0].event_id,
        log[3].event_id,
    ]
    assert (r.published, r.unread) == (2, 3)
    assert unread_messages() - counted == 3
    assert (
        await bus.store.pool.fetchval(
            "SELECT position FROM consumer_checkpoints WHERE consumer = 'relay'"
        )
        == 5
    )  # the checkpoint passes the unread events too
    # the stream's last message is at 4 and the relay at 5: nothing the bus carries lacks
    assert await keeper(bus, durables=[owned], carried=carried).ensure(5, None) is None
    # a broker that lost an event the bus carries after unread ones: published from it
    await bus.store.append_many([Batch("mixed:3", 0, [unread(4), access(2)])], meta)
    assert await keeper(bus, durables=[owned], carried=carried).ensure(7, None) == 7


async def test_the_keeper_reads_only_what_the_log_gained_since_it_found_nothing_lacking(
    bus: Bus,
) -> None:
    carried = durables.carried(bus.names)
    meta = Metadata(actor="test")
    await bus.store.append_many([Batch("mixed:1", 0, [access(0), unread(1), unread(2)])], meta)
    await publish_log(bus, 1)  # the stream holds the carried event, not the two after it
    owned = Durable("owned-by-relay", bus.names.events_subjects)
    k = keeper(bus, durables=[owned], carried=carried)
    reads: list[int] = []
    read_rows = bus.store.read_rows

    def recording(after: int = 0, **kwargs: Any) -> Any:
        reads.append(after)
        return read_rows(after, **kwargs)

    bus.store.read_rows = recording  # type: ignore[method-assign]
    assert await k.ensure(3, None) is None
    assert await k.ensure(3, None) is None  # the same last message: nothing read again
    assert reads == [1]
    await bus.store.append_many([Batch("mixed:2", 0, [unread(3)])], meta)
    assert await k.ensure(4, None) is None
    assert reads == [1, 3]  # only what the log gained
    await bus.store.append_many([Batch("mixed:3", 0, [access(1)])], meta)
    assert await k.ensure(5, None) == 5
    assert reads == [1, 3, 4]
    await publish_log(bus, 2)  # another last message: looked at from it again
    reads.clear()
    assert await k.ensure(5, None) == 5
    assert reads == [2]


async def test_the_events_carried_are_those_a_durable_of_the_bus_is_handed(bus: Bus) -> None:
    """Whether an event is carried agrees with what nats-server delivers to the durables."""
    node = "node-a"
    readers = [*durables.relay_owned(bus.names), durables.agent(bus.names, node)]
    for durable in readers:
        await bus.js.add_consumer(bus.names.stream, durable_config(durable))
    kinds = [(tag, None) for tag in EVENT_TYPES] + [(tag, node) for tag in NODE_TAGS]
    for tag, at in kinds:
        await bus.js.publish(bus.names.subject_of(tag, at), b"{}", stream=bus.names.stream)
    handed: set[str] = set()
    for durable in readers:
        sub = await bus.js.pull_subscribe_bind(durable=durable.name, stream=bus.names.stream)
        pending = (await bus.js.consumer_info(bus.names.stream, durable.name)).num_pending
        while pending:
            taken = await sub.fetch(pending, timeout=5)
            handed |= {m.subject for m in taken}
            pending -= len(taken)
        await sub.unsubscribe()
    carried = durables.carried(bus.names)
    assert {bus.names.subject_of(tag, at) for tag, at in kinds if carried(tag, at)} == handed
    assert bus.names.subject_of("claims.submitted", None) not in handed  # some are not


async def test_wire_form_is_the_envelope(bus: Bus) -> None:
    await append_burst(bus.store, 1)
    [row] = [row async for rows in bus.store.read_rows() for row in rows]
    [env] = [e async for e in bus.store.read_all()]
    fresh = outgoing(bus.names, row)
    assert decode_envelope(fresh.data) == env
    assert msgspec.json.decode(fresh.data) == msgspec.json.decode(encode_event(env))


def test_old_schema_rows_are_published_upcast() -> None:
    import datetime

    v1 = {
        "type": "reservation.capacity_reserved",
        **{"namespace": "team-a", "name": "c1", "allocation_version": 1, "request": "gpu"},
        **{"driver": "d", "pool": "p", "device": "gpu-0", "node": "node-a", "share_id": None},
        **{"admin_access": False, "consumed": {"memory": "1Gi"}},
    }
    when = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    row: tuple[object, ...] = (7, str(uuid.uuid4()), "device:d/p/gpu-0", 1, v1["type"], 1)
    row += ("team-a", "test", "corr", None, when, msgspec.json.encode(v1))
    message = outgoing(BusNames(), cast(Any, row))
    env = decode_envelope(message.data)
    assert env.schema_version == 2 and env.position == 7
    assert isinstance(env.event, c.CapacityReserved)
    assert env.event.shared is False and env.event.share_id  # upcast once, not twice
    assert message.subject == "dracap.ev.reservation._.reservation.capacity_reserved"


# --- consumers ------------------------------------------------------------------------------


def echo_handler(calls: list[tuple[str, int]]) -> Callable[..., Awaitable[Handled]]:
    """Appends one LimitRemoved per event to ``echo:<event id>`` (which must be new)."""

    async def handle(ctx: HandlerContext, env: Envelope) -> Handled:
        calls.append((env.event_id, ctx.delivery))
        assert not ctx.connection.is_in_transaction()  # what it writes goes in Handled
        event = c.LimitRemoved(share_id=env.event_id, node="echo")
        return Handled([Batch(f"echo:{env.event_id}", 0, [event])])

    return handle


def consumer(b: Bus, handler: Any, name: str = "echo", **kwargs: Any) -> Consumer:
    """A consumer of the admin category; ``handler`` None: give ``group_handler=``."""
    options: dict[str, Any] = {"backoff": (0.05,), "poll_interval": 0.2, **kwargs}
    if handler is not None:
        options["handler"] = handler
    options.setdefault("filter_subject", b.names.category_filter("admin"))
    return Consumer(b.store, b.js, b.names, name=name, **options)


async def echoes(store: EventStore) -> list[Envelope]:
    return [e async for e in store.read_all() if e.stream.startswith("echo:")]


def metric(name: str, consumer: str) -> float:
    return REGISTRY.get_sample_value(name, {"consumer": consumer}) or 0.0


async def test_handler_appends_commit_with_the_checkpoint(bus: Bus) -> None:
    await append_burst(bus.store, 20)
    sources = [e async for e in bus.store.read_all()]
    calls: list[tuple[str, int]] = []
    r, k = relay(bus), consumer(bus, echo_handler(calls))
    async with Running(r.run), Running(k.run):
        await until(lambda: k.handled == 20)
    out = await echoes(bus.store)
    assert sorted(e.causation_id or "" for e in out) == sorted(e.event_id for e in sources)
    by_cause = {e.causation_id: e for e in out}
    for src in sources:
        assert by_cause[src.event_id].correlation_id == src.correlation_id
        assert by_cause[src.event_id].actor == "system:echo"
    pool = bus.store.pool
    assert (
        await pool.fetchval("SELECT count(*) FROM processed_messages WHERE consumer = 'echo'") == 20
    )
    checkpoint = "SELECT position FROM consumer_checkpoints WHERE consumer = 'echo'"
    assert await pool.fetchval(checkpoint) == sources[-1].position
    assert calls == [(e.event_id, 1) for e in sources]


async def test_a_failed_transaction_leaves_nothing_and_is_retried(bus: Bus) -> None:
    calls: list[int] = []

    async def handle(ctx: HandlerContext, env: Envelope) -> Handled:
        calls.append(ctx.delivery)
        stale = 0 if ctx.delivery > 1 else 7  # a stale expected version the first time
        event = c.LimitRemoved(share_id=env.event_id, node="echo")
        return Handled([Batch(f"echo:{env.event_id}", stale, [event])])

    await append_burst(bus.store, 1)
    before = metric("dracap_consumer_redeliveries_total", "retry")
    r, k = relay(bus), consumer(bus, handle, name="retry")
    seen: list[tuple[int, int]] = []
    original = k._handle

    async def spying(env: Envelope, delivery: int) -> bool:
        try:
            return await original(env, delivery)
        except ConflictError:
            pool = bus.store.pool
            processed = await pool.fetchval("SELECT count(*) FROM processed_messages")
            checkpoints = await pool.fetchval(
                "SELECT count(*) FROM consumer_checkpoints WHERE consumer = 'retry'"
            )
            seen.append((processed, checkpoints))
            raise

    k._handle = spying  # type: ignore[method-assign]
    async with Running(r.run), Running(k.run):
        await until(lambda: k.handled == 1)
    assert seen == [(0, 0)]  # the conflicting attempt wrote neither row nor checkpoint
    assert calls == [1, 2]
    assert len(await echoes(bus.store)) == 1
    assert metric("dracap_consumer_redeliveries_total", "retry") == before + 1


class LostAck:
    """A message whose ack is lost: the broker redelivers it (as after a crash)."""

    def __init__(self, msg: Msg) -> None:
        self._msg = msg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._msg, name)

    async def ack(self) -> None:
        await self._msg.nak()


async def test_redelivery_and_replay_change_nothing(bus: Bus) -> None:
    await append_burst(bus.store, 1)
    calls: list[tuple[str, int]] = []
    k = consumer(bus, echo_handler(calls), name="redo")
    r = relay(bus)
    async with Running(r.run):
        await until(lambda: r.position == 1)
        sub = await k.subscribe()
        [msg] = await sub.fetch(1, timeout=5)
        await k.process(cast(Msg, LostAck(msg)))  # handled and committed; the ack is lost
        [again] = await sub.fetch(1, timeout=5)
        assert again.metadata.num_delivered == 2
        await k.process(again)
        await sub.unsubscribe()
        # a re-publish of the same envelope past JetStream's dedup (another message id)
        await bus.js.publish(msg.subject, msg.data, headers={"Nats-Msg-Id": "replay"})
        async with Running(k.run):
            await until(lambda: k.skipped == 2)
    assert msg.headers is not None
    first = (msg.headers["Nats-Msg-Id"], 1)
    # the handler runs before the records are checked; nothing of the later runs is kept
    assert calls[0] == first and len(calls) == 3, calls
    assert (k.handled, k.skipped) == (1, 2)
    assert len(await echoes(bus.store)) == 1
    assert await bus.store.head() == 2


async def test_always_failing_handler_is_dead_lettered(bus: Bus) -> None:
    calls: list[int] = []

    async def handle(ctx: HandlerContext, env: Envelope) -> Handled:
        calls.append(ctx.delivery)
        raise RuntimeError("handler bug")

    await append_burst(bus.store, 1)
    [source] = [e async for e in bus.store.read_all()]
    before = metric("dracap_dead_letters_total", "doomed")
    k = consumer(bus, handle, name="doomed", max_deliver=3, backoff=(0.01, 0.02))
    async with Running(relay(bus).run), Running(k.run):
        await until(lambda: k.dead_lettered == 1)
        await asyncio.sleep(0.3)  # terminated: no further delivery comes
    assert calls == [1, 2, 3]
    assert metric("dracap_dead_letters_total", "doomed") == before + 1
    [letter] = await bus.store.read_stream("consumer:doomed")
    assert letter.event == c.MessageDeadLettered(
        consumer="doomed",
        event_id=source.event_id,
        position=source.position,
        deliveries=3,
        reason="RuntimeError: handler bug",
    )
    assert letter.causation_id == source.event_id
    assert letter.correlation_id == source.correlation_id


async def test_an_undecodable_message_whose_logged_event_decodes_is_unconfirmed(bus: Bus) -> None:
    """The log holds that id as an event this consumer reads: the message is not it."""
    await append_burst(bus.store, 1)
    [logged] = [e async for e in bus.store.read_all()]
    k = consumer(bus, echo_handler([]), name="poison")
    subject = f"{bus.names.prefix}.ev.admin._.admin.namespace_access_set"
    await bus.js.publish(subject, b"not json", headers={"Nats-Msg-Id": logged.event_id})
    async with Running(k.run):
        await until(lambda: k.unconfirmed == 1)
    assert k.dead_lettered == 0 and k.refused == 0
    assert await bus.store.read_stream("consumer:poison") == []


async def test_a_refused_event_of_the_log_is_skipped_by_the_relay_and_every_consumer(
    bus: Bus, database_url: str
) -> None:
    """One that does not decode (copied in by the log's owner) is published and skipped,
    never dead-lettered; one the fold refuses is skipped by a consumer with a live view."""
    await append_burst(bus.store, 1)
    head = await inject(
        database_url,
        [
            row(
                2,
                payload=b'{"type": "admin.namespace_access_set", "namespace": 5}',
                type_tag="admin.namespace_access_set",
            ),
            row(3, access(3)),
        ],
    )
    unknown = c.LimitApplied(share_id="nobody's", node="n", level="hard", actual={})
    await bus.store.append_many([Batch("node:n", 0, [unknown])], Metadata(actor="t"))  # refused
    seen: list[int] = []

    async def record(ctx: HandlerContext, env: Envelope) -> Handled:
        seen.append(env.position)
        return Handled([])

    live = LiveState(bus.store)
    k = consumer(bus, record, name="skips")
    agent = consumer(
        bus,
        record,
        name="agent",
        filter_subject=bus.names.category_filter("enforcement"),
        confirmation=LogConfirmation(bus.store, live),
    )
    async with Running(relay(bus).run), Running(live.run), Running(k.run), Running(agent.run):
        await until(lambda: k.handled == 2 and k.refused == 1)
        await until(lambda: agent.refused == 1)
    assert head == 3 and live.state.refused == {2: "undecodable", 4: "invariant"}
    assert sorted(seen) == [1, 3]
    assert k.dead_lettered == agent.dead_lettered == agent.handled == 0
    assert k.unconfirmed == agent.unconfirmed == 0
    assert await bus.store.read_stream("consumer:skips") == []


# --- messages the log does not confirm ------------------------------------------------------


def forgeries(names: BusNames, real: Envelope) -> list[tuple[str, bytes, str]]:
    """(subject, data, Nats-Msg-Id) of messages that imitate ``real`` but are not it."""
    subject = names.event_subject(real)
    never_logged = msgspec.structs.replace(real, event_id=str(uuid.uuid4()), position=10**9)
    other_payload = msgspec.structs.replace(real, event=access(99))
    past_the_head = msgspec.structs.replace(real, position=real.position + 1000)
    out = [  # a fresh Nats-Msg-Id each, or JetStream would drop them as duplicates
        (subject, encode_event(env), str(uuid.uuid4()))
        for env in (never_logged, other_payload, past_the_head)
    ]
    return [*out, (subject, b"not json", str(uuid.uuid4())), (subject, b"{}", "not-a-uuid")]


async def test_messages_the_log_does_not_hold_are_dropped_and_counted(bus: Bus) -> None:
    await append_burst(bus.store, 1)
    [real] = [e async for e in bus.store.read_all()]
    calls: list[tuple[str, int]] = []
    name = "forged"
    k = consumer(bus, echo_handler(calls), name=name)
    before = metric("dracap_unconfirmed_messages_total", name)
    fakes = forgeries(bus.names, real)
    for subject, data, msg_id in fakes:
        await bus.js.publish(subject, data, headers={"Nats-Msg-Id": msg_id})
    async with Running(k.run):
        await until(lambda: k.unconfirmed == len(fakes))
    assert calls == []
    assert metric("dracap_unconfirmed_messages_total", name) - before == len(fakes)
    assert [e async for e in bus.store.read_all()] == [real]  # nothing appended
    count = "SELECT count(*) FROM processed_messages WHERE consumer = $1"
    assert await bus.store.pool.fetchval(count, name) == 0


async def test_the_real_message_still_goes_through_beside_forgeries(bus: Bus) -> None:
    await append_burst(bus.store, 3)
    logged = [e async for e in bus.store.read_all()]
    calls: list[tuple[str, int]] = []
    k = consumer(bus, echo_handler(calls), name="mixed")
    for subject, data, msg_id in forgeries(bus.names, logged[1]):
        await bus.js.publish(subject, data, headers={"Nats-Msg-Id": msg_id})
    async with Running(relay(bus).run), Running(k.run):
        await until(lambda: k.handled == 3 and k.unconfirmed == 5)
    assert sorted(event_id for event_id, _ in calls) == sorted(e.event_id for e in logged)


# --- group commit ---------------------------------------------------------------------------


def echo_group(sizes: list[int], poison: set[int]) -> Callable[..., Awaitable[Handled]]:
    """A group handler: one echo per envelope, each naming its cause; raises on poison.

    ``poison``: log positions, known before the events exist (an event id would be
    known only after the append, when the consumer may already have handled it).
    """

    async def handle(ctx: HandlerContext, envs: list[Envelope]) -> Handled:
        sizes.append(len(envs))
        if poison & {e.position for e in envs}:
            raise RuntimeError("poison in the group")
        batches = [
            Batch(
                f"echo:{env.event_id}",
                0,
                [c.LimitRemoved(share_id=env.event_id, node="echo")],
                [Cause.of(env)],
            )
            for env in envs
        ]
        return Handled(batches)

    return handle


async def test_groups_commit_together_and_a_failing_group_goes_one_by_one(bus: Bus) -> None:
    sizes: list[int] = []
    poison = {75}  # in the second burst: 1-30 the first, 31-60 their echoes, 61-90
    await append_burst(bus.store, 30)
    r = relay(bus)
    k = consumer(bus, None, name="grouped", group_handler=echo_group(sizes, poison), max_deliver=2)
    async with Running(r.run):
        await until(lambda: r.position == 30)
        async with Running(k.run):
            await until(lambda: k.handled == 30)
            assert k.groups >= 1 and max(sizes) > 1  # several messages, one transaction
            await append_burst(bus.store, 30)
            await until(lambda: k.handled == 59 and k.dead_lettered == 1, within=60)
    sources = [e async for e in bus.store.read_all()]
    [bad] = [e for e in sources if e.position in poison]
    echoed = {e.causation_id: e for e in await echoes(bus.store)}
    burst = [e for e in sources if e.stream.startswith("burst:")]
    assert set(echoed) == {e.event_id for e in burst} - {bad.event_id}
    for source in burst:
        if source.event_id != bad.event_id:  # each event names its own cause
            assert echoed[source.event_id].correlation_id == source.correlation_id
    assert 1 in sizes  # the failed group was handled again one message at a time
    [letter] = await bus.store.read_stream("consumer:grouped")
    assert isinstance(letter.event, c.MessageDeadLettered)
    assert letter.event.event_id == bad.event_id


async def test_group_committer_gives_each_caller_its_own_outcome(bus: Bus) -> None:
    committer = GroupCommitter(bus.store, "test")
    await committer.append("gc:stale", 0, [access(0)])

    async def write(i: int) -> object:
        try:
            return await committer.append(f"gc:{i}", 0, [access(i)])
        except ConflictError as exc:
            return exc

    together = await asyncio.gather(*(write(i) for i in range(15)))
    assert all(isinstance(r, list) and len(r) == 1 for r in together), together
    assert committer.groups >= 1  # concurrent callers shared a transaction
    stale = committer.append("gc:stale", 0, [access(99)])  # the stream is at 1: refused
    results = await asyncio.gather(
        *(write(i) for i in range(15, 20)), stale, return_exceptions=True
    )
    assert all(isinstance(r, list) and len(r) == 1 for r in results[:5]), results
    assert isinstance(results[5], ConflictError)
    assert committer.alone >= 1  # the group with the stale write was redone one by one
    assert await bus.store.head() == 21  # nothing half-written, nothing lost
    versions = {e.stream: e.stream_version async for e in bus.store.read_all()}
    assert versions == {"gc:stale": 1, **{f"gc:{i}": 1 for i in range(20)}}
    # writes to one stream never share a group or race in two: each sees the last
    chain = await asyncio.gather(*(committer.append("gc:chain", v, [access(v)]) for v in range(6)))
    assert [envs[0].stream_version for envs in chain] == [1, 2, 3, 4, 5, 6]


async def test_causes_must_match_the_events(bus: Bus) -> None:
    batch = Batch("causes:x", 0, [access(0), access(1)], [Cause("corr", "cause")])
    with pytest.raises(InvalidEvent, match="1 causes for 2 events"):
        await bus.store.append_many([batch], Metadata(actor="test"))
    assert await bus.store.head() == 0


ADVISORY_LOCKS = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


async def test_lock_key_serialises_handlers_across_consumers(bus: Bus) -> None:
    spans: list[tuple[float, float]] = []
    heads: list[int | None] = []

    async def slow(ctx: HandlerContext, envs: list[Envelope]) -> Handled:
        entered = asyncio.get_running_loop().time()
        heads.append(ctx.locked_head)
        await asyncio.sleep(0.15)  # long enough for the other consumer to try to enter
        spans.append((entered, asyncio.get_running_loop().time()))
        return Handled()

    def planner(name: str) -> Consumer:
        return consumer(
            bus,
            None,
            name=name,
            group_handler=slow,
            lock_key=4242,
            max_group=1,
        )

    await append_burst(bus.store, 4)
    first, second = planner("planner-a"), planner("planner-b")  # each gets every event
    async with Running(relay(bus).run), Running(first.run), Running(second.run):
        await until(lambda: first.handled == 4 and second.handled == 4)
        async with bus.store.pool.acquire() as connection:  # idle (taking turns) or asked:
            await wait_for(take_lock(connection, 4242), 20)  # the lock is given back
            assert await connection.fetchval("SELECT pg_advisory_unlock(4242)")
    spans.sort()
    assert len(spans) == 8
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end, spans  # never two handlers inside the lock at once
    # a session lock tells the handler the head it must see; none is left behind
    head = await bus.store.head()
    assert heads == [head] * 8
    assert await bus.store.pool.fetchval(ADVISORY_LOCKS) == 0


async def test_a_kept_lock_tells_a_handler_at_least_its_messages_positions(bus: Bus) -> None:
    """A consumer keeps its ``lock_key`` between groups while others commit: the mark it
    gives the next group's handler covers that group's messages even when the group
    before wrote nothing (else the handler decides on a view without the event and the
    message is acknowledged without its effect: an admitted claim nobody plans)."""
    seen: list[tuple[int | None, list[int]]] = []

    async def plans_nothing(ctx: HandlerContext, envs: list[Envelope]) -> Handled:
        seen.append((ctx.locked_head, [e.position for e in envs]))
        return Handled()

    k = consumer(bus, None, name="planner", group_handler=plans_nothing, lock_key=4444)
    pulled = await k.subscribe()
    async with Running(relay(bus).run):
        await append_burst(bus.store, 1)
        await k.process_group(await pulled.fetch(1, timeout=10))  # takes the lock, keeps it
        await append_burst(bus.store, 1)  # another writer commits while it is kept
        await k.process_group(await pulled.fetch(1, timeout=10))
        await k.let_go()
    assert seen == [(1, [1]), (2, [2])]
    assert k.handled == 2 and await bus.store.pool.fetchval(ADVISORY_LOCKS) == 0


async def test_a_kept_lock_whose_session_died_while_idle_is_let_go_quietly(
    bus: Bus, db: asyncpg.Connection
) -> None:
    """A kept lock's session that dies while idle (its server killed: a failover) is taken
    back by asyncpg's pool at once, which detaches the consumer's handle; letting the
    lock go then finds nothing to unlock (the lock went with the session) and must not
    fail — it ended a reservation worker with a traceback in the fault harness."""

    async def plans_nothing(ctx: HandlerContext, envs: list[Envelope]) -> Handled:
        return Handled()

    k = consumer(bus, None, name="planner", group_handler=plans_nothing, lock_key=4545)
    pulled = await k.subscribe()
    async with Running(relay(bus).run):
        await append_burst(bus.store, 1)
        await k.process_group(await pulled.fetch(1, timeout=10))  # takes the lock, keeps it
        holder = await lock_holder(bus, 4545)
        assert holder is not None and k._held is not None
        kept = k._held.connection
        await db.execute("SELECT pg_terminate_backend($1)", holder)
        await until(lambda: session_gone(kept), what="the pool took the dead session back")
        await k.let_go()  # nothing to unlock, nothing raised
        await append_burst(bus.store, 1)
        await k.process_group(await pulled.fetch(1, timeout=10))  # takes it again
        await k.let_go()
    assert k.handled == 2 and await bus.store.pool.fetchval(ADVISORY_LOCKS) == 0


async def lock_holder(bus: Bus, key: int) -> int | None:
    """The server pid of the session holding advisory lock ``key`` (None: free)."""
    pid: int | None = await bus.store.pool.fetchval(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objid = $1 "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        key,
    )
    return pid


async def test_an_idle_consumer_keeps_its_lock_until_someone_asks_for_it(bus: Bus) -> None:
    """A lone planner takes its lock once, not once per group: idle, it keeps it (two
    statements a claim at low rates, and a round trip on the claim's path, saved) until
    another session asks for it (``take_lock``), which then gets it at once — long
    before the idle bound (60 s here) — and the planner takes it again for its next
    group, with the head of that grant."""
    heads: list[int | None] = []

    async def plans_nothing(ctx: HandlerContext, envs: list[Envelope]) -> Handled:
        heads.append(ctx.locked_head)
        return Handled()

    k = consumer(
        bus, None, name="planner", group_handler=plans_nothing, lock_key=4545, lock_idle=60.0
    )
    async with Running(relay(bus).run), Running(k.run):
        await append_burst(bus.store, 1)
        await until(lambda: k.handled == 1, what="the first message handled")
        holder = await lock_holder(bus, 4545)
        assert holder is not None  # kept after the group
        await asyncio.sleep(0.5)  # a consumer that let go when idle would have by now
        assert await lock_holder(bus, 4545) == holder
        async with bus.store.pool.acquire() as connection:
            head, waited = await wait_for(take_lock(connection, 4545), 20)
            assert waited
            # the session it let go of is the pool's again: a request from it is another's
            assert k._lock_pid is None
            assert await lock_holder(bus, 4545) == connection.get_server_pid()
            await append_burst(bus.store, 1)  # handled only once the lock is free again
            await asyncio.sleep(0.5)
            assert k.handled == 1
            assert await connection.fetchval("SELECT pg_advisory_unlock(4545)")
        await until(lambda: k.handled == 2, what="the second message handled")
    assert head == 1 and heads == [1, 2]
    assert await bus.store.pool.fetchval(ADVISORY_LOCKS) == 0


@pytest.mark.parametrize("lock_shared", [consuming.LOCK_SHARED_S, 0.0])
async def test_a_consumer_that_had_to_wait_for_its_lock_lets_it_go_when_idle(
    bus: Bus, lock_shared: float
) -> None:
    """A consumer that found the lock taken (another taker: workers that take turns)
    lets it go whenever it is idle for ``lock_shared`` seconds after, as before: each turn
    a grant and a release, not a request and a wait. With ``lock_shared`` 0 it keeps it:
    its own announcement that it waits, heard once it is granted, does not count as
    someone asking."""
    k = consumer(
        bus,
        None,
        name="planner",
        group_handler=echo_group([], set()),
        lock_key=4646,
        lock_idle=60.0,
        lock_shared=lock_shared,
    )
    async with bus.store.pool.acquire() as other:
        assert await other.fetchval("SELECT pg_try_advisory_lock(4646)")
        async with Running(relay(bus).run), Running(k.run):
            await append_burst(bus.store, 1)
            waiting = 0
            for _ in range(1500):  # the consumer's session queued for the lock (30 s at most)
                waiting = await bus.store.pool.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                    "AND NOT granted AND objid = 4646"
                )
                if waiting:
                    break
                await asyncio.sleep(0.02)
            assert waiting and k.handled == 0
            assert await other.fetchval("SELECT pg_advisory_unlock(4646)")
            await until(lambda: k.handled == 1, what="the message handled")
            if lock_shared:
                for _ in range(400):  # idle, it lets go (the test consumer polls at 0.2 s)
                    if await lock_holder(bus, 4646) is None:
                        break
                    await asyncio.sleep(0.05)
                assert await lock_holder(bus, 4646) is None
            else:
                holder = await lock_holder(bus, 4646)
                assert holder is not None and holder == k._lock_pid
                await asyncio.sleep(0.5)  # its own request, heard, would have let it go
                assert await lock_holder(bus, 4646) == holder
    assert await bus.store.pool.fetchval(ADVISORY_LOCKS) == 0


async def test_a_group_commits_records_and_events_together(bus: Bus) -> None:
    sizes: list[int] = []
    await append_burst(bus.store, 40)
    r = relay(bus)
    k = consumer(bus, None, name="single", group_handler=echo_group(sizes, set()))
    async with Running(r.run):
        await until(lambda: r.position == 40)
        async with Running(k.run):
            await until(lambda: k.handled == 40)
    assert max(sizes) > 1  # groups of several messages, each group one statement
    sources = [e async for e in bus.store.read_all() if e.stream.startswith("burst:")]
    echoed = {e.causation_id for e in await echoes(bus.store)}
    assert echoed == {e.event_id for e in sources}
    recorded = await bus.store.pool.fetchval(
        "SELECT count(*) FROM processed_messages WHERE consumer = 'single'"
    )
    assert recorded == 40


async def test_the_lock_goes_with_a_cancelled_handler(bus: Bus) -> None:
    entered = asyncio.Event()

    async def stuck(ctx: HandlerContext, envs: list[Envelope]) -> Handled:
        entered.set()
        await asyncio.sleep(60)
        return Handled()

    await append_burst(bus.store, 1)
    k = consumer(bus, None, name="stuck", group_handler=stuck, lock_key=4343)
    async with Running(relay(bus).run):
        task = asyncio.create_task(k.run(asyncio.Event()))
        await asyncio.wait_for(entered.wait(), 10)
        assert await bus.store.pool.fetchval(ADVISORY_LOCKS) == 1
        task.cancel()  # a killed worker: its session (and lock) must not go back to the pool
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for _ in range(50):
        if await bus.store.pool.fetchval(ADVISORY_LOCKS) == 0:
            break
        await asyncio.sleep(0.05)
    assert await bus.store.pool.fetchval(ADVISORY_LOCKS) == 0
    async with bus.store.pool.acquire() as connection:  # free for the next taker
        assert await connection.fetchval("SELECT pg_try_advisory_lock(4343)")
        assert await connection.fetchval("SELECT pg_advisory_unlock(4343)")


async def test_high_water_mark_stores_at_most_once_per_interval(bus: Bus) -> None:
    stored: list[int] = []

    async def save(position: int) -> None:
        stored.append(position)

    mark = HighWaterMark(bus.store, "hwm", save=save, interval=0.1)
    done = asyncio.Event()
    keeper = asyncio.create_task(mark.run(done))
    started = asyncio.get_running_loop().time()
    for position in range(1, 301):  # 300 advances, a millisecond or more apart
        mark.advance(position)
        await asyncio.sleep(0.001)
    elapsed = asyncio.get_running_loop().time() - started
    done.set()
    await keeper
    assert stored == sorted(stored) and stored[-1] == 300  # the last one on the way out
    assert 2 <= len(stored) <= elapsed / 0.1 + 2, (stored, elapsed)  # not one per advance


async def test_a_server_outage_does_not_count_towards_dead_lettering(bus: Bus) -> None:
    await append_burst(bus.store, 1)
    outages: list[int] = []

    async def handle(ctx: HandlerContext, env: Envelope) -> Handled:
        outages.append(ctx.delivery)
        if len(outages) <= 5:  # longer than max_deliver: the database "restarting"
            raise ConnectionRefusedError("the server is restarting")
        return Handled([Batch(f"echo:{env.event_id}", 0, [c.LimitRemoved(share_id="s", node="n")])])

    k = consumer(bus, handle, name="outage", max_deliver=2)
    async with Running(relay(bus).run), Running(k.run):
        await until(lambda: k.handled == 1, within=60)
    assert k.dead_lettered == 0
    assert outages == [1] * 6  # no try lost to the outage counted as a delivery


# --- projectors (audit, billing) ---------------------------------------------------------------


async def test_a_projector_dead_letters_an_event_it_cannot_handle_and_goes_on(
    bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """An event the subscriber's functions fail on (not an outage) is given up after its
    tries: the projector finds it in its window, moves past it alone, counts it and names
    it in one line, no traceback; every other event is applied."""
    await append_burst(bus.store, 30, per_append=10)
    head = await bus.store.head()
    log = [env async for env in bus.store.read_all()]
    poison = log[12]
    applied: list[int] = []

    async def apply(_connection: object, envs: Sequence[Envelope]) -> None:
        if any(e.event_id == poison.event_id for e in envs):
            raise ValueError("a payload this subscriber does not expect")
        applied.extend(e.position for e in envs)

    name = f"probe-{uuid.uuid4().hex[:8]}"
    projector = Projector(bus.store, name, apply, batch=8, retry_s=0.01, poll_s=0.05, max_tries=3)
    dead = {"consumer": name}
    assert REGISTRY.get_sample_value("dracap_dead_letters_total", dead) == 0  # from the start
    caplog.set_level(logging.INFO, logger="dracap.projecting")
    async with Running(projector.run):
        await until(lambda: projector.position >= head)
    assert projector.dead_lettered == 1
    assert REGISTRY.get_sample_value("dracap_dead_letters_total", dead) == 1
    assert applied == [e.position for e in log if e.event_id != poison.event_id]
    lines = [r for r in caplog.records if r.name == "dracap.projecting"]
    assert all(r.exc_info is None for r in lines)
    (letter,) = [r.getMessage() for r in lines if r.levelno == logging.ERROR]
    assert poison.event_id in letter and f"position {poison.position}" in letter


# --- the confirmation window ------------------------------------------------------------------


class CountingStore(EventStore):
    """The real store, counting the reads confirmation makes."""

    reads = 0

    async def read_positions(self, positions: Any) -> list[Envelope]:
        self.reads += 1
        return await super().read_positions(positions)


async def test_the_confirmation_window_holds_no_tenant_payload_and_still_confirms_it(
    settings: Settings,
) -> None:
    """A consumer's window of folded envelopes answers small events without a query,
    but keeps no manifest and no allocation with its configuration: those (tenant-sized)
    are confirmed by reading the log, and confirmed all the same."""
    store = await CountingStore.open(settings)
    try:
        live = LiveState(store)
        confirmation = LogConfirmation(store, live)
        for event in oldlog.events():
            await store.append(stream_of(event), None, [event], actor="system:test")
        await live.fresh(HEAD)
        logged = [env async for env in store.read_all()]
        heavy = [
            e
            for e in logged
            if isinstance(e.event, c.ClaimSubmitted)
            or (isinstance(e.event, c.AllocationBound) and e.event.name == "tuned")
        ]
        light = [e for e in logged if e not in heavy]
        assert len(heavy) == 5 and light
        assert await confirmation.confirm(light) == [True] * len(light)
        assert store.reads == 0  # the window answered
        assert await confirmation.confirm(heavy) == [True] * len(heavy)
        assert store.reads == 1  # one query for the group
        forged = msgspec.structs.replace(heavy[0], correlation_id="forged")
        assert await confirmation.confirm([forged]) == [False]
    finally:
        await store.close()
