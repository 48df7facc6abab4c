"""A live, in-memory view of the log: the fold kept current for one process.

Every service that decides something (admission, reservation, the node agent) needs
the cluster as the log describes it *now*. :class:`LiveState` holds one
:class:`events.state.ClusterState` and folds into it every event after
``state.position``.

Freshness: one way to ask
-------------------------
``state = await live.fresh(at_least, *also, connection=None, timeout=None)`` returns
the state folded at least as far as each mark asks:

* a **position** ``p`` (an ``int``): every event up to ``p`` — a lock's head, a
  message's position, an append's envelope;
* :data:`SEEN`: every commit this process knows of (``EventStore.committed_head``: its
  own appends and what NOTIFY announced) — read-your-writes for a request handler; a
  commit whose notification is still on its way is not waited for. A store that is
  not listening knows of nothing, so SEEN is then HEAD;
* :data:`HEAD`: everything committed before the call (a read of the log).

How it gets there, cheapest first:

* nothing, when the state is already there (the tailer usually is);
* while :meth:`LiveState.run` tails the log, a caller behind a position waits for the
  tailer to fold it (it reads as soon as the commit is announced, or takes it from
  the commit hand-over) instead of queueing a read of its own; after
  :data:`TAIL_WAIT_S` it reads itself;
* a read: one keyset query after the current position. Reads are serialised, so
  concurrent callers never fold an event twice, and *shared*: a caller that waited for
  another's read reads again only if that read began before its call — a read that
  began after the call saw everything this one would, so many concurrent callers cost
  one query. ``connection`` makes a read happen on the caller's connection (a
  consumer's handler holding one need not wait for a second from the pool); it must
  not hold uncommitted appends, they would be folded as if they had happened.

A position is taken to be committed already (a lock's head, a message's position):
one read reaches it. With ``timeout`` the call also waits for a position still to
come and raises ``TimeoutError`` if the log has not reached it by then; without, the
state is returned as the read found it.

Decisions
---------
Decisions are optimistic: a service decides on the state right after ``fresh`` and
appends with the expected versions of the streams it decided on, which
:meth:`LiveState.stream_version` gives *as of* ``state.position``. If anybody appended
to one of those streams since, the store raises ``ConflictError``; the service asks
for a fresher state and decides again. So the versions here must never be newer than
the state: they are tracked from the folded envelopes, and for streams that were not
seen since a snapshot they are read from the database bounded by the state's
position. A decision that reads versions (which may await that look-up) does so inside
:meth:`LiveState.frozen`, which holds folding still — never reading the log, so
decisions and reads do not queue behind each other.

Tailing
-------
:meth:`LiveState.run` tails the log (``EventStore.wait_for_new``: LISTEN/NOTIFY with a
timeout as a safety net) and folds as events arrive; it keeps the view warm and drives
the listeners. This process's own committed appends come through the commit hand-over
(:mod:`services.runtime.store.handover`) and are folded without reading them back.

**On demand.** A view that decides nothing on its own and is only asked at moments of
its owner's choosing — the audit and billing subscribers, which ask for each batch's
last position once a batch is due (``dracap serve ledger``, ``dracap audit serve``,
``dracap usage serve``) — runs :meth:`LiveState.follow_on_demand` instead: each
``fresh`` reads what came since, in one query, and no NOTIFY wakes it. Tailing them
read the log once per commit (three reads per claim at low rates, each folding one or
two events), though the subscribers use what was folded once a second (issue 25).

Listeners (``subscribe``) are plain callables run after each envelope is folded, with
the envelope; they must be quick and must not raise (an exception is logged and the
listener is kept). They let a service keep derived indexes incrementally instead of
recomputing them per decision (the watch publisher of the claims API, the allocated
state of the reservation service).

While nobody listens (a start's catch-up, before the services subscribe), a read folds
the stored rows straight away (:meth:`LiveState._fold_rows`): no envelope is built per
event (a catch-up of 100,000 events on a 1 M-event log: ~1.5-2.0 s -> ~1.0-1.3 s on the
2-core development machine; reading the rows is much of what is left).

Refused events
--------------
The view folds through the fold's driver (:mod:`events.folding`), like every reader of
the log: an event whose payload does not decode, or whose step the fold refuses (an
``InvariantViolation`` or any other error of the step), is *skipped* — the state stays
as it was before it, :attr:`~events.state.ClusterState.refused` records it, the
listeners do not hear of it, :mod:`services.runtime.store.refusals` counts and logs it once
per process, and the latest are kept in :attr:`LiveState.violations`. The log is the
source of truth and is never rewritten, so one bad event must not stop the view (and
every request behind it) forever; ``dracap replay verify`` reports the same positions.
The database's own constraints (capacity ledger CHECK, exclusive holds) are what keep
such an event from ever oversubscribing a device.

A start from a snapshot
-----------------------
:meth:`LiveState.load_snapshot` starts from the newest stored snapshot that verifies
(:mod:`services.runtime.store.snapshots`), and :meth:`LiveState.run` then checks it in the
background against a fold from position 0 (:mod:`services.runtime.store.snapshotcheck`); on a
mismatch the view is replaced by that fold (:meth:`LiveState.replace`) and whoever keeps
indexes derived from the state is told (:meth:`LiveState.on_replaced`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Final, TypeAlias

import asyncpg

from events.envelopes import Envelope
from events.folding import Refusal, fold_event, fold_stored
from events.state import ClusterState
from events.transitions import INVENTORY_CHANGES, events_meaning
from services.runtime.ground.errors import LogDiverged, RuntimeServiceError
from services.runtime.ground.outages import is_unreachable
from services.runtime.ground.waiting import Signal, all_of, first_of, signalled, wait_for
from services.runtime.store.continuity import Continuity
from services.runtime.store.eventstore import ANSWER_WAIT_S, Connection, EventStore, iter_rows
from services.runtime.store.handover import Handover
from services.runtime.store.refusals import note
from services.runtime.store.rows import (
    ACTOR,
    EVENT_ID,
    PAYLOAD,
    POSITION,
    SCHEMA_VERSION,
    STREAM,
    STREAM_VERSION,
    TYPE,
    Row,
    envelope_with,
)
from services.runtime.store.snapshotcheck import check_start
from services.runtime.store.snapshots import load_verified

__all__ = ["HEAD", "INVENTORY_EVENTS", "SEEN", "Freshness", "Listener", "LiveState", "Mark"]

log = logging.getLogger("dracap.livestate")

Listener = Callable[[Envelope], None]


class Mark(enum.Enum):
    """How fresh a state :meth:`LiveState.fresh` gives, besides a position."""

    HEAD = "head"  #: everything committed before the call
    SEEN = "seen"  #: every commit this process knows of


HEAD: Final = Mark.HEAD
SEEN: Final = Mark.SEEN
#: What :meth:`LiveState.fresh` accepts: a log position or a :class:`Mark`.
Freshness: TypeAlias = int | Mark

#: The event classes that change what the allocator's inventory is built from
#: (:data:`events.transitions.INVENTORY_CHANGES`); ``type(event) in`` it is the test.
INVENTORY_EVENTS: Final = events_meaning(*INVENTORY_CHANGES)
_VIOLATIONS_KEPT: Final = 100
#: Handed-over envelopes kept at most (beyond that the tailer reads the log instead).
_OFFERED_KEPT: Final = 4096
#: How long fresh() waits for the tailer to fold a position before it reads the log.
TAIL_WAIT_S: Final = 0.5
#: Rows per page when the log is folded again after a failover lost events
REFOLD_PAGE: Final = 5000


class LiveState:
    """The fold of the log, kept current (see the module docstring)."""

    def __init__(self, store: EventStore, *, batch_size: int = 1000) -> None:
        self.store = store
        self.state = ClusterState()
        self.batch_size = batch_size
        #: bumped whenever classes, slices or request policies change
        self.inventory_generation = 0
        #: the latest refused events (position, reason and detail), oldest first
        self.violations: list[tuple[int, str]] = []
        #: the position of the snapshot this view started from while it is not checked yet
        self.unchecked_start: int | None = None
        self._replaced: list[Callable[[ClusterState], None]] = []
        self._versions: dict[str, int] = {}
        self._versions_complete = True  # False after starting from a snapshot
        #: the rows read last, compared with the log after a new session (a failover)
        self._continuity = Continuity()
        self._read_lock = asyncio.Lock()  # one log read at a time (callers share it)
        self._fold_lock = asyncio.Lock()  # held by frozen() and while a page is folded
        self._reads_started = 0  # log reads begun (numbered from 1)
        self._reads_done = 0  # the number of the latest read that completed
        self._listeners: list[Listener] = []
        self._tailing = False  # run() is tailing the log
        self._on_demand = False  # follow_on_demand() is running
        self._position_waiters: list[tuple[int, asyncio.Future[None]]] = []
        #: this process's committed appends not folded yet (see run())
        self._handover = Handover(lambda: self.state.position, kept=_OFFERED_KEPT)

    @property
    def tailing(self) -> bool:
        """Whether the view follows the log: :meth:`run` tails it, or
        :meth:`follow_on_demand` has each ``fresh`` read it (a health check's question)."""
        return self._tailing or self._on_demand

    # -- startup -------------------------------------------------------------------------

    async def load_snapshot(self) -> bool:
        """Start from the newest stored snapshot that verifies (before any catch-up).

        :func:`services.runtime.store.snapshots.load_verified` says which one; True if one was
        used (none: the first ``fresh`` folds from position 0).
        """
        if self.state.position:
            raise RuntimeError("load_snapshot() must come before the first fresh()")
        state = await load_verified(self.store.pool)
        if state is None:
            return False
        self.state = state
        self._versions_complete = False
        self.inventory_generation += 1
        self.unchecked_start = state.position
        return True

    def on_replaced(self, callback: Callable[[ClusterState], None]) -> Callable[[], None]:
        """Call ``callback(state)`` when :meth:`replace` swaps the state (a derived index
        must be rebuilt from it); returns an unsubscriber."""
        self._replaced.append(callback)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._replaced.remove(callback)

        return unsubscribe

    def replace(self, state: ClusterState) -> None:
        """Serve ``state`` from now on (a fold that was checked: the one the snapshot this
        view started from did not match, or the log's after a failover lost events this
        view had folded). Call it inside :meth:`frozen`, with ``state`` at the view's
        position or past it — before it only when the log lost what the view had read."""
        self.state = state
        self.unchecked_start = None
        self.inventory_generation += 1
        for callback in tuple(self._replaced):
            try:
                callback(state)
            except Exception:
                log.exception("state replacement listener failed")

    # -- listeners -----------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(envelope)`` after every folded envelope; returns an unsubscriber."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(listener)

        return unsubscribe

    # -- stream versions -----------------------------------------------------------------

    async def stream_version(self, stream: str) -> int:
        """The version of ``stream`` as of ``state.position`` (0: no events yet)."""
        version = self._versions.get(stream)
        if version is not None:
            return version
        if self._versions_complete:
            return 0
        found: int | None = await self.store.pool.fetchval(
            "SELECT max(stream_version) FROM events WHERE stream = $1 AND position <= $2",
            stream,
            self.state.position,
        )
        if stream not in self._versions:  # a catch-up may have run meanwhile
            self._versions[stream] = found or 0
        return self._versions[stream]

    # -- folding -------------------------------------------------------------------------

    def _refused(self, refusal: Refusal, event_id: str, actor: str | None) -> None:
        note(refusal, event_id, actor)
        self.violations.append((refusal.position, f"{refusal.reason}: {refusal.detail}"))
        del self.violations[:-_VIOLATIONS_KEPT]

    def _fold(self, envelope: Envelope) -> None:
        """Fold an envelope handed over by this process's store (decoded already)."""
        if envelope.position <= self.state.position:
            return  # folded already (read from the log before it was handed over)
        refusal = fold_event(self.state, envelope.event, envelope.position)
        self._versions[envelope.stream] = envelope.stream_version
        if refusal is not None:
            self._refused(refusal, envelope.event_id, envelope.actor)
            return
        if type(envelope.event) in INVENTORY_EVENTS:
            self.inventory_generation += 1
        self._tell(envelope)

    def _tell(self, envelope: Envelope) -> None:
        for listener in tuple(self._listeners):
            try:
                listener(envelope)
            except Exception:
                log.exception("state listener failed", extra={"event_id": envelope.event_id})

    def _fold_rows(self, rows: Sequence[Row]) -> None:
        """Fold stored rows; an envelope is built only when somebody listens."""
        state, versions = self.state, self._versions
        inventory = INVENTORY_EVENTS
        listening = bool(self._listeners)
        for row in rows:
            position = row[POSITION]
            event = fold_stored(state, row[PAYLOAD], row[TYPE], row[SCHEMA_VERSION], position)
            versions[row[STREAM]] = row[STREAM_VERSION]
            if type(event) is Refusal:
                self._refused(event, str(row[EVENT_ID]), row[ACTOR])
                continue
            if type(event) in inventory:
                self.inventory_generation += 1
            if listening:
                self._tell(envelope_with(row, event))  # type: ignore[arg-type]

    # -- freshness -----------------------------------------------------------------------

    async def fresh(
        self,
        at_least: Freshness,
        *also: Freshness,
        connection: Connection | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (also waits for commits to come)
    ) -> ClusterState:
        """The state, folded at least as far as every mark asks (see the module docstring)."""
        read, position = self._resolve((at_least, *also))
        behind = self.state.position < position
        if read or (behind and not await self._tailer_reaches(position, TAIL_WAIT_S)):
            await self._read(connection)
        if self.state.position < position and timeout is not None:
            await self._wait_for_commit(position, timeout, connection)
        return self.state

    def _resolve(self, marks: Iterable[Freshness]) -> tuple[bool, int]:
        """Whether a read is needed (HEAD), and the position to reach."""
        read, position = False, 0
        for mark in marks:
            if mark is Mark.HEAD:
                read = True
            elif mark is Mark.SEEN:
                seen = self.store.committed_head()
                if seen is None:
                    read = True  # not listening: nothing is known, so read what is there
                else:
                    position = max(position, seen)
            else:
                position = max(position, mark)
        return read, position

    async def _read(self, connection: Connection | None) -> int:
        """Fold every event committed after ``state.position``; returns how many."""
        ticket = self._reads_started + 1  # the first read that starts after this call
        async with self._read_lock:
            if self._reads_done >= ticket:
                return 0  # a read that began after this call has folded everything
            self._reads_started += 1
            read = self._reads_started
            folded = 0
            position = self.state.position
            pages = (
                self.store.read_rows(position, self.batch_size, continuity=self._continuity)
                if connection is None
                else self._rows_on(connection, position)
            )
            try:
                async for rows in pages:
                    async with self._fold_lock:  # not while a decision holds the state still
                        self._fold_rows(rows)
                    folded += len(rows)
                    if self._position_waiters:
                        self._wake_position_waiters()
            except LogDiverged as exc:
                folded = await self._fold_again(exc)
            self._reads_done = read
        return folded

    async def _rows_on(
        self, connection: Connection, position: int
    ) -> AsyncIterator[list[asyncpg.Record]]:
        """The rows after ``position`` read on the caller's connection, compared and kept
        as :meth:`EventStore.read_rows` does with the pool's."""
        continuity = self._continuity
        await continuity.check(connection, self.store.sessions)
        async for rows in iter_rows(connection, position, self.batch_size):
            continuity.saw(rows)
            yield rows

    async def _fold_again(self, diverged: LogDiverged) -> int:
        """The log folded anew from position 0 and served instead of this view, which
        folded events a failover lost (:mod:`services.runtime.store.continuity`)."""
        while True:
            log.error("live state: %s; folding the log again from position 0", diverged)
            try:
                scratch, versions, folded = await self._fold_from_start()
                break
            except LogDiverged as again:  # another failover while it folded
                diverged = again
        async with self._fold_lock:
            self._versions, self._versions_complete = versions, True
            self.replace(scratch)
        if self._position_waiters:
            self._wake_position_waiters()
        return folded

    async def _fold_from_start(self) -> tuple[ClusterState, dict[str, int], int]:
        """A new fold of the whole log, its streams' versions and its length."""
        scratch, versions, folded = ClusterState(), {}, 0
        async for rows in self.store.read_rows(0, REFOLD_PAGE, continuity=self._continuity):
            for row in rows:
                versions[row[STREAM]] = row[STREAM_VERSION]
                event = fold_stored(
                    scratch, row[PAYLOAD], row[TYPE], row[SCHEMA_VERSION], row[POSITION]
                )
                if type(event) is Refusal:
                    note(event, str(row[EVENT_ID]), row[ACTOR])
            folded += len(rows)
            await asyncio.sleep(0)  # the others run between pages
        return scratch, versions, folded

    async def _tailer_reaches(self, position: int, within: float) -> bool:
        """Wait up to ``within`` seconds for the tailer to fold ``position`` (False: no tailer)."""
        if not self._tailing:
            return False
        waiter = asyncio.get_running_loop().create_future()
        self._position_waiters.append((position, waiter))
        with contextlib.suppress(TimeoutError):
            await wait_for(waiter, within)
        return self.state.position >= position

    def _wake_position_waiters(self) -> None:
        reached, waiting = self.state.position, []
        for position, waiter in self._position_waiters:
            if position <= reached:
                if not waiter.done():
                    waiter.set_result(None)
            elif not waiter.done():
                waiting.append((position, waiter))
        self._position_waiters = waiting

    async def _wait_for_commit(
        self, position: int, within: float, connection: Connection | None
    ) -> None:
        """Until ``position`` is folded (it may not be committed yet); TimeoutError after."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while self.state.position < position:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"the log did not reach position {position} in {within}s")
            if self._tailing:
                await self._tailer_reaches(position, min(left, TAIL_WAIT_S))
            else:
                await self.store.wait_for_new(self.state.position, min(left, TAIL_WAIT_S))
                await self._read(connection)

    @contextlib.asynccontextmanager
    async def frozen(self) -> AsyncIterator[ClusterState]:
        """Hold the state still: nothing is folded until the block ends.

        A decision that awaits something (a stream version from the database) while
        it reads the state does so inside this block, so the state and the expected
        versions it appends with stay consistent. Reading the log does not wait for
        it — only folding what was read does.
        """
        async with self._fold_lock:
            yield self.state

    # -- tailing -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, *, poll_s: float = 1.0) -> None:
        """Tail the log until ``stop`` is set (NOTIFY wakes it; ``poll_s`` is the fallback).

        The appends this process's store commits are handed over as they commit and
        folded without reading them back when they come next; whatever else was
        announced (other processes, a gap) is read. A failing read (database
        restarting) is logged and retried after ``poll_s``. A view that started from a
        snapshot checks it meanwhile (:func:`services.runtime.store.snapshotcheck.check_start`).
        """
        self._tailing = True
        offered = self._handover.offered
        checking = (
            asyncio.create_task(check_start(self, stop), name="dracap-snapshot-check")
            if self.unchecked_start is not None
            else None
        )
        try:
            async with signalled(stop) as stopping:
                await self._tail(stop, stopping, offered, poll_s)
        finally:
            self._tailing = False
            if checking is not None:
                checking.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checking

    async def _tail(
        self, stop: asyncio.Event, stopping: Signal, offered: Signal, poll_s: float
    ) -> None:
        """:meth:`run`'s loop: fold what was handed over, read what was not, wait on one
        future for the next commit, an offer or the stop."""
        with self._handover.attached(self.store):
            read = True  # the first round reads whatever is there
            while not stop.is_set():
                try:
                    offered.clear()
                    await self._fold_offered()
                    if (
                        not read
                        and self.store.known_head > self.state.position
                        and await self.store.appends_answered(
                            ANSWER_WAIT_S,
                            enough=lambda: self._handover.covers(self.store.known_head),
                        )
                    ):
                        await self._fold_offered()  # the gap was an append of ours
                    if (
                        read
                        or self.store.known_head > self.state.position
                        or self._continuity.due(self.store.sessions)  # (a failover?)
                    ):
                        await self._read(None)  # others' commits (or a gap): read them
                    read = False
                    await self.store.wait_for_new(
                        self.state.position, poll_s, wakes=(offered, stopping)
                    )
                except Exception as exc:
                    if not (isinstance(exc, RuntimeServiceError) or is_unreachable(exc)):
                        raise
                    log.warning("live state could not read the log: %s", exc)
                    read = True
                    await first_of(asyncio.sleep(poll_s), stop.wait())

    async def follow_on_demand(self, stop: asyncio.Event) -> None:
        """Follow the log only as far as callers ask, until ``stop`` is set: nothing is
        read on a NOTIFY, each :meth:`fresh` behind its mark reads (module docstring);
        a view that started from a snapshot checks it meanwhile."""
        self._on_demand = True
        try:
            if self.unchecked_start is not None:
                await all_of(check_start(self, stop), stop.wait())
            else:
                await stop.wait()
        finally:
            self._on_demand = False

    async def _fold_offered(self) -> int:
        """Fold the handed-over envelopes that come next (serialised with reads)."""
        if not self._handover:
            return 0
        async with self._read_lock:
            envelopes = self._handover.take()
            if envelopes:
                async with self._fold_lock:
                    for env in envelopes:
                        self._fold(env)
                if self._position_waiters:
                    self._wake_position_waiters()
        return len(envelopes)
