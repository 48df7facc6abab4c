"""The clock a service's timers run on: the event loop's, or a test's that it advances.

A service waits for time in three ways: it sleeps (a back-off), it waits for an event
with a timeout (a tick that a stop can cut short), and it compares two instants (a
renewal older than a ttl, a hook tried less than ``fence-after`` ago). Each of them goes
through a :class:`Clock`, so a test can hand the service a clock it moves by hand
(``tests/fixtures/clock.py``) and see a ttl run out, a retry come due or a lease be lost
without waiting for the time to pass, on a machine however busy.

One timer is counted on the wall clock: an agent's retries, whose due times
(``retry_at``) it writes into the log and the enforcement service answers back. The
clock gives that wall time too (:meth:`Clock.utcnow`): a test's moves with its
monotonic seconds, so a retry comes due when the test advances past it.

:data:`SYSTEM` is the clock of every service as it runs: :func:`time.monotonic` for
instants, :func:`asyncio.sleep` and :func:`asyncio.wait_for` for waits. Apart from
:meth:`Clock.utcnow`, a clock measures durations only; the database's wall clock, on
which the log's ``recorded_at`` and the leases' expiry are counted, is
:class:`~services.runtime.store.dbclock.DatabaseClock`.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Final, Protocol

from services.runtime.ground.waiting import wait_for

__all__ = ["SYSTEM", "Clock", "SystemClock"]


class Clock(Protocol):
    """Monotonic seconds and the waits measured on them."""

    def monotonic(self) -> float:
        """Seconds since an arbitrary start; never goes back."""
        ...

    def utcnow(self) -> datetime.datetime:
        """The wall-clock time now, in UTC."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` have passed on this clock."""
        ...

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        """Wait for ``event`` at most ``seconds``; whether it is set."""
        ...


class SystemClock:
    """The host's monotonic clock and asyncio's own timers."""

    def monotonic(self) -> float:
        """:func:`time.monotonic`."""
        return time.monotonic()

    def utcnow(self) -> datetime.datetime:
        """:meth:`datetime.datetime.now` in UTC."""
        return datetime.datetime.now(datetime.UTC)

    async def sleep(self, seconds: float) -> None:
        """:func:`asyncio.sleep`."""
        await asyncio.sleep(seconds)

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        """``event.wait()`` under :func:`asyncio.wait_for`."""
        if event.is_set():
            return True
        try:
            await wait_for(event.wait(), seconds)
        except TimeoutError:
            return event.is_set()
        return True


#: The clock services run on unless a test hands them another.
SYSTEM: Final[Clock] = SystemClock()
