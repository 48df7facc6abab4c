"""The test clock: nothing passes until advanced, then what came due runs in order."""

from __future__ import annotations

import asyncio

from services.runtime.ground.clock import SYSTEM
from tests.fixtures.clock import FakeClock


def test_sleepers_wake_in_deadline_order_only_when_their_time_comes() -> None:
    clock = FakeClock(start=0.0)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.monotonic()))

    async def run() -> None:
        tasks = [asyncio.ensure_future(sleeper(n, s)) for n, s in (("b", 2.0), ("a", 1.0))]
        await clock.advance(0)
        assert woke == [] and clock.waiting == 2
        await clock.advance(0.5)
        assert woke == []
        await clock.advance(2.0)
        assert woke == [("a", 1.0), ("b", 2.0)] and clock.monotonic() == 2.5
        await asyncio.gather(*tasks)

    asyncio.run(run())


def test_a_timed_wait_ends_on_its_event_or_its_time() -> None:
    clock = FakeClock(start=0.0)

    async def run() -> None:
        event = asyncio.Event()
        first = asyncio.ensure_future(clock.wait(event, 10.0))
        await clock.advance(9.0)
        assert not first.done()
        await clock.advance(1.0)
        assert first.done() and first.result() is False
        second = asyncio.ensure_future(clock.wait(event, 10.0))
        await clock.advance(1.0)
        event.set()
        assert await second is True
        assert clock.waiting == 0  # the cut-short wait left no timer behind

    asyncio.run(run())


def test_the_system_clock_waits_for_real() -> None:
    async def run() -> None:
        event = asyncio.Event()
        assert await SYSTEM.wait(event, 0.001) is False
        event.set()
        assert await SYSTEM.wait(event, 60) is True
        before = SYSTEM.monotonic()
        await SYSTEM.sleep(0.001)
        assert SYSTEM.monotonic() > before

    asyncio.run(run())
