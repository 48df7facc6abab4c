"""Catch-up projectors: read models kept from the log, in batches, off the hot path.

The audit and billing subscribers keep tables that are a function of the log and guard
nothing. A :class:`Projector` keeps one such read model: it reads the log itself, in
log order, from its own position (its row in ``ledger_positions``), and applies what it
read in **batches**, one transaction per batch of at most ``batch`` log positions:

1. one statement creates or locks the projector's row and returns its position
   (``INSERT ... ON CONFLICT DO UPDATE ... RETURNING``: two instances take turns);
2. one statement reads the events after that position, at most ``batch`` positions
   further and never past the head the store has heard of (every position at or below
   an announced head is committed: positions are gap-free, in commit order), only of
   the types the projector wants (``types``; its position moves past the others all
   the same);
3. ``apply(connection, envelopes)``: the subscriber reads the rows of its own it needs,
   builds the new ones with its pure functions, and writes them: a bounded number of
   statements per batch (each over every row of the batch: ``= ANY($1)`` lookups,
   ``executemany``), whatever the number of events or commits in it; it may return a
   callable to run once the batch has committed (metrics of what was written);
4. one statement moves the position to the end of the window; the commit.

So a batch costs about ten round trips, and under load one batch carries hundreds of
commits. Exactly once and in log order without ``processed_messages``: the rows and
the position commit together, a crash anywhere leaves the position where the rows are,
and an event at or before the position is never read again.

Waking. The projector needs no bus message: it waits on the log's NOTIFY (every append
announces its new head, :meth:`~services.runtime.store.eventstore.EventStore.wait_for_new`),
one notification per commit, with a poll every ``poll_s`` in case one is lost (a broken
listener connection). After a wake-up it lingers ``linger_s`` before reading, so the
commits of that time go in one batch, and it reads only up to the head it knew when it
started (commits announced while a batch runs wait for the next linger: chasing them
made a projector run small batches back to back under a steady load, ~20 % of
``dracap up``'s CPU at 50 claims/s, issue 25): in ``dracap up``, where it shares the event loop
with the services that decide, it runs a few transactions a second under any load,
on its own pool (the ledger's login), and while it decodes a batch it hands the loop
back every :data:`CHUNK` rows.

Refused events (:mod:`events.folding`) are left out of what ``apply`` gets, as every
reader of the log leaves them out: a row whose payload the fold's driver does not
decode, and, given a live view, an event the fold refused there (the view is brought
up to the batch's end first, by a read on the batch's own connection when it is
behind). Each is counted and logged once per process
(:mod:`services.runtime.store.refusals`); the position moves past them all the same.

A batch that fails (the database away, a bug) is rolled back and tried again after a
back-off (``retry_s`` doubling to ``poll_s * 30``); the failure is logged once per
change of reason.

Dead letters. A failure that says a server cannot be reached
(:func:`~services.runtime.ground.outages.is_unreachable`) is nobody's fault and is retried
for as long as the outage lasts. Any other failure of the same window ``max_tries``
times in a row is an event the subscriber cannot handle (a payload its functions do
not expect, a bug): the projector then applies that window one position at a time, and
the position that fails ``max_tries`` times alone is *dead-lettered*: the projector's
position moves past it without its rows, ``dracap_dead_letters_total{consumer=<name>}``
counts it (``DracapDeadLetters`` alerts) and one line names the event; the rest of the
log goes on. The subscriber's ``verify`` lists the rows it lacks. Nothing is retried
forever, and no failure logs a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Final

from prometheus_client import Gauge

from events.envelopes import Envelope
from events.folding import Refusal
from services.runtime.ground.metrics import DEAD_LETTERS, REGISTRY
from services.runtime.ground.outages import is_unreachable, one_line
from services.runtime.ground.waiting import wait_for
from services.runtime.store.eventstore import Connection, EventStore
from services.runtime.store.livestate import LiveState
from services.runtime.store.refusals import note
from services.runtime.store.rows import (
    ACTOR,
    EVENT_ID,
    POSITION,
    SELECT,
    Row,
    decoded,
    envelope_with,
)

__all__ = ["CHUNK", "PROJECTOR_LAG", "Apply", "Projector"]

log = logging.getLogger("dracap.projecting")

#: Rows decoded between two hand-backs of the event loop.
CHUNK: Final = 100
PROJECTOR_LAG: Final = Gauge(
    "dracap_projector_lag_events",
    "Events of the log a read-model projector (audit, billing) has not applied yet, as of "
    "its last batch.",
    ["projector"],
    registry=REGISTRY,
)

#: The subscriber's work for a batch, inside its transaction (envelopes in log order);
#: what it returns, if anything, is called once the batch has committed.
Apply = Callable[[Connection, Sequence[Envelope]], Awaitable[Callable[[], None] | None]]

_LOCK: Final = (
    "INSERT INTO ledger_positions AS p (subscriber, position) VALUES ($1, 0) "
    "ON CONFLICT (subscriber) DO UPDATE SET position = p.position RETURNING position"
)
_MOVE: Final = "UPDATE ledger_positions SET position = $2 WHERE subscriber = $1"
_EVENT_ID: Final = "SELECT event_id::text FROM events WHERE position = $1"
_WINDOW: Final = f"{SELECT} WHERE position > $1 AND position <= $2"
_READ_ALL: Final = f"{_WINDOW} ORDER BY position"
_READ_TYPES: Final = f"{_WINDOW} AND type = ANY($3::text[]) ORDER BY position"


class Projector:
    """Keeps one read model from the log (see the module docstring)."""

    def __init__(
        self,
        store: EventStore,
        name: str,
        apply: Apply,
        *,
        types: Collection[str] | None = None,
        batch: int = 1000,
        linger_s: float = 1.0,
        poll_s: float = 1.0,
        retry_s: float = 0.5,
        max_tries: int = 5,
        live: LiveState | None = None,
    ) -> None:
        if max_tries < 1:
            raise ValueError("max_tries must be at least 1")
        self.store = store
        #: the view whose refusals the projector leaves out (None: undecodable rows only)
        self.live = live
        self.name = name
        self._apply = apply
        self._types = sorted(types) if types is not None else None
        self.batch = batch
        self.linger_s = linger_s
        self.poll_s = poll_s
        self.retry_s = retry_s
        self.max_tries = max_tries
        self.position = 0  #: the position of the last batch this projector committed
        self.batches = 0  #: batches committed so far
        self.applied = 0  #: events handed to ``apply`` so far
        self.dead_lettered = 0  #: positions given up on (see "Dead letters")
        self._failing: str | None = None
        self._window = (0, 0)  # the window (after, up to) of the latest step
        self._tries = 0  # failures in a row of the window that starts at _failed_at
        self._failed_at = -1
        self._narrow = 0  # windows of one position while the position is below this
        PROJECTOR_LAG.labels(name).set(0)  # the series exist from the start
        DEAD_LETTERS.labels(consumer=name)

    @property
    def failing(self) -> str | None:
        """Why the latest batch failed, while the projector has not gone on since."""
        return self._failing

    async def run(self, stop: asyncio.Event) -> None:
        """Catch up, then follow the log until ``stop`` is set."""
        delay = self.retry_s
        head: int | None = None
        while not stop.is_set():
            try:
                await self.catch_up(head, stop, chase=False)
                head = await self.store.wait_for_new(self.position, self.poll_s)
            except Exception as exc:
                self._failed(exc, delay)
                head = None
                if await self._gave_up_on(exc):
                    delay = self.retry_s
                    continue
                await _wait(stop, delay)
                delay = min(delay * 2, self.poll_s * 30)
                continue
            delay = self.retry_s
            if self._failing is not None:
                log.info("projector %s: going on", self.name)
                self._failing = None
            if head > self.position:
                await _wait(stop, self.linger_s)
                head = max(head, self.store.known_head)  # what the linger gathered

    async def catch_up(
        self, head: int | None = None, stop: asyncio.Event | None = None, *, chase: bool = True
    ) -> int:
        """Apply batches up to ``head`` (None: the log's head now), or further when the
        store has heard of a newer one meanwhile (``chase``; :meth:`run` does not: what
        came meanwhile waits for the next linger); returns the position reached."""
        if head is None:
            head = await self.store.head()
        while True:
            if chase:
                head = max(head, self.store.known_head)
            moved = await self.step(head)
            if moved is None or (stop is not None and stop.is_set()):
                return self.position
            if not chase and moved >= head:  # there: no empty batch to find it out
                return self.position

    async def step(self, head: int) -> int | None:
        """One batch up to at most ``head``; the new position, None when already there."""
        self._window = (self.position, self.position)  # until the window is known
        async with self.store.pool.acquire() as connection, connection.transaction():
            done = int(await connection.fetchval(_LOCK, self.name))
            self.position = done
            upto = min(head, done + (1 if done < self._narrow else self.batch))
            self._window = (done, upto)
            if upto <= done:
                return None
            if self._types is None:
                rows = await connection.fetch(_READ_ALL, done, upto)
            else:
                rows = await connection.fetch(_READ_TYPES, done, upto, self._types)
            refused = (
                (await self.live.fresh(upto, connection=connection)).refused
                if self.live is not None
                else {}
            )
            envs = await _decoded(rows, refused)
            committed = await self._apply(connection, envs) if envs else None
            await connection.execute(_MOVE, self.name, upto)
        if committed is not None:
            committed()
        self.position = upto
        self.batches += 1
        self.applied += len(envs)
        PROJECTOR_LAG.labels(self.name).set(max(0, self.store.known_head - upto))
        return upto

    async def _gave_up_on(self, exc: Exception) -> bool:
        """Count a failure that is no outage; after ``max_tries`` of one window, narrow
        it to single positions, or dead-letter the single position (see the module
        docstring). True when it did either."""
        if is_unreachable(exc):
            return False
        start, end = self._window
        if start != self._failed_at:
            self._failed_at, self._tries = start, 0
        self._tries += 1
        if self._tries < self.max_tries or end <= start:
            return False
        self._tries = 0
        if end - start > 1:
            self._narrow = end
            log.warning(
                "projector %s: positions %d..%d failed %d times; applying them one at a time",
                self.name, start + 1, end, self.max_tries,
            )  # fmt: skip
            return True
        await self._dead_letter(end, one_line(exc))
        return True

    async def _dead_letter(self, position: int, reason: str) -> None:
        """Move past ``position`` without applying it; count it and say which event."""
        async with self.store.pool.acquire() as connection, connection.transaction():
            if int(await connection.fetchval(_LOCK, self.name)) != position - 1:
                return  # another instance moved on meanwhile
            event_id = await connection.fetchval(_EVENT_ID, position)
            await connection.execute(_MOVE, self.name, position)
        self.position = position
        self.dead_lettered += 1
        self._failing = None
        DEAD_LETTERS.labels(consumer=self.name).inc()
        log.error(
            "projector %s: dead-lettered event %s at position %d after %d failed tries (%s); "
            "its rows are left out",
            self.name, event_id, position, self.max_tries, reason,
        )  # fmt: skip

    def _failed(self, exc: Exception, delay: float) -> None:
        reason = one_line(exc)
        if reason != self._failing:
            log.warning("projector %s: batch failed (%s); trying again", self.name, reason)
            self._failing = reason
        log.debug("projector %s: next try in %.1fs", self.name, delay)


async def _decoded(rows: Sequence[Row], refused: Collection[int]) -> list[Envelope]:
    """``rows`` as envelopes, refused events left out (the undecodable ones noted), handing
    the event loop back every :data:`CHUNK` rows."""
    out: list[Envelope] = []
    for start, row in enumerate(rows):
        if start and not start % CHUNK:
            await asyncio.sleep(0)
        event = decoded(row)
        if isinstance(event, Refusal):
            note(event, str(row[EVENT_ID]), row[ACTOR])
        elif row[POSITION] not in refused:
            out.append(envelope_with(row, event))
    return out


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await wait_for(stop.wait(), seconds)
