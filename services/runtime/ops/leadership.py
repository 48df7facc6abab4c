"""One active instance of a service, the others standing by: a session lock in PostgreSQL.

Most services are safe as N active replicas (their effects meet in the database, under
its constraints and guards). A few are right only as one active instance: the relay
(one publisher keeps the stream in the log's order and publishes each event once,
without leaning on JetStream's duplicate window) and the snapshot writer (one writer
does the encoding once). Each of their replicas runs a :class:`Leadership` with the
service's key; the one granted the lock is *active* and runs the service's work, the
others stand by and ask again every ``retry_s``.

The lease is PostgreSQL's own, not a hand-rolled election: a session-level advisory
lock (``pg_try_advisory_lock(key)``) taken on a connection of its own (never a pooled
one), which the server releases when the session ends — however it ends:

* **a crash** (kill -9, the node lost with a FIN or RST): the kernel closes the socket,
  the server ends the session at once, and a standby is granted the lock at its next
  try: the takeover takes at most ``retry_s`` plus the new one's start;
* **a pause or a partition** (SIGSTOP, a frozen VM, a cable): the socket stays open.
  The session is opened with ``idle_session_timeout = ttl_s``, and the holder pings it
  (``SELECT 1``) every ``ttl_s / 4``; a holder that cannot for ``ttl_s`` has its session
  ended by the server, and a standby takes over within ``ttl_s + retry_s``;
* **a failover** of the database: the new primary holds no locks, and the holder's
  session died with the old primary. The holder learns it at its next ping (at most
  ``ttl_s / 4``) and stands by; every instance asks the new primary.

Fencing: the holder counts itself active only until the send time of its last
answered ping plus ``ttl_s`` — the server cannot have ended the session before that —
and :meth:`Leadership.active` says so; the work asks it before each thing it does
(the relay: before each window), and gets :class:`~services.runtime.ground.errors.NotActive`
from :meth:`Leadership.check`. When the lock is lost the work's stop event is set at
once; it finishes what is in flight and returns, and the instance stands by again.
What two instances can still do at once is bounded: the old holder's last window
in flight, and during a failover up to ``ttl_s / 4`` of work before its ping fails.
For the relay that overlap re-publishes event ids JetStream drops as duplicates
(:mod:`services.runtime.delivery.relaying`, "Exactly once"), in the log's order; for the
snapshot writer two writers are harmless (the same position gets the same fold).

``dracap_service_active{service}`` is 1 while this instance is the active one. The
instants and waits are a :class:`~services.runtime.ground.clock.Clock`'s (the system's as it
runs); a ping's own timeout is the network's, in real seconds, as is the server's idle
timeout that the holder's count of its lease stays inside.

Every database login can take an advisory lock (PostgreSQL grants
``pg_try_advisory_lock`` to everyone), so a login that takes a service's key stalls
its takeover; the keys are dracap's own and documented, like the planner's
(``docs/operations.md``, "High availability").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Final

import asyncpg

from services.runtime.ground.clock import SYSTEM, Clock
from services.runtime.ground.errors import NotActive
from services.runtime.ground.metrics import SERVICE_ACTIVE
from services.runtime.ground.outages import StateLog
from services.runtime.ground.settings import Settings
from services.runtime.ground.waiting import first_of
from services.runtime.store.eventstore import server_settings

__all__ = [
    "RELAY_KEY",
    "RETRY_S",
    "SNAPSHOT_WRITER_KEY",
    "TTL_S",
    "Leadership",
]

_log = logging.getLogger("dracap.leadership")

#: The advisory lock keys of the single-active services ("dracap" + a number, beside
#: the reservation planner's ``0x64726163_61700001``).
RELAY_KEY: Final = 0x64726163_61700010
SNAPSHOT_WRITER_KEY: Final = 0x64726163_61700011
#: How long a holder that cannot ping keeps the lease (its session's idle timeout).
TTL_S: Final = 5.0
#: How often a standby asks for the lock.
RETRY_S: Final = 0.5

Work = Callable[[asyncio.Event], Awaitable[None]]


class Leadership:
    """The lease of one single-active service, for this instance (module docstring)."""

    def __init__(
        self,
        settings: Settings,
        key: int,
        service: str,
        *,
        ttl_s: float = TTL_S,
        retry_s: float = RETRY_S,
        clock: Clock = SYSTEM,
    ) -> None:
        if ttl_s <= 0 or retry_s <= 0:
            raise ValueError("ttl_s and retry_s must be positive")
        self._settings = settings
        self._key = key
        self.service = service
        self._ttl_s = ttl_s
        self._retry_s = retry_s
        self._clock = clock
        self._valid_until = 0.0  # monotonic: active until then, unless told otherwise
        self._trouble = StateLog(_log, f"{service} lease")
        self.terms = 0  #: times this instance became the active one
        SERVICE_ACTIVE.labels(service).set(0)

    def active(self) -> bool:
        """Whether this instance holds the lease now (as far as it can know)."""
        return self._clock.monotonic() < self._valid_until

    def check(self) -> None:
        """Raise :class:`NotActive` unless :meth:`active`."""
        if not self.active():
            raise NotActive(f"this {self.service} does not hold its lease")

    async def run(self, stop: asyncio.Event, work: Work) -> None:
        """Stand by until granted the lease, run ``work(its_stop)`` while it is held, and
        again, until ``stop`` is set."""
        while not stop.is_set():
            connection = await self._acquire(stop)
            if connection is None:
                return
            try:
                await self._lead(connection, stop, work)
            finally:
                self._valid_until = 0.0
                SERVICE_ACTIVE.labels(self.service).set(0)
                await _close(connection)

    async def _lead(self, connection: asyncpg.Connection, stop: asyncio.Event, work: Work) -> None:
        self.terms += 1
        SERVICE_ACTIVE.labels(self.service).set(1)
        _log.info("%s active (lease granted)", self.service)
        lost = asyncio.Event()
        its_stop = asyncio.Event()
        keeper = asyncio.create_task(self._keep(connection, lost))

        async def watch() -> None:
            await first_of(stop.wait(), lost.wait())
            its_stop.set()

        watcher = asyncio.create_task(watch())
        try:
            await work(its_stop)
        finally:
            for task in (keeper, watcher):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if lost.is_set() and not stop.is_set():
            _log.warning("%s lost its lease; standing by", self.service)

    async def _acquire(self, stop: asyncio.Event) -> asyncpg.Connection | None:
        """A connection whose session holds the lock; ``None`` once ``stop`` is set."""
        connection: asyncpg.Connection | None = None
        try:
            while not stop.is_set():
                try:
                    if connection is None or connection.is_closed():
                        connection = await self._connect()
                    sent = self._clock.monotonic()
                    if await connection.fetchval("SELECT pg_try_advisory_lock($1)", self._key):
                        self._valid_until = sent + self._ttl_s
                        self._trouble.recovered()
                        held, connection = connection, None
                        return held
                except Exception as exc:  # the server is away: stand by and ask again
                    self._trouble.failed(exc, "standing by")
                    if connection is not None:
                        await _close(connection)
                        connection = None
                await self._clock.wait(stop, self._retry_s)
            return None
        finally:
            if connection is not None:
                await _close(connection)

    async def _connect(self) -> asyncpg.Connection:
        options = server_settings(self._settings)
        options["idle_session_timeout"] = str(round(self._ttl_s * 1000))
        options["application_name"] = f"dracap-{self.service}-lease"
        # a plain connect, no failover deadline: a standby asks again anyway, and a stop
        # is heard between tries
        connection: asyncpg.Connection = await asyncpg.connect(
            self._settings.database_url, timeout=self._ttl_s, server_settings=options
        )
        return connection

    async def _keep(self, connection: asyncpg.Connection, lost: asyncio.Event) -> None:
        """Ping the session every ``ttl_s / 4``; set ``lost`` when it ends or the lease
        runs out unanswered."""
        interval = self._ttl_s / 4
        while True:
            sent = self._clock.monotonic()
            left = self._valid_until - sent
            try:
                async with asyncio.timeout(max(0.0, min(interval, left))):
                    await connection.fetchval("SELECT 1")
            except Exception:  # the session ended (or did not answer while the lease ran)
                if not self.active() or connection.is_closed():
                    self._valid_until = 0.0
                    lost.set()
                    return
                # a slow answer (or a session still busy with the one given up): ask
                # again while the lease lasts
                await self._clock.sleep(min(interval / 4, max(0.0, self._valid_until - sent)))
                continue
            self._valid_until = sent + self._ttl_s
            await self._clock.sleep(interval)


async def _close(connection: asyncpg.Connection) -> None:
    """Close a lease's connection (its session's lock goes with it)."""
    try:
        async with asyncio.timeout(2):
            await connection.close()
    except Exception:
        connection.terminate()
