"""Waiting for the pipeline in integration tests: a state condition, or a quiet bus."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from nats.js import JetStreamContext

from events.state import ClusterState
from events.subjects import BusNames
from services.runtime.store.eventstore import EventStore
from services.runtime.store.livestate import HEAD, LiveState


async def state_reaches(
    view: LiveState, check: Callable[[ClusterState], bool], within: float
) -> None:
    """Fold ``view`` until ``check`` holds; AssertionError after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        if check(await view.fresh(HEAD)):
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError("condition not reached in time")
        await view.store.wait_for_new(view.state.position, min(left, 0.2))


async def bus_idle(
    store: EventStore,
    js: JetStreamContext,
    names: BusNames,
    consumers: Sequence[str],
    within: float,
) -> None:
    """Wait until the relay published the whole log and ``consumers`` acked everything."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        head = await store.head()
        info = await js.stream_info(names.stream)
        busy = info.state.last_seq < head
        for name in consumers:
            ci = await js.consumer_info(names.stream, name)
            busy = busy or bool(ci.num_pending or ci.num_ack_pending)
        if not busy:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the pipeline did not go idle")
