"""waiting.wait_for: a timeout that never drops the caller's cancellation."""

from __future__ import annotations

import asyncio

import pytest

from services.runtime.ground.waiting import wait_for


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
