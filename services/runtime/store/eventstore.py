"""The PostgreSQL event store: the append-only log and the guards of its invariants.

Appending
---------
One append is one transaction. Its log part is serialised by the single row of
``event_log_head``: the append's ``UPDATE ... SET position = position + n RETURNING
position`` takes the row lock, held until COMMIT, so positions are handed out gap-free
*in commit order* — the writer that got position p has committed (and become
visible) before any writer can get p + 1, and a rolled-back append rolls the counter
back with it. A reader that tails ``position > last_seen`` never skips a late commit.

Everything done while holding that lock delays every other writer, so an append is one
statement, ``dracap_append_guarded`` (migration 0012, ``migrations/functions/``), sent
outside an explicit transaction so that it commits in the server as it ends and the head
lock is never held across a client round trip. The function checks what it is sent as
data, never trusting it: every payload against the catalog (SQLSTATE ``DR006`` ->
:class:`~services.runtime.ground.errors.InvalidEvent`), the session's job — which event types
under which actor its database user may append (``DR005`` ->
:class:`~services.runtime.ground.errors.AppendForbidden`) —, then under the lock every
stream's version against the expected one (exact: no other append runs concurrently;
``DR001`` -> :class:`~services.runtime.ground.errors.ConflictError`), and inserts the rows
with ``recorded_at`` and stream versions of the database's own, applies the guards it
derives from the events itself (:mod:`events.guards` is their model: the capacity
ledger, held shares, exclusive holds and node epochs; a CHECK violation of the ledger
becomes :class:`~services.runtime.ground.errors.CapacityExceeded`, a second hold of a dedicated
device a :class:`~services.runtime.ground.errors.ConflictError`), and
``pg_notify('dracap_events', head)`` — delivered at commit to
:meth:`EventStore.wait_for_new`, which learns the head from the payload. An append whose
batches carry an admission's quota premise (:class:`~services.runtime.store.appends.
AdmissionPremise`) has it checked in the same statement, after the function and still
under its lock (``dracap_expect_admissions``, migration 0013; a broken premise is
``DR001`` too, on stream ``admissions:<namespace>``). Large appends
(a planning round over a long backlog) take the same path: no login writes the log's
tables itself, so nothing reaches them unchecked.

The store learns the database's clock from every append it makes (the ``recorded_at``
the function returns): :attr:`EventStore.clock` (:mod:`services.runtime.store.dbclock`) is
what a service compares with a ``recorded_at``, never its own clock.

Several stores of one process (one per database role, :mod:`services.runtime.
servicestores`) may share their commit listeners and known head (``sharing=``), so a
reader attached to one hears of the appends made through the others.

The store's LISTEN connection carries other channels too: :meth:`EventStore.on_notice`
calls a function for each NOTIFY on a channel (a consumer keeping a lock while idle
hears there that someone waits for it, :mod:`services.runtime.delivery.consuming`);
the channels are listened to again whenever the connection is opened anew.

A caller that must commit other writes atomically with the events (a consumer's
idempotency row and checkpoint) passes its own ``connection=``; the same statements
then run inside the caller's transaction, without the store's retries.

What an append is made of (:class:`~services.runtime.store.appends.Batch`,
:class:`~services.runtime.store.appends.Metadata`, ...) and how its events are validated
before the statement is sent is :mod:`services.runtime.store.appends`; a bad event raises
:class:`~services.runtime.ground.errors.InvalidEvent` and nothing is written. Transient
failures (serialization failure, deadlock, lost connection, timeouts) are retried a
few times with back-off; everything else is mapped to the typed error tree once.

Reading
-------
:meth:`EventStore.read_all` pages through the log by keyset (``position > $1 ORDER BY
position LIMIT $2``), so memory stays bounded by one batch however long the log is.
Stored payloads are decoded tolerantly with upcasting (``decode_stored``).

Connections come from an asyncpg pool whose sessions act as the URL's own user (a
service kind's, :meth:`~services.runtime.ground.settings.Settings.for_service`) or start with
the app role (``role`` startup parameter, which ``RESET ALL`` does not undo), with the
configured ``statement_timeout``; ``jsonb`` is exchanged as raw bytes, so msgspec's JSON goes to
the server and back without an extra parse.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, Final, TypeVar

import asyncpg
import msgspec

from events.catalog import Event
from events.envelopes import Envelope
from events.eventcodec import decode_stored
from events.folding import Refusal
from services.runtime.ground.errors import (
    ConflictError,
    ConnectionLost,
    InvalidEvent,
    RetryableError,
    RuntimeServiceError,
    StaleEpoch,
    map_database_error,
)
from services.runtime.ground.metrics import LOG_APPEND_DURATION
from services.runtime.ground.settings import Settings
from services.runtime.ground.waiting import Signal
from services.runtime.store.appends import (
    Batch,
    Metadata,
    Pending,
    Processed,
    agent_epoch,
    moved_versions,
    pending_of,
    stored_envelopes,
)
from services.runtime.store.continuity import Continuity
from services.runtime.store.dbclock import DatabaseClock
from services.runtime.store.failover import (
    Connector,
    Deadline,
    connect_through,
    is_ambiguous,
    quiet_pool_log,
)
from services.runtime.store.rows import SELECT, decoded, envelope_of, envelope_with

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

CHANNEL: Final = "dracap_events"
#: What :meth:`EventStore.on_notice` calls: (the notifying backend's pid, the payload).
Notice = Callable[[int, str], None]
#: How long a reader waits for this process's appends in flight to be answered before it
#: reads a gap from the log (:meth:`EventStore.appends_answered`): an append's answer
#: normally follows its NOTIFY by less than a round trip; one that retries through a
#: failover is not waited for.
ANSWER_WAIT_S: Final = 0.1
Connection = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy


class Snapshot(msgspec.Struct, frozen=True):
    """A stored snapshot: state folded up to and including ``position``."""

    position: int
    schema_version: int
    payload: bytes
    created_at: datetime.datetime


# --- connection setup ---------------------------------------------------------------------


class _Opened:
    """How many sessions a store has opened (its pool's and its listener's)."""

    def __init__(self) -> None:
        self.count = 0

    async def init(self, connection: asyncpg.Connection) -> None:
        """The pool's ``init``: counted, then set up like every connection."""
        self.count += 1
        await _init_connection(connection)


