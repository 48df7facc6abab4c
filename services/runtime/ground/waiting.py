"""Waiting for the first of several things: a wake-up, a stop, a timer.

Every loop of a service waits the same way: until work arrives (a NOTIFY, an offered
commit, a flag) *or* it is told to stop, whichever is first. :func:`first_of` is that
wait, written once. It runs the awaitables as tasks, returns when one of them is done,
and cancels the others and waits for them to end — so a loop never leaves a waiter
behind. A failure of an awaitable (a lost database connection while waiting for a
NOTIFY) is raised to the caller; the caller's own cancellation cancels every task and
propagates, it is never swallowed.

:func:`all_of` is its counterpart for loops that run side by side for a service's whole
life (a worker's consumers): it returns when all are done, and when one fails it
cancels the others before raising, so a supervisor that restarts the service never
leaves the failed one's siblings running beside the new ones.

:func:`wait_for` is :func:`asyncio.wait_for` without Python 3.11's lost cancellation:
there, a task cancelled in the same turn of the loop as the awaited thing completes
gets its result instead of the ``CancelledError`` (CPython gh-86296, fixed in 3.12), so
a service told to stop runs on, and whoever awaits its end waits forever (a reservation
worker woken by a NOTIFY as its test killed it hung the suite). It is written with
:func:`asyncio.timeout`, which counts cancellations and never drops one; ruff bans
``asyncio.wait_for`` in the project's code (``[tool.ruff.lint.flake8-tidy-imports]``).

A loop that waits once per unit of work — the live view's tailer and the relay, a few
times per claim — waits more cheaply on a :class:`Signal`: an ``asyncio.Event`` that
also wakes a future of the caller's, so that a wait on several things is one future,
not a task per thing (``EventStore.wait_for_new``'s ``wakes``). Measured on uvloop in a
standalone loop: one future woken by a callback ~1.4 µs, a :func:`first_of` over three
waits ~33 µs (docs/services.md, "The machine at half rate"). A stop event of the caller's
(an ``asyncio.Event``) becomes a signal through :func:`signalled`: one task for the
loop's whole run instead of one per wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Literal, TypeVar

__all__ = ["Signal", "all_of", "first_of", "signalled", "wait_for"]

_T = TypeVar("_T")


async def wait_for(awaitable: Awaitable[_T], seconds: float | None) -> _T:
    """``awaitable``'s result, or :class:`TimeoutError` after ``seconds`` (None: no limit).

    As :func:`asyncio.wait_for`, but the caller's cancellation always wins.
    """
    async with asyncio.timeout(seconds):
        return await awaitable


async def first_of(*awaitables: Awaitable[object]) -> None:
    """Wait until one of ``awaitables`` is done, cancel the rest, raise a failure."""
    await _wait_then_cancel(awaitables, asyncio.FIRST_COMPLETED)


async def all_of(*awaitables: Awaitable[object]) -> None:
    """Wait until every one of ``awaitables`` is done; on a failure, cancel the rest and
    raise it."""
    await _wait_then_cancel(awaitables, asyncio.FIRST_EXCEPTION)


async def _wait_then_cancel(awaitables: tuple[Awaitable[object], ...], return_when: str) -> None:
    """Run ``awaitables`` as tasks until ``return_when``; cancel and await what is left,
    then raise the first failure."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=return_when)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            task.result()  # raises it


class Signal:
    """A flag that wakes whoever waits for it: ``asyncio.Event``'s ``set``, ``clear``,
    ``is_set`` and ``wait``, and :meth:`wake`, which has :meth:`set` resolve a future of
    the caller's (see the module docstring). Runs on the event loop's thread only."""

    def __init__(self) -> None:
        self._set = False
        self._futures: list[asyncio.Future[object]] = []

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        """Set the flag and resolve every future waiting for it (with ``None``)."""
        if self._set:
            return
        self._set = True
        futures, self._futures = self._futures, []
        for future in futures:
            if not future.done():
                future.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> Literal[True]:
        """Until the flag is set (at once if it is)."""
        if not self._set:
            future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            self.wake(future)
            try:
                await future
            finally:
                self.unwake(future)
        return True

    def wake(self, future: asyncio.Future[object]) -> None:
        """Have :meth:`set` resolve ``future`` (at once when the flag is set already)."""
        if self._set:
            if not future.done():
                future.set_result(None)
        else:
            self._futures.append(future)

    def unwake(self, future: asyncio.Future[object]) -> None:
        """Forget ``future`` (its wait ended another way)."""
        with contextlib.suppress(ValueError):
            self._futures.remove(future)


@contextlib.asynccontextmanager
async def signalled(event: asyncio.Event) -> AsyncIterator[Signal]:
    """A :class:`Signal` set once ``event`` is, for the block's length (one task watches
    ``event`` until the block ends)."""
    signal = Signal()

    async def watch() -> None:
        await event.wait()
        signal.set()

    if event.is_set():
        signal.set()
        yield signal
        return
    watcher = asyncio.create_task(watch(), name="dracap-signalled")
    try:
        yield signal
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
