"""Two relays on one log and one stream: no event published twice or skipped (issue 29,
item 1).

Deployed relays hold a lease, so one publishes at a time
(``tests/integration/test_relay_takeover.py``); this is the case the lease cannot rule
out entirely, two relays publishing at once for a moment (a takeover while the old one's
last window is in flight, a database failover), carried to the end: two relays with no
lease, both publishing the same log. Each has its own store and its own NATS
connection (as two processes would), and appends arrive meanwhile from three stores —
each relay's own (published from memory, the hand-over path) and a third process's
(read from the log). The stream must hold every event of the log exactly once, in the
log's order: each relay publishes in position order, and JetStream drops a second
publish of an event id (``Nats-Msg-Id``) within its duplicate window.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.msg import Msg
from nats.js.api import Header

from events.subjects import BusNames
from services.enforcement.protocol import ConsumerAsk, encode
from services.enforcement.service import EnforcementService
from services.runtime.bus.jetstream import connect_bus, ensure_stream
from services.runtime.delivery.rebuilding import BusKeeper
from services.runtime.delivery.relaying import Relay, outgoing
from services.runtime.ground.errors import RetryableError
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import EventStore
from tests.fixtures.contexts import folded, handed
from tests.fixtures.polling import until
from tests.integration.test_bus import append_burst

BURSTS = 6
PER_BURST = 150


@contextlib.asynccontextmanager
async def _relay(settings: Settings, nats_url: str, names: BusNames) -> AsyncIterator[Relay]:
    """A relay as its own process would run it: own store, own connection, own keeper."""
    store = await EventStore.open(settings)
    nc, js = await connect_bus(nats_url)
    relay = Relay(
        handed(store, names, js=js), window=64, idle_poll=0.2, keeper=BusKeeper(store, js, names)
    )
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        yield relay
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await nc.close()
        await store.close()


async def stream_ids(nats_url: str, names: BusNames) -> list[str]:
    nc, js = await connect_bus(nats_url)
    try:
        info = await js.stream_info(names.stream)
        if not info.state.messages:
            return []
        ids = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            message = await js.get_msg(names.stream, seq)
            ids.append((message.headers or {}).get(Header.MSG_ID.value, ""))
        return ids
    finally:
        await nc.close()


async def log_ids(store: EventStore, names: BusNames) -> list[str]:
    return [
        str(row["event_id"])
        async for page in store.read_rows(0)
        for row in page
        if outgoing(names, row) is not None
    ]


async def test_two_relays_publish_each_event_once_in_order(
    settings: Settings, nats_url: str
) -> None:
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:8]}")
    nc, js = await connect_bus(nats_url)
    await ensure_stream(js, names)
    writer = await EventStore.open(settings)
    try:
        async with (
            _relay(settings, nats_url, names) as first,
            _relay(settings, nats_url, names) as second,
        ):
            stores = [first._store, second._store, writer]
            for _ in range(BURSTS):
                await asyncio.gather(*(append_burst(s, PER_BURST, 25) for s in stores))
            total = BURSTS * PER_BURST * len(stores)
            async with asyncio.timeout(60):
                while min(first.position, second.position) < total:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            stored = await stream_ids(nats_url, names)
            logged = await log_ids(writer, names)
        assert len(logged) == total
        assert len(set(stored)) == len(stored), "an event was published twice"
        assert stored == logged, "the stream holds the log, in order, nothing skipped"
        assert first.published + second.published == total, "each stored by one relay"
    finally:
        await writer.close()
        await js.delete_stream(names.stream)
        await nc.close()


async def test_a_relay_publishes_on_while_its_keepers_check_is_unanswered(
    settings: Settings, nats_url: str
) -> None:
    """JetStream does not answer the keeper's check (as while a clustered stream or
    durable is between two leaders; here a subscriber that swallows the keeper's API
    requests): the check is put off and the relay publishes on. (Each check used to wait
    out the API's timeout and fail the relay's round: nothing was published until the
    check was answered, here never.)"""
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:8]}")
    nc, js = await connect_bus(nats_url)
    await ensure_stream(js, names)
    silent = f"silent{uuid.uuid4().hex[:8]}.API"
    swallowed: list[Msg] = []

    async def swallow(msg: Msg) -> None:
        swallowed.append(msg)  # and no answer

    await nc.subscribe(f"{silent}.>", cb=swallow)
    store = await EventStore.open(settings)
    keeper = BusKeeper(store, nc.jetstream(prefix=silent), names)
    relay = Relay(handed(store, names, js=js), window=64, idle_poll=0.2, keeper=keeper)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        await append_burst(store, 100, 25)
        await until(lambda: relay.position >= 100 or task.done(), 60, "the events published")
        assert not task.done()
        assert swallowed, "the keeper asked"
        assert len(await stream_ids(nats_url, names)) == 100
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await store.close()
        await js.delete_stream(names.stream)
        await nc.close()


async def test_a_node_consumer_check_that_goes_unanswered_is_refused_at_once(
    settings: Settings, nats_url: str
) -> None:
    """The same for the enforcement service's ``consumer`` request (an agent's pull met
    no durable): its ``CONSUMER.INFO`` unanswered, the agent hears "not now" once
    ``ANSWER_WAIT_S`` has passed, not the API's timeout (the agent does not pull while
    it asks)."""
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:8]}")
    nc = await nats.connect(nats_url)
    silent = f"silent{uuid.uuid4().hex[:8]}.API"
    await nc.subscribe(f"{silent}.>", cb=_swallow)
    js = nc.jetstream(prefix=silent)  # nats-py's default timeout: 5 s
    store = await EventStore.open(settings)
    service = EnforcementService(folded(store, names, nc, js))
    try:
        asked = time.monotonic()
        with pytest.raises(RetryableError, match="cannot be made now"):
            await service.consumer("node-x", encode(ConsumerAsk()))
        assert time.monotonic() < asked + 5.0, "it waited out the API's timeout"
    finally:
        await store.close()
        await nc.close()


async def _swallow(msg: Msg) -> None:
    """A JetStream API that never answers."""