async def _init_connection(connection: asyncpg.Connection) -> None:
    await connection.set_type_codec(
        "jsonb",
        schema="pg_catalog",
        format="binary",
        encoder=lambda data: b"\x01" + data,
        decoder=lambda data: data[1:],
    )


async def _verified(pool: asyncpg.Pool, continuity: Continuity, store: EventStore) -> None:
    async with pool.acquire() as connection:
        await continuity.check(connection, store.sessions)


async def _keep_session(connection: asyncpg.Connection) -> None:
    """The pool's reset on release: nothing beyond asyncpg's own local clean-up.

    asyncpg's default reset sends ``RESET ALL; UNLISTEN *; CLOSE ALL; ...`` on every
    release, a round trip per pooled operation. dracap's pooled sessions never change
    session state (no ``SET``, no ``LISTEN`` — the listener has its own connection —,
    no advisory locks, no cursors held across a release), and asyncpg still rolls back
    a transaction left open before this runs, so the query would undo nothing.
    """


def server_settings(settings: Settings) -> dict[str, str]:
    """Session parameters of every dracap connection."""
    out = {"statement_timeout": str(settings.statement_timeout_ms), "application_name": "dracap"}
    if settings.app_role:
        out["role"] = settings.app_role
    return out


def _expire(waiter: asyncio.Future[object]) -> None:
    """A wait's timer: end the wait (``None``: neither a notification nor a signal)."""
    if not waiter.done():
        waiter.set_result(None)


def session_gone(connection: Any) -> bool:
    """Whether a pooled connection's session is gone. asyncpg takes a connection that
    closed back into its pool at once and detaches the caller's proxy, whose
    ``is_closed()`` then raises instead of answering."""
    try:
        closed: bool = connection.is_closed()
    except asyncpg.InterfaceError:
        return True
    return closed


