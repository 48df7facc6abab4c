"""The node agent's writer (services.enforcement.agent.Writer): who waits for it.

The consumer keeps the writer across a run of message groups, each staged while the
report before it is in flight, and gives it back as soon as another path of the agent
(a retry sweep, a kubelet round, a health check) waits for it: ``contended`` says so.
"""

from __future__ import annotations

import asyncio
import contextlib

from services.enforcement.agent import Writer
from tests.fixtures.polling import until


async def test_a_task_waiting_for_the_writer_makes_it_contended() -> None:
    writer = Writer()
    held, release = asyncio.Event(), asyncio.Event()

    async def holder() -> None:
        # re-entrant: its own task waits for nothing
        async with writer.held(), writer.held():
            held.set()
            await release.wait()

    async def other() -> None:
        async with writer.held():
            pass

    first = asyncio.create_task(holder())
    await held.wait()
    assert not writer.contended
    second = asyncio.create_task(other())
    await until(lambda: writer.contended, 10, "the second task waiting")
    release.set()
    await asyncio.gather(first, second)
    assert not writer.contended


async def test_a_waiter_that_gives_up_is_no_longer_counted() -> None:
    writer = Writer()
    held, release = asyncio.Event(), asyncio.Event()

    async def holder() -> None:
        async with writer.held():
            held.set()
            await release.wait()

    first = asyncio.create_task(holder())
    await held.wait()
    waiter = asyncio.create_task(writer.held().__aenter__())
    await until(lambda: writer.contended, 10, "the waiter counted")
    waiter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiter
    assert not writer.contended
    release.set()
    await first
    async with writer.held():  # the lock was not left taken by the cancelled waiter
        assert not writer.contended
