"""waiting.wait_for: a timeout that never drops the caller's cancellation; Signal and
signalled: a flag that wakes a future of the caller's without a task."""

from __future__ import annotations

import asyncio

import pytest

from services.runtime.ground.waiting import Signal, signalled, wait_for
from tests.fixtures.polling import until


async def _cancelled_as_it_completes(result: asyncio.Future[int]) -> asyncio.Task[int]:
    task = asyncio.create_task(wait_for(asyncio.shield(result), 10))
    for _ in range(3):  # the task is waiting on the future now
        await asyncio.sleep(0)
    result.set_result(1)
    task.cancel()  # the same turn of the loop as the result
    return task


async def test_the_callers_cancellation_wins_over_a_result_in_the_same_turn() -> None:
    task = await _cancelled_as_it_completes(asyncio.get_running_loop().create_future())
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_result_and_a_timeout() -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[int] = loop.create_future()
    loop.call_soon(ready.set_result, 7)
    assert await wait_for(ready, 5) == 7
    with pytest.raises(TimeoutError):
        await wait_for(loop.create_future(), 0.01)
    assert await wait_for(asyncio.sleep(0, result="none"), None) == "none"


async def test_a_signal_wakes_its_waiters_and_the_futures_given_it() -> None:
    loop = asyncio.get_running_loop()
    signal = Signal()
    waiting = asyncio.create_task(signal.wait())
    woken: asyncio.Future[object] = loop.create_future()
    forgotten: asyncio.Future[object] = loop.create_future()
    signal.wake(woken)
    signal.wake(forgotten)
    signal.unwake(forgotten)
    await asyncio.sleep(0)
    assert not waiting.done() and not woken.done() and not signal.is_set()
    signal.set()
    assert signal.is_set() and woken.done()
    assert await wait_for(waiting, 5) is True
    assert not forgotten.done()  # unwaked: its wait ended another way
    early: asyncio.Future[object] = loop.create_future()
    signal.wake(early)  # set already: resolved at once
    assert early.done()
    assert await wait_for(signal.wait(), 5) is True
    signal.clear()
    again = asyncio.create_task(signal.wait())
    await until(lambda: len(signal._futures) == 1, 5, "the wait to start")
    assert not again.done() and len(signal._futures) == 1  # waits again once cleared
    again.cancel()
    with pytest.raises(asyncio.CancelledError):
        await again
    assert signal._futures == []  # a cancelled wait leaves nothing behind


async def test_a_signalled_event_sets_its_signal_and_leaves_no_task() -> None:
    def watchers() -> list[asyncio.Task[object]]:
        return [t for t in asyncio.all_tasks() if t.get_name() == "dracap-signalled"]

    event = asyncio.Event()
    async with signalled(event) as signal:
        assert not signal.is_set() and len(watchers()) == 1
        event.set()
        await until(signal.is_set, 5, "the signal to follow the event")
    assert watchers() == []
    async with signalled(event) as signal:  # set already: no watcher at all
        assert signal.is_set() and watchers() == []
    stop = asyncio.Event()
    async with signalled(stop):
        pass
    await asyncio.sleep(0)
    assert watchers() == []  # left before the event: its watcher was cancelled
