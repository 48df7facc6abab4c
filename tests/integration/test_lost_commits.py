"""A reader of the log that read an event a failover lost reads what took its position
(``services/runtime/store/continuity.py``; CI, 2026-12-07: a claim of the fault harness
never became Ready after a failover).

The failover is played on one server (``tests/fixtures/lostcommits.py``): a reader reads
an event, the event is taken out of the log, every session ends, and another event is
appended at the same position. A reader that went on from where it was would never read
it: the live state would never fold it, the relay never publish it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
from nats.js import JetStreamContext

from events.subjects import BusNames
from services.runtime.bus.jetstream import connect_bus, ensure_stream
from services.runtime.delivery.relaying import CHECKPOINT, Outgoing, Relay
from services.runtime.ground.metrics import REGISTRY
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import EventStore
from services.runtime.store.livestate import HEAD, LiveState
from tests.fixtures.contexts import handed
from tests.fixtures.lostcommits import admit, end_sessions, lose_last
from tests.fixtures.polling import POLL_S, until
from tests.integration.test_bus import Running
from tests.integration.test_two_relays import stream_ids

WITHIN_S = 30.0


@contextlib.asynccontextmanager
async def _tailing(store: EventStore) -> AsyncIterator[LiveState]:
    live = LiveState(store)
    await live.fresh(HEAD)
    stop = asyncio.Event()
    task = asyncio.create_task(live.run(stop, poll_s=0.2))
    try:
        yield live
    finally:
        stop.set()
        await task


async def test_a_live_state_that_folded_a_lost_event_folds_the_log_again(
    settings: Settings, db: asyncpg.Connection
) -> None:
    async with (
        await EventStore.open(settings) as writer,
        await EventStore.open(settings) as own,
        _tailing(own) as live,
    ):
        await admit(writer, "a")
        # sessions ended with nothing lost: the view compares, finds the log, goes on
        sessions, state, counted = own.sessions, live.state, _divergences()
        await end_sessions(db)
        await until(lambda: own.sessions > sessions, WITHIN_S, "the sessions opened again")
        ghost, _ = await admit(writer, "ghost")
        await until(lambda: live.state.position == ghost, WITHIN_S, "the ghost folded")
        assert ("t", "ghost") in live.state.claims
        assert live.state is state  # not folded again
        assert _divergences() == counted
        await lose_last(db, ghost)
        await end_sessions(db)
        assert (await admit(writer, "b"))[0] == ghost  # the lost event's position
        await until(lambda: ("t", "b") in live.state.claims, WITHIN_S, "b folded")
        assert ("t", "ghost") not in live.state.claims
        assert ("t", "a") in live.state.claims
        assert live.state.position == ghost
        assert await live.stream_version("claim:t/b") == 1
        assert _divergences() == counted + 1
        # and it goes on tailing the log as it is now
        after, _ = await admit(writer, "c")
        await until(lambda: ("t", "c") in live.state.claims, WITHIN_S, "c folded")
        assert live.state.position == after


async def test_a_relay_that_published_a_lost_event_publishes_what_took_its_position(
    settings: Settings, db: asyncpg.Connection, nats_url: str
) -> None:
    async with (
        _stream(nats_url) as (names, js),
        await EventStore.open(settings) as writer,
        await EventStore.open(settings) as own,
    ):
        relay = Relay(handed(own, names, js=js), window=16, idle_poll=0.2)
        async with Running(relay.run):
            _, first = await admit(writer, "a")
            ghost, lost = await admit(writer, "ghost")
            await _until_stored(nats_url, names, [first, lost])
            await lose_last(db, ghost)
            await end_sessions(db)
            position, taken = await admit(writer, "b")
            assert position == ghost
            await _until_stored(nats_url, names, [first, lost, taken])
            _, later = await admit(writer, "c")
            await _until_stored(nats_url, names, [first, lost, taken, later])


class _Held(Relay):
    """A relay whose publishing stops for good once ``hold`` is set: a process that dies
    before it publishes anything more."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hold = asyncio.Event()
        self.held = asyncio.Event()

    async def _publish_window(self, messages: Sequence[Outgoing], events: int) -> None:
        if self.hold.is_set():
            self.held.set()
            await asyncio.Event().wait()
        await super()._publish_window(messages, events)


async def test_a_relay_killed_after_going_back_publishes_what_took_the_lost_position(
    settings: Settings, db: asyncpg.Connection, nats_url: str
) -> None:
    """The relay's stored checkpoint had passed the lost event; going back stores the
    earlier position before it publishes, so the next relay starts there."""
    async with (
        _stream(nats_url) as (names, js),
        await EventStore.open(settings) as writer,
        await EventStore.open(settings) as own,
    ):
        first_relay = _Held(handed(own, names, js=js), window=16, idle_poll=0.2)
        task = asyncio.create_task(first_relay.run(asyncio.Event()))
        try:
            _, first = await admit(writer, "a")
            ghost, lost = await admit(writer, "ghost")
            await _until_stored(nats_url, names, [first, lost])
            await until(lambda: first_relay.saved >= ghost, WITHIN_S, "the checkpoint")
            first_relay.hold.set()
            await lose_last(db, ghost)
            await end_sessions(db)
            position, taken = await admit(writer, "b")
            assert position == ghost
            await until(first_relay.held.is_set, WITHIN_S, "the relay publishing again")
            stored = await db.fetchval(
                "SELECT position FROM consumer_checkpoints WHERE consumer = $1", CHECKPOINT
            )
            assert stored == ghost - 1
        finally:
            task.cancel()  # the process dies before it published b
            with contextlib.suppress(asyncio.CancelledError):
                await task
        async with Running(Relay(handed(own, names, js=js), window=16, idle_poll=0.2).run):
            await _until_stored(nats_url, names, [first, lost, taken])


def _divergences() -> float:
    return REGISTRY.get_sample_value("dracap_log_divergences_total") or 0.0


@contextlib.asynccontextmanager
async def _stream(nats_url: str) -> AsyncIterator[tuple[BusNames, JetStreamContext]]:
    """A stream of its own for the test, deleted after it."""
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:8]}")
    nc, js = await connect_bus(nats_url)
    await ensure_stream(js, names)
    try:
        yield names, js
    finally:
        await js.delete_stream(names.stream)
        await nc.close()


async def _until_stored(nats_url: str, names: BusNames, ids: list[str]) -> None:
    """Until the stream holds exactly ``ids``, in that order."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN_S
    while (stored := await stream_ids(nats_url, names)) != ids:
        assert loop.time() < deadline, f"the stream holds {stored}, not {ids}"
        await asyncio.sleep(POLL_S)