async def connect(settings: Settings, *, through_failover: bool = False) -> asyncpg.Connection:
    """One connection set up like the pool's (app role, timeout, jsonb as bytes);
    ``through_failover``: tried again while no host accepts writes
    (:func:`services.runtime.store.failover.connect_through`)."""
    options: dict[str, Any] = {"server_settings": server_settings(settings)}
    if through_failover:
        timeout = settings.failover_timeout_s
        connection = await connect_through(settings.database_url, timeout, **options)
    else:
        connection = await asyncpg.connect(settings.database_url, **options)
    await _init_connection(connection)
    return connection


@contextlib.asynccontextmanager
async def connected(settings: Settings) -> AsyncIterator[asyncpg.Connection]:
    """:func:`connect`, the connection closed on exit."""
    connection = await connect(settings)
    try:
        yield connection
    finally:
        await connection.close()


# --- the store -----------------------------------------------------------------------------


async def iter_rows(
    connection: Connection,
    from_position: int = 0,
    batch_size: int = 5000,
    to_position: int | None = None,
) -> AsyncIterator[list[asyncpg.Record]]:
    """Pages of raw event rows after ``from_position`` (keyset pagination by position).

    The next page is requested before the current one is handed out, so the server
    reads it while the caller decodes and folds (at most two pages in memory).
    """
    limit = to_position if to_position is not None else 2**63 - 1
    sql = f"{SELECT} WHERE position > $1 AND position <= $2 ORDER BY position LIMIT $3"

    def page(after: int) -> asyncio.Task[list[asyncpg.Record]]:
        return asyncio.ensure_future(connection.fetch(sql, after, limit, batch_size))

    pending: asyncio.Task[list[asyncpg.Record]] | None = page(from_position)
    try:
        while pending is not None:
            rows = await pending
            pending = None
            if not rows:
                return
            if len(rows) == batch_size:
                pending = page(rows[-1][0])
            yield rows
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending


