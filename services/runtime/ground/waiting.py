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
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["all_of", "first_of", "wait_for"]

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
