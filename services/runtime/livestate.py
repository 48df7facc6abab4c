"""A live, in-memory view of the log: the fold kept current for one process.

Every service that decides something (admission, reservation, the node agent) needs
the cluster as the log describes it *now*. :class:`LiveState` holds one
:class:`events.fold.ClusterState` and folds into it every event after
``state.position``:

* :meth:`LiveState.catch_up` reads the log after the current position (one keyset
  query; nothing comes back when nothing is new) and folds it. Reads are serialised
  by a lock, so concurrent callers never fold the same event twice; a decision in
  :meth:`LiveState.frozen` only delays the *folding* of what was read, never the
  read itself, so decisions and reads do not queue behind each other; a caller that
  waited for the lock reads again afterwards — unless a read that *began after its
  call* completed meanwhile: that read saw everything this one would, so many
  concurrent callers share one query. When ``catch_up`` returns, the state includes
  every event committed before the call.
* :meth:`LiveState.run` tails the log (``EventStore.wait_for_new``: LISTEN/NOTIFY with a
  timeout as a safety net) and folds as events arrive; it keeps the view warm and
  drives the listeners (the watch publisher of the claims API, the allocated state of
  the reservation service).

Decisions are optimistic: a service decides on ``live.state`` right after
``catch_up()`` and appends with the expected versions of the streams it decided on,
which :meth:`LiveState.stream_version` gives *as of* ``state.position``. If anybody
appended to one of those streams since, the store raises ``ConflictError``; the
service catches up and decides again. So the versions here must never be newer than
the state: they are tracked from the folded envelopes, and for streams that were not
seen since a snapshot they are read from the database bounded by the state's position.

Listeners (``subscribe``) are plain callables run after each envelope is folded, with
the envelope; they must be quick and must not raise (an exception is logged and the
listener is kept). They let a service keep derived indexes incrementally instead of
recomputing them per decision.

An event the fold refuses (``InvariantViolation``) is *skipped*: the log is the source
of truth and is never rewritten, so the view records the violation
(:attr:`LiveState.violations`), logs it, and moves on; ``dracap replay verify`` reports
the same position. The database's own constraints (capacity ledger CHECK, exclusive
holds) are what keep such an event from ever oversubscribing a device.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Final

from events.catalog import (
    DeviceClassApplied,
    DeviceClassRemoved,
    Envelope,
    RequestPolicyChanged,
    ResourceSlicePublished,
    ResourceSliceWithdrawn,
)
from events.errors import InvariantViolation
from events.fold import ClusterState, apply, snapshot_decode
from services.runtime.errors import RuntimeServiceError
from services.runtime.eventstore import Connection, EventStore, iter_rows
from services.runtime.outages import is_unreachable
from services.runtime.rows import envelope_of

__all__ = ["INVENTORY_EVENTS", "Listener", "LiveState"]

log = logging.getLogger("dracap.livestate")

Listener = Callable[[Envelope], None]

#: Events that change what the allocator's inventory is built from.
INVENTORY_EVENTS: Final = (
    DeviceClassApplied,
    DeviceClassRemoved,
    ResourceSlicePublished,
    ResourceSliceWithdrawn,
    RequestPolicyChanged,
)
_VIOLATIONS_KEPT: Final = 100
#: Handed-over envelopes kept at most (beyond that the tailer reads the log instead).
_OFFERED_KEPT: Final = 4096
#: How long catch_up_to() waits for the tailer before it reads the log itself.
TAIL_WAIT_S: Final = 0.5


class LiveState:
    """The fold of the log, kept current (see the module docstring)."""

    def __init__(self, store: EventStore, *, batch_size: int = 1000) -> None:
        self.store = store
        self.state = ClusterState()
        self.batch_size = batch_size
        #: bumped whenever classes, slices or request policies change
        self.inventory_generation = 0
        #: the latest fold refusals (position, message), oldest first
        self.violations: list[tuple[int, str]] = []
        self._versions: dict[str, int] = {}
        self._versions_complete = True  # False after starting from a snapshot
        self._read_lock = asyncio.Lock()  # one log read at a time (callers share it)
        self._fold_lock = asyncio.Lock()  # held by frozen() and while a page is folded
        self._reads_started = 0  # log reads begun by catch_up (numbered from 1)
        self._reads_done = 0  # the number of the latest read that completed
        self._listeners: list[Listener] = []
        self._tailing = False  # run() is tailing the log
        self._position_waiters: list[tuple[int, asyncio.Future[None]]] = []
        #: this process's committed appends not folded yet, by position (see run())
        self._offered: dict[int, Envelope] = {}
        self._offered_wake = asyncio.Event()

    # -- startup -------------------------------------------------------------------------

    async def load_snapshot(self) -> bool:
        """Start from the newest stored snapshot (before any catch-up); True if one was used."""
        if self.state.position:
            raise RuntimeError("load_snapshot() must come before the first catch_up()")
        snapshot = await self.store.load_latest_snapshot()
        if snapshot is None:
            return False
        self.state = snapshot_decode(snapshot.payload)
        self._versions_complete = False
        self.inventory_generation += 1
        return True

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

    def known_version(self, stream: str) -> int:
        """The version of ``stream`` from the folded events only (no database look-up)."""
        return self._versions.get(stream, 0)

    # -- folding -------------------------------------------------------------------------

    def _fold(self, envelope: Envelope) -> None:
        try:
            apply(self.state, envelope)
        except InvariantViolation as exc:
            log.error(
                "fold refused an event; skipping it",
                extra={"event_id": envelope.event_id, "position": envelope.position},
                exc_info=False,
            )
            self.violations.append((envelope.position, str(exc)))
            del self.violations[:-_VIOLATIONS_KEPT]
            self.state.position = max(self.state.position, envelope.position)
        self._versions[envelope.stream] = envelope.stream_version
        if isinstance(envelope.event, INVENTORY_EVENTS):
            self.inventory_generation += 1
        for listener in tuple(self._listeners):
            try:
                listener(envelope)
            except Exception:
                log.exception("state listener failed", extra={"event_id": envelope.event_id})

    async def catch_up(self, connection: Connection | None = None) -> int:
        """Fold every event committed after ``state.position``; returns how many.

        ``connection``: read on it instead of taking one from the pool (a consumer's
        handler passes its transaction's connection, so a handler never waits for a
        second pooled connection while holding one). Its transaction must not hold
        uncommitted appends: they would be folded as if they had happened.
        """
        ticket = self._reads_started + 1  # the first read that starts after this call
        async with self._read_lock:
            if self._reads_done >= ticket:
                return 0  # a read that began after this call has folded everything
            self._reads_started += 1
            read = self._reads_started
            folded = 0
            position = self.state.position
            pages = (
                self.store.read_rows(position, self.batch_size)
                if connection is None
                else iter_rows(connection, position, self.batch_size)
            )
            async for rows in pages:
                envelopes = [envelope_of(row) for row in rows]
                async with self._fold_lock:  # not while a decision holds the state still
                    for envelope in envelopes:
                        self._fold(envelope)
                folded += len(envelopes)
                if self._position_waiters:
                    self._wake_position_waiters()
            self._reads_done = read
        return folded

    async def catch_up_to(self, position: int | None) -> int:
        """Fold at least up to ``position`` (``None``: everything, as :meth:`catch_up`).

        Reads nothing when the state is already there. While :meth:`run` tails the log,
        a caller that is behind waits for the tailer to fold ``position`` (it reads as
        soon as the commit is announced) instead of queueing a read of its own; after
        :data:`TAIL_WAIT_S` it reads itself.
        """
        if position is not None and self.state.position >= position:
            return 0
        if position is not None and self._tailing:
            waiter = asyncio.get_running_loop().create_future()
            self._position_waiters.append((position, waiter))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, TAIL_WAIT_S)
            if self.state.position >= position:
                return 0
        return await self.catch_up()

    def _wake_position_waiters(self) -> None:
        reached, waiting = self.state.position, []
        for position, waiter in self._position_waiters:
            if position <= reached:
                if not waiter.done():
                    waiter.set_result(None)
            elif not waiter.done():
                waiting.append((position, waiter))
        self._position_waiters = waiting

    async def catch_up_seen(self) -> int:
        """Fold every commit this process knows of (:meth:`EventStore.committed_head`).

        Read-your-writes for a request handler: its own appends, and everything the
        log announced, are folded; a commit whose notification is still on its way is
        not waited for. Without a listener it is :meth:`catch_up`.
        """
        return await self.catch_up_to(self.store.committed_head())

    @contextlib.asynccontextmanager
    async def frozen(self) -> AsyncIterator[ClusterState]:
        """Hold the state still: no catch-up folds anything until the block ends.

        A decision that awaits something (a stream version from the database) while
        it reads the state does so inside this block, so the state and the expected
        versions it appends with stay consistent. Reading the log does not wait for
        it — only folding what was read does.
        """
        async with self._fold_lock:
            yield self.state

    async def wait_for(self, position: int, timeout: float) -> bool:  # noqa: ASYNC109
        """Wait until the state has folded ``position`` (catching up itself); False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.state.position < position:
            await self.catch_up()
            if self.state.position >= position:
                break
            left = deadline - loop.time()
            if left <= 0:
                return False
            await self.store.wait_for_new(self.state.position, min(left, 0.5))
        return True

    async def run(self, stop: asyncio.Event, *, poll_s: float = 1.0) -> None:
        """Tail the log until ``stop`` is set (NOTIFY wakes it; ``poll_s`` is the fallback).

        The appends this process's store commits are handed over as they commit
        (``EventStore.on_commit``) and folded without reading them back when they come
        next; whatever else was announced (other processes, a gap) is read. A failing
        read (database restarting) is logged and retried after ``poll_s``.
        """
        self._tailing = True
        handover = self.store.on_commit(self._offer)
        try:
            read = True  # the first round reads whatever is there
            while not stop.is_set():
                try:
                    self._offered_wake.clear()
                    await self._fold_offered()
                    if read or self.store.known_head > self.state.position:
                        await self.catch_up()  # others' commits (or a gap): read them
                    read = False
                    await _first_of(self._next_commit(poll_s), stop)
                except Exception as exc:
                    if not (isinstance(exc, RuntimeServiceError) or is_unreachable(exc)):
                        raise
                    log.warning("live state could not read the log: %s", exc)
                    read = True
                    await _first_of(asyncio.sleep(poll_s), stop)
        finally:
            handover()
            self._offered.clear()
            self._tailing = False

    async def _next_commit(self, poll_s: float) -> None:
        """Until a commit is announced (NOTIFY), handed over, or ``poll_s`` passes."""
        waiter = asyncio.ensure_future(self.store.wait_for_new(self.state.position, poll_s))
        woken = asyncio.ensure_future(self._offered_wake.wait())
        try:
            await asyncio.wait({waiter, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (waiter, woken):
                task.cancel()
            await asyncio.wait({waiter, woken})
        if waiter.done() and not waiter.cancelled() and waiter.exception() is not None:
            waiter.result()  # a failed wait (the database is gone): raise it

    def _offer(self, envelopes: list[Envelope]) -> None:
        """Commit listener: this process's appends, to fold without reading them back."""
        if len(self._offered) > _OFFERED_KEPT:
            return  # far behind: the log is read instead
        for env in envelopes:
            if env.position > self.state.position:
                self._offered[env.position] = env
        self._offered_wake.set()

    async def _fold_offered(self) -> int:
        """Fold the handed-over envelopes that come next (serialised with reads)."""
        if not self._offered:
            return 0
        async with self._read_lock:
            following, envelopes = self.state.position + 1, []
            while (env := self._offered.pop(following, None)) is not None:
                envelopes.append(env)
                following += 1
            for stale in [p for p in self._offered if p <= self.state.position]:
                del self._offered[stale]
            if envelopes:
                async with self._fold_lock:
                    for env in envelopes:
                        self._fold(env)
                if self._position_waiters:
                    self._wake_position_waiters()
        return len(envelopes)


async def _first_of(work: Coroutine[Any, Any, object], stop: asyncio.Event) -> None:
    """Run ``work`` until it finishes or ``stop`` is set, whichever comes first."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, stopper):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending
    if task.done() and not task.cancelled():
        task.result()  # re-raise its failure
