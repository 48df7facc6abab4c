"""A position kept in ``consumer_checkpoints``, stored off the hot path.

The relay and every consumer record how far they got. Writing that row inside each
unit of work puts a commit (the relay) or a row lock (several workers of one durable
consumer update the same row) on the path of every message: the second worker's
transaction waits for the first one's commit just to move a number. What the row is
for does not need that: for the relay it is where to resume after a crash, and
resuming a little earlier is harmless (JetStream drops the re-published ids); for a
consumer it is a high-water mark for lag — exactly-once comes from
``processed_messages``, resuming from JetStream's durable consumer.

:class:`HighWaterMark` therefore takes positions as they are reached
(:meth:`HighWaterMark.advance`, no I/O) and a companion task (:meth:`HighWaterMark.run`)
stores the newest one when it moved — one small autocommit at a time, never two at
once, at most one per ``interval`` (under load a store per group would be a fifth of
all the statements the services send), ``GREATEST`` so a store never moves the row
back (a go-back does: below). On a clean stop the last position is stored before
``run`` returns; a crash loses at most what moved since the last store.

The relay also goes *back* (:meth:`HighWaterMark.go_back`): the stream lost what it had
published, or a failover lost events of the log that it had read and published (the
positions hold other events now). Its stored row may be ahead of where it goes back to,
and ``GREATEST`` never moves it back: a relay killed before it had published the
positions again would resume past them at its restart, and never publish what took
them. So a go-back that leaves the row ahead is stored too, with ``LEAST``
(:meth:`HighWaterMark.rewound`, which the relay awaits before it publishes again), in
turn with the stores of :meth:`HighWaterMark.run` (a store of the old position in flight
cannot land after it).

The interval is :data:`INTERVAL_S`, a second. At 100 ms every busy consumer stored its
row about ten times a second, however few messages it had: at 30 claims/s that was
0.6 statements per claim of ``dracap up``'s 6.2 (a tenth of them), for a row that only
sets where a rebuilt stream starts again and where a restarted relay resumes. Both
cost nothing more for a second more: what comes again is a no-op
(``processed_messages``, JetStream's duplicate window).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from services.runtime.ground.outages import is_unreachable, one_line
from services.runtime.ground.waiting import wait_for
from services.runtime.store.eventstore import EventStore

__all__ = ["INTERVAL_S", "REWIND_CHECKPOINT", "SAVE_CHECKPOINT", "HighWaterMark"]

log = logging.getLogger("dracap.highwater")

#: At most one store of a position per this many seconds (see the module docstring).
INTERVAL_S: Final = 1.0

SAVE_CHECKPOINT: Final = (
    "INSERT INTO consumer_checkpoints (consumer, position) VALUES ($1, $2) "
    "ON CONFLICT (consumer) DO UPDATE SET position = GREATEST("
    "consumer_checkpoints.position, EXCLUDED.position), updated_at = now()"
)
#: a go-back stored (module docstring): the row moves back, never forward
REWIND_CHECKPOINT: Final = (
    "UPDATE consumer_checkpoints SET position = LEAST(position, $2), updated_at = now() "
    "WHERE consumer = $1"
)


class HighWaterMark:
    """The position of ``name``: advanced in memory, stored by :meth:`run`."""

    def __init__(
        self,
        store: EventStore,
        name: str,
        *,
        save: Callable[[int], Awaitable[None]] | None = None,
        retry_delay: float = 0.5,
        interval: float | None = None,
    ) -> None:
        self._store = store
        self.name = name
        self._save = save or self.store_position
        self._retry_delay = retry_delay
        self._interval = INTERVAL_S if interval is None else interval  # looked up now
        self.position = 0  #: the highest position reached
        self.saved = 0  #: the highest position stored
        self._moved = asyncio.Event()
        self._rewind: int | None = None  #: gone back behind the stored row, not stored yet
        self._storing = asyncio.Lock()  #: one statement on the row at a time

    def advance(self, position: int) -> None:
        """Note that everything up to ``position`` is done (never moves back)."""
        if position > self.position:
            self.position = position
            self._moved.set()

    def go_back(self, position: int) -> None:
        """Start over from ``position`` (the relay, after the stream or the log lost
        events); where the stored row is ahead of it, :meth:`rewound` stores it."""
        self.position = min(self.position, position)
        if self.position < self.saved:
            self._rewind = self.position

    async def rewound(self) -> None:
        """Store the last go-back if the stored row is ahead of it (``LEAST``); nothing
        otherwise. Raises what the database raises; the go-back stays to be stored."""
        if self._rewind is None:  # nearly always: no lock, nothing waits for a store
            return
        async with self._storing:
            target = self._rewind
            if target is None:
                return
            await self._store.pool.execute(REWIND_CHECKPOINT, self.name, target)
            self.saved = min(self.saved, target)
            if self._rewind == target:
                self._rewind = None

    async def store_position(self, position: int) -> None:
        """Store ``position`` now (``GREATEST``: the row never moves back)."""
        await self._store.pool.execute(SAVE_CHECKPOINT, self.name, position)

    async def run(self, done: asyncio.Event) -> None:
        """Store the position when it moved, at most once per interval; at ``done``, once more."""
        while True:
            if not done.is_set():
                waiter = asyncio.ensure_future(self._moved.wait())
                stopper = asyncio.ensure_future(done.wait())
                try:
                    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                finally:  # no await here: this may run while the coroutine is closed
                    for task in (waiter, stopper):
                        task.cancel()
            self._moved.clear()
            async with self._storing:  # a go-back's store waits for this one, or it for it
                position = self.position
                stored = await self._store_if_moved(position)
            if not stored:
                if done.is_set():
                    return
                self._moved.set()
                await asyncio.sleep(self._retry_delay)
                continue
            if done.is_set():
                return
            with contextlib.suppress(TimeoutError):  # what moves meanwhile waits its turn
                await wait_for(done.wait(), self._interval)

    async def _store_if_moved(self, position: int) -> bool:
        """Store ``position`` if it passed the stored one; False if that failed."""
        if position > self.saved:
            try:
                await self._save(position)
            except Exception as exc:
                if is_unreachable(exc):  # the database is away (a failover): one line
                    log.warning(
                        "%s: could not store position %d: %s", self.name, position, one_line(exc)
                    )
                else:
                    log.exception("%s: could not store position %d", self.name, position)
                return False
            self.saved = max(self.saved, position)
        return True