class _Commits:
    """What the stores of one process share: who hears of their commits, and the newest
    head any of them heard of (NOTIFY, a read, a commit of its own)."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[list[Envelope]], None]] = []
        self.head = 0
        self.clock = DatabaseClock()
        #: appends sent and not yet answered (each done once its commit was reported)
        self.in_flight: set[asyncio.Future[None]] = set()


class EventStore:
    """Append-only event log with the database's guards (see the module docstring)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        settings: Settings,
        *,
        sharing: EventStore | None = None,
        opened: _Opened | None = None,
    ) -> None:
        self._pool = pool
        self._opened = opened or _Opened()
        self._settings = settings
        self._listener: asyncpg.Connection | None = None
        self._listener_lock = asyncio.Lock()
        self._closed = False
        #: resolved by each NOTIFY: True when it named a head, False when not
        self._waiters: set[asyncio.Future[object]] = set()
        #: channel -> what to call with (sending backend's pid, payload) per NOTIFY
        self._notices: dict[str, list[Notice]] = {}
        # listeners and the highest head announced by NOTIFY (or read at LISTEN), shared
        # with the stores this one was opened alongside
        self._commits: _Commits = _Commits() if sharing is None else sharing._commits
        #: the database's clock, learnt from this store's appends (shared like the commits)
        self.clock: DatabaseClock = self._commits.clock

    @classmethod
    async def open(cls, settings: Settings, *, sharing: EventStore | None = None) -> EventStore:
        """A store with a fresh connection pool for ``settings``.

        ``sharing``: another store of this process (connecting as another database role)
        whose commit listeners and known head this one shares, so that a reader attached
        to either hears of the appends of both (:mod:`services.runtime.store.servicestores`).
        """
        connector = Connector(settings.failover_timeout_s)
        quiet_pool_log()
        opened = _Opened()
        pool = await asyncpg.create_pool(
            settings.database_url,
            min_size=settings.pool_min_size,
            max_size=settings.pool_max_size,
            init=opened.init,
            reset=_keep_session,
            server_settings=server_settings(settings),
            connect=connector,
        )
        connector.opened()  # from here on a connect rides out a failover
        return cls(pool, settings, sharing=sharing, opened=opened)

    async def close(self) -> None:
        """Close the listener connection and the pool."""
        async with self._listener_lock:
            self._closed = True
            if self._listener is not None:
                await self._listener.close()
                self._listener = None
        await self._pool.close()

    async def __aenter__(self) -> EventStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def pool(self) -> asyncpg.Pool:
        """The connection pool (for services that read or write tables of their own)."""
        return self._pool

    # -- appending ---------------------------------------------------------------------

    async def append(
        self,
        stream: str,
        expected_version: int | None,
        events: Sequence[Event],
        *,
        actor: str,
        namespace: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        connection: Connection | None = None,
    ) -> list[Envelope]:
        """Append ``events`` to ``stream`` if it is at ``expected_version``.

        ``connection``: as for :meth:`append_many`.
        """
        meta = Metadata(
            actor=actor,
            namespace=namespace,
            correlation_id=correlation_id,
            causation_id=causation_id,
        )
        return await self.append_many(
            [Batch(stream, expected_version, events)], meta, connection=connection
        )

    async def append_many(
        self,
        batches: Sequence[Batch | tuple[str, int | None, Sequence[Event]]],
        meta: Metadata,
        *,
        connection: Connection | None = None,
        processed: Processed | None = None,
    ) -> list[Envelope]:
        """Append several streams' events atomically: all or nothing.

        With ``connection`` the append runs on the caller's connection, inside the
        caller's open transaction (or a transaction of its own if none is open), so it
        commits or rolls back together with the caller's other writes. It is then not
        retried — a failed statement aborts the caller's transaction, so retrying is
        the caller's decision — and errors are mapped to the runtime error tree.
        ``processed``: bus messages recorded as handled in the same commit.
        """
        typed = [b if isinstance(b, Batch) else Batch(*b) for b in batches]
        streams = [b.stream for b in typed]
        if len(set(streams)) != len(streams):
            raise InvalidEvent("a stream appears twice in one append")
        pending = pending_of(typed, meta)
        if processed is not None:
            pending = msgspec.structs.replace(pending, processed=processed)
        if not pending.events:
            return []
        first = streams[0] if len(streams) == 1 else None
        if connection is None:
            with self._in_flight():
                return await self._append_retrying(typed, pending, first)
        if connection.is_in_transaction():  # the caller commits: nothing to report
            return await self._write_on(connection, typed, pending, first)
        with self._in_flight():
            stored = await self._write_on(connection, typed, pending, first)
            self._committed(stored, pending)
            return stored

    async def _write_on(
        self, connection: Connection, batches: Sequence[Batch], pending: Pending, first: str | None
    ) -> list[Envelope]:
        try:
            return await self._write(connection, batches, pending)
        except RuntimeServiceError:
            raise
        except Exception as exc:
            raise map_database_error(exc, stream=first) from exc

    @contextlib.contextmanager
    def _in_flight(self) -> Iterator[None]:
        """An append this store will report (or fail) when the block ends."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        in_flight = self._commits.in_flight
        in_flight.add(done)
        try:
            yield
        finally:
            in_flight.discard(done)
            done.set_result(None)

    async def appends_answered(
        self, within: float, *, enough: Callable[[], bool] = lambda: False
    ) -> bool:
        """Wait (up to ``within`` seconds) for the appends of this process in flight now,
        or until ``enough()`` says, after one of them is answered, that the reader need
        not wait for the rest; False at once when there are none.

        For a reader that heard of a head past its position and found no commit handed
        over for the gap: when this process has appends in flight, the gap is most
        likely one of them — committed, its NOTIFY already in, its answer not yet —
        and its commit is handed over as it is answered, with no read of the log.
        ``enough`` is the reader's "every commit up to the head I heard of is handed
        over": the other appends in flight were not announced, and may not even have
        reached the database yet (waiting for a connection of the pool, or for the
        log's head lock), and under load waiting for all of them held every reader —
        the relay, so every stage of every claim — for up to ``within`` (issue 25's
        half-rate tail).
        """
        waiting = set(self._commits.in_flight)
        if not waiting:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while waiting and not enough():
            left = deadline - loop.time()
            if left <= 0:
                break
            _, waiting = await asyncio.wait(
                waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
        return True

    async def _append_retrying(
        self, batches: Sequence[Batch], pending: Pending, stream: str | None
    ) -> list[Envelope]:
        """:meth:`_append_pooled` until it succeeds, fails for good, or a failover
        outlasts its deadline; an append that may have been committed before its
        connection broke is looked up by its event ids before it is sent again
        (:mod:`services.runtime.store.failover`)."""
        deadline = Deadline(self._settings.failover_timeout_s)
        ambiguous = False  # an earlier try may have been committed
        while True:
            try:
                if ambiguous and (stored := await self._stored_already(pending)):
                    return self._found_committed(stored, pending)
                return await self._append_pooled(batches, pending)
            except Exception as exc:
                mapped = map_database_error(exc, stream=stream)
                # the earlier try may have committed meanwhile (its server was slow, not
                # dead): then this try clashed with it, not with somebody else
                conflict = ambiguous and isinstance(mapped, ConflictError)
                if conflict and (stored := await self._stored_already(pending)):
                    return self._found_committed(stored, pending)
                if not isinstance(mapped, RetryableError) or not await deadline.wait():
                    if mapped is exc:
                        raise
                    raise mapped from exc
                ambiguous = ambiguous or is_ambiguous(exc)

    def _found_committed(self, stored: list[Envelope], pending: Pending) -> list[Envelope]:
        _log.info("an append whose connection broke had been committed: not written again")
        self._committed(stored, pending)
        return stored

    async def _stored_already(self, pending: Pending) -> list[Envelope]:
        """The stored envelopes of ``pending`` when the log holds its events (an earlier
        try committed them); else an empty list. One append is one transaction: its
        first event is there exactly when all of them are."""
        rows = await self._pool.fetch(
            f"{SELECT} WHERE event_id = ANY($1::uuid[]) ORDER BY position", pending.event_ids
        )
        return [envelope_of(row) for row in rows]

    async def _append_pooled(self, batches: Sequence[Batch], pending: Pending) -> list[Envelope]:
        async with self._pool.acquire() as connection:
            try:
                stored = await self._write(connection, batches, pending)
            except asyncpg.ReadOnlySQLTransactionError:
                connection.terminate()  # a demoted primary: connect again, to the new one
                raise
            except Exception as exc:
                if session_gone(connection):  # whatever asyncpg raised: the session broke
                    raise ConnectionLost(f"connection lost during an append: {exc}") from exc
                raise
        self._committed(stored, pending)
        return stored

    def on_commit(self, listener: Callable[[list[Envelope]], None]) -> Callable[[], None]:
        """Call ``listener(envelopes)`` after each append this store commits itself.

        The envelopes are what a reader of the log would get (events decoded from the
        stored payloads). Appends made inside a caller's transaction are not reported
        (the store does not see that commit). Returns an unsubscriber.
        """
        listeners = self._commits.listeners
        listeners.append(listener)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                listeners.remove(listener)

        return unsubscribe

    def _committed(self, stored: list[Envelope], pending: Pending) -> None:
        commits = self._commits
        commits.head = max(commits.head, stored[-1].position)
        if not commits.listeners:
            return
        # as a reader of the log gets them: each event decoded from its stored payload
        logged = [
            msgspec.structs.replace(env, event=decode_stored(payload, tag, version))
            for env, payload, tag, version in zip(
                stored, pending.payloads, pending.types, pending.schema_versions, strict=True
            )
        ]
        for listener in tuple(commits.listeners):
            try:
                listener(logged)
            except Exception:
                _log.exception("commit listener failed")

    async def _write(
        self, connection: Connection, batches: Sequence[Batch], pending: Pending
    ) -> list[Envelope]:
        """One append on ``connection``: one call of ``dracap_append_guarded``."""
        count, processed = len(pending.events), pending.processed
        premises = [b.premise for b in batches if b.premise is not None]
        sent = time.monotonic()
        with LOG_APPEND_DURATION.time():
            row = await connection.fetchrow(
                _APPEND_EXPECTING if premises else _APPEND,
                count,
                [b.stream for b in batches],
                [b.expected_version for b in batches],
                pending.event_ids,
                pending.streams,
                pending.types,
                pending.schema_versions,
                pending.namespaces,
                pending.meta.actor,
                pending.correlation_ids,
                pending.causation_ids,
                pending.payloads,
                *((None, None) if processed is None else (processed.consumer, processed.event_ids)),
                *((msgspec.json.encode(premises),) if premises else ()),
            )
        assert row is not None  # the function returns exactly one row
        head: int = row[0]
        recorded_at: datetime.datetime = row[3]
        self.clock.observe(recorded_at, sent, time.monotonic())
        if row[2] is not None:  # a stale epoch: the function logged the refusal instead
            epoch = agent_epoch(pending.meta.actor)
            assert epoch is not None
            raise StaleEpoch(epoch[0], epoch[1], row[2])
        current = {
            b.stream: version if b.expected_version is None else 0
            for b, version in zip(batches, row[1], strict=True)
        }
        positions = list(range(head - count + 1, head + 1))
        return stored_envelopes(pending, positions, moved_versions(pending, current), recorded_at)

    async def renew_leases(self, leases: Mapping[str, int]) -> set[str]:
        """Renew every node's lease ``node -> epoch`` in one statement
        (``dracap_renew_leases``, migration 0011); returns the nodes renewed. A lease that
        is not the node's any more, ran out or was expired or fenced in the log is lost:
        its node is not returned, and its agent must take a new lease."""
        if not leases:
            return set()
        rows = await self._pool.fetch(
            "SELECT * FROM dracap_renew_leases($1::text[], $2::bigint[])",
            list(leases),
            list(leases.values()),
        )
        return {row[0] for row in rows}

    # -- reading -------------------------------------------------------------------------

    async def reading(self, read: Callable[[asyncpg.Pool], Awaitable[_T]]) -> _T:
        """``read(pool)``, asked again while the failure is one a failover makes (a lost
        session, no primary yet) until the failover deadline; then a
        :class:`~services.runtime.ground.errors.RetryableError`. For reads only: it may run
        twice. Other failures pass through unchanged."""
        deadline = Deadline(self._settings.failover_timeout_s)
        while True:
            try:
                return await read(self._pool)
            except Exception as exc:
                error = map_database_error(exc)
                if not isinstance(error, RetryableError):
                    raise
                if not await deadline.wait():
                    raise error from exc

    async def head(self) -> int:
        """Position of the newest committed event (0 for an empty log)."""
        position: int = await self.reading(
            lambda pool: pool.fetchval("SELECT position FROM event_log_head")
        )
        return position

    async def stream_version(self, stream: str) -> int:
        """Current version of ``stream`` (0 if it has no events)."""
        version: int | None = await self._pool.fetchval(
            "SELECT max(stream_version) FROM events WHERE stream = $1", stream
        )
        return version or 0

    async def read_stream(self, stream: str, from_version: int = 1) -> list[Envelope]:
        """All events of ``stream`` from ``from_version`` on, in version order."""
        rows = await self._pool.fetch(
            f"{SELECT} WHERE stream = $1 AND stream_version >= $2 ORDER BY stream_version",
            stream,
            from_version,
        )
        return [envelope_of(row) for row in rows]

    async def read_positions(self, positions: Sequence[int]) -> list[Envelope]:
        """The events stored at ``positions`` (those that exist and decode: the fold's
        driver refuses the others, :mod:`events.folding`), in position order."""
        rows = await self._pool.fetch(
            f"{SELECT} WHERE position = ANY($1::bigint[]) ORDER BY position", list(positions)
        )
        out = []
        for row in rows:
            event = decoded(row)
            if not isinstance(event, Refusal):
                out.append(envelope_with(row, event))
        return out

    async def holds_event(self, event_id: str) -> bool:
        """Whether the log holds an event with this id (a UUID string)."""
        found: bool = await self._pool.fetchval(
            "SELECT EXISTS (SELECT 1 FROM events WHERE event_id = $1::uuid)", event_id
        )
        return found

    @property
    def sessions(self) -> int:
        """How many database sessions this store has opened (a reader compares what it
        read last with the log after each new one: :mod:`services.runtime.store.continuity`)."""
        return self._opened.count

    async def read_rows(
        self,
        from_position: int = 0,
        batch_size: int = 1000,
        to_position: int | None = None,
        *,
        continuity: Continuity | None = None,
    ) -> AsyncGenerator[list[asyncpg.Record], None]:
        """Raw rows after ``from_position`` (up to ``to_position``), one batch at a time.

        A failure the failover deadline covers (a lost connection, no primary yet) reads
        on from the last row handed out, on a new connection, until the deadline.
        ``continuity``: what the reader read last, compared with the log first when a
        session was opened since (:class:`~services.runtime.ground.errors.LogDiverged`
        when it differs) and kept up to date with the rows handed out."""
        deadline = Deadline(self._settings.failover_timeout_s)
        position = from_position
        while True:
            lost = False
            try:
                async with self._pool.acquire() as connection:
                    try:
                        if continuity is not None:
                            await continuity.check(connection, self.sessions)
                        async for rows in iter_rows(connection, position, batch_size, to_position):
                            position = rows[-1][0]
                            if continuity is not None:
                                continuity.saw(rows)
                            yield rows
                    except Exception:  # (not GeneratorExit: a reader that stopped early)
                        lost = session_gone(connection)
                        raise
                return
            except Exception as exc:
                retryable = lost or isinstance(map_database_error(exc), RetryableError)
                if not retryable or not await deadline.wait():
                    raise

    async def verify(self, continuity: Continuity) -> None:
        """Compare what a reader read last with the log now, if a session was opened since
        (:mod:`services.runtime.store.continuity`); asked again through a failover."""
        if continuity.due(self.sessions):
            await self.reading(lambda pool: _verified(pool, continuity, self))

    async def read_all(
        self, from_position: int = 0, batch_size: int = 1000, to_position: int | None = None
    ) -> AsyncIterator[Envelope]:
        """Every event after ``from_position`` in position order; memory: one batch."""
        async for rows in self.read_rows(from_position, batch_size, to_position):
            for row in rows:
                yield envelope_of(row)

    # -- tailing -------------------------------------------------------------------------

    @property
    def known_head(self) -> int:
        """The newest head this store (or one it shares commits with) has heard of
        (NOTIFY, its own commits), without asking the database."""
        return self._commits.head

    def committed_head(self) -> int | None:
        """A head every commit this process has seen is at or below; None if not listening.

        The newest of: what NOTIFY announced, and what this store (or a store it shares
        commits with) appended and committed (its own NOTIFY may still be on the way).
        ``None`` until
        :meth:`wait_for_new` has started the listener.
        """
        return self._commits.head if self._listener is not None else None

    async def on_notice(self, channel: str, notice: Notice) -> Callable[[], None]:
        """Call ``notice(pid, payload)`` for every NOTIFY on ``channel`` from now on (the
        store's LISTEN connection, opened here if need be; notifications sent while it is
        being opened again after a failure are lost). Returns what stops the calls."""
        first = channel not in self._notices
        self._notices.setdefault(channel, []).append(notice)
        async with self._listener_lock:
            listener = self._listener
            if first and listener is not None and not listener.is_closed():
                await listener.add_listener(channel, self._noticed)
        await self._listen()  # opened (again) with every channel if it was not open

        def forget() -> None:
            with contextlib.suppress(ValueError):
                self._notices.get(channel, []).remove(notice)

        return forget

    def _noticed(self, _connection: object, pid: int, channel: str, payload: object) -> None:
        for notice in list(self._notices.get(channel, ())):
            notice(pid, str(payload))

    def _notified(self, _connection: object, _pid: int, _channel: str, payload: object) -> None:
        try:
            self._commits.head = max(self._commits.head, int(str(payload)))
            announced = True
        except ValueError:  # not ours: wake the waiters anyway, to read the head
            announced = False
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(announced)

    async def _listen(self) -> None:
        # Several tasks tail one store; the lock makes sure only one of them opens the
        # LISTEN connection (two racing opens would leak one), and none after close().
        async with self._listener_lock:
            if self._closed:
                raise RetryableError("the event store is closed")
            if self._listener is not None and self._listener.is_closed():
                self._listener = None  # the server went away with it: listen anew
            if self._listener is None:
                listener = await connect(self._settings, through_failover=True)
                self._opened.count += 1
                try:
                    await listener.add_listener(CHANNEL, self._notified)
                    for channel in self._notices:
                        await listener.add_listener(channel, self._noticed)
                    # Listening from here on: the head read now plus every NOTIFY after
                    # it is the head at any later moment.
                    position = await self._read_head(listener)
                except BaseException:
                    await listener.close()
                    raise
                self._commits.head = max(self._commits.head, position)
                self._listener = listener

    async def wait_for_new(
        self,
        after_position: int,
        timeout: float,  # noqa: ASYNC109
        *,
        wakes: Sequence[Signal] = (),
    ) -> int:
        """Wait until the log's head passes ``after_position``, one of ``wakes`` is set,
        or ``timeout`` runs out.

        Returns the head position (``after_position`` or less on a timeout, or when a
        signal woke it). The head comes from the NOTIFY payloads (each append announces
        its new head), so a waiter costs no query; only a wait that times out reads the
        head from the database, in case a notification was lost with a broken listener
        connection (and one woken by a notification that names no head). A notification
        of a head the caller has already reached — its own append, folded or published
        from the commit before the NOTIFY came — is no news: the wait goes on for the
        time left. (It used to end there and read the head: a statement for nothing,
        about one in eight claims at 30 claims/s.)

        ``wakes``: the loop's other reasons to wake (an offered commit, its stop), all
        waited for on the one future, with a timer — no task, no shield
        (:class:`~services.runtime.ground.waiting.Signal`); a signal set already
        returns at once.
        """
        await self._listen()
        if self._commits.head > after_position or any(s.is_set() for s in wakes):
            return self._commits.head
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (left := deadline - loop.time()) > 0:
            waiter: asyncio.Future[object] = loop.create_future()
            self._waiters.add(waiter)
            for signal in wakes:
                signal.wake(waiter)
            timer = loop.call_later(left, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiters.discard(waiter)
                for signal in wakes:
                    signal.unwake(waiter)
            if self._commits.head > after_position or any(s.is_set() for s in wakes):
                return self._commits.head
            if waiter.result() is not True:
                break  # the time ran out, or a notification without a head
        head = await self._read_head(self._pool)
        self._commits.head = max(self._commits.head, head)
        return head

    async def _read_head(self, connection: Any) -> int:
        """The head, and the database's clock learnt on the way (a reader that never
        appends learns it here: at start and whenever a wait runs out)."""
        sent = time.monotonic()
        row = await connection.fetchrow("SELECT position, clock_timestamp() FROM event_log_head")
        self.clock.observe(row[1], sent, time.monotonic())
        position: int = row[0]
        return position

    # -- snapshots -----------------------------------------------------------------------

    async def save_snapshot(self, position: int, payload: bytes, schema_version: int = 1) -> None:
        """Store a snapshot of the state folded up to ``position`` (replacing one there)."""
        await self._pool.execute(
            "INSERT INTO snapshots (position, schema_version, payload) VALUES ($1, $2, $3) "
            "ON CONFLICT (position) DO UPDATE SET payload = EXCLUDED.payload, "
            "schema_version = EXCLUDED.schema_version, created_at = now()",
            position,
            schema_version,
            payload,
        )

    async def load_latest_snapshot(self, at_or_before: int | None = None) -> Snapshot | None:
        """The newest snapshot (at or before ``at_or_before`` when given)."""
        row = await self.reading(
            lambda pool: pool.fetchrow(
                "SELECT position, schema_version, payload, created_at FROM snapshots "
                "WHERE position <= $1 ORDER BY position DESC LIMIT 1",
                at_or_before if at_or_before is not None else 2**63 - 1,
            )
        )
        if row is None:
            return None
        return Snapshot(row[0], row[1], bytes(row[2]), row[3])


_APPEND: Final = (
    "SELECT head, currents, refused, recorded_at FROM dracap_append_guarded($1, $2, $3, $4, "
    "$5, $6, $7, $8, $9, $10, $11, $12, $13, $14)"
)
#: The same with the quota premises of admissions (``appends.AdmissionPremise``), checked
#: in the same statement after the append, under its head lock (migration 0013); the
#: events before this append's own are the ones a premise may not find.
_APPEND_EXPECTING: Final = (
    "SELECT a.head, a.currents, a.refused, a.recorded_at, "
    "dracap_expect_admissions(a.head - $1, $15) FROM dracap_append_guarded($1, $2, $3, $4, "
    "$5, $6, $7, $8, $9, $10, $11, $12, $13, $14) AS a"
)
#: Record bus messages as handled by a consumer; returns the ids that were new.
MARK_PROCESSED: Final = (
    "INSERT INTO processed_messages (consumer, event_id) SELECT $1, unnest($2::uuid[]) "
    "ON CONFLICT DO NOTHING RETURNING event_id::text"
)
