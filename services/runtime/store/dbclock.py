"""The database's clock, as a service sees it: one clock for every timeout.

Every ``recorded_at`` in the log is the database's ``clock_timestamp()`` at the append
(migration 0011), and the reclamation service counts its timeouts (not started, lease
expiry) in SQL on that same clock. A service that compares a ``recorded_at`` with *now*
in Python (how long a claim waited for its allocation, how old an unknown share is)
must not take its own host's clock for now: a host ten minutes behind would see every
event ten minutes in the future.

:class:`DatabaseClock` keeps the last database time it learnt — every append returns the
``recorded_at`` it wrote (:class:`~services.runtime.store.eventstore.EventStore` feeds it), a
reader may :meth:`~DatabaseClock.sync` it with ``SELECT clock_timestamp()`` — together
with the *monotonic* time it was learnt at, and carries it forward on the monotonic
clock: :meth:`~DatabaseClock.now` is the database's time now, off by at most the round
trip it was learnt over, whatever the host's wall clock says or does (set back, skewed,
stepped). Until it has learnt anything it answers the host's clock.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

__all__ = ["DatabaseClock"]


class DatabaseClock:
    """The database's time now, learnt from its answers (see the module docstring)."""

    def __init__(self) -> None:
        self._base: tuple[datetime.datetime, float] | None = None

    def observe(self, database_time: datetime.datetime, sent: float, received: float) -> None:
        """The database said ``database_time`` between ``sent`` and ``received``
        (``time.monotonic()``): it was that time at ``sent`` at the earliest and at
        ``received`` at the latest; the middle is taken."""
        self._base = (database_time, (sent + received) / 2)

    async def sync(self, connection: Any) -> datetime.datetime:
        """Ask the database (a connection or pool) for its time; returns it."""
        sent = time.monotonic()
        now: datetime.datetime = await connection.fetchval("SELECT clock_timestamp()")
        self.observe(now, sent, time.monotonic())
        return now

    @property
    def known(self) -> bool:
        """Whether it has learnt the database's time at least once."""
        return self._base is not None

    def now(self) -> datetime.datetime:
        """The database's time now (the host's clock until it has learnt one)."""
        if self._base is None:
            return datetime.datetime.now(datetime.UTC)
        at, learnt = self._base
        return at + datetime.timedelta(seconds=time.monotonic() - learnt)
