"""Riding out a PostgreSQL failover: connect, append and read again until a deadline.

A replicated PostgreSQL (a primary and a synchronous standby, ``docs/operations.md``,
"High availability") is given to dracap as one multi-host URL::

    postgresql://h1:5432,h2:5432/dracap?target_session_attrs=read-write

asyncpg tries the hosts in order and keeps the first that accepts writes. When the
primary dies, every connection to it breaks, and until the standby is promoted no host
accepts writes: a connect is refused (the dead host) or finds only a read-only server
(asyncpg's ``TargetServerAttributeNotMatched``). That lasts as long as the failover
manager takes, seconds; dracap waits it out instead of failing every request:

* **connecting** (:func:`connect_through`): the pools' and listeners' connects are
  retried with a capped back-off while the failure is one of a server that is away
  or not (yet) the primary, until :attr:`Settings.failover_timeout_s
  <services.runtime.ground.settings.Settings.failover_timeout_s>` (``DRACAP_FAILOVER_TIMEOUT_S``,
  default 30 s) has passed; then the last error is raised. A pool's acquire waits
  that long at most, so a request that comes during the failover is served after it.
* **appending** (:class:`Deadline`, used by :mod:`services.runtime.store.eventstore`): an
  append that fails with a :class:`~services.runtime.ground.errors.RetryableError` is tried
  again until the deadline. A connection lost *during* the append is ambiguous: the
  server may have committed it and died before it answered. Before trying again the
  store looks its event ids up on the (new) primary; when they are there, the append
  *was* committed and its stored envelopes are the result — an append is never
  written twice. A session that finds itself on a read-only server
  (``ReadOnlySQLTransactionError``: a demoted primary) is closed, so the pool connects
  again and finds the primary.
* **reading**: the log's pages are read by position; a page that fails is read again
  from the last position handed out, until the deadline
  (:meth:`~services.runtime.store.eventstore.EventStore.read_rows`).

What the caller finally sees is typed (:mod:`services.runtime.ground.errors`): retryable,
permanent or conflict, never decided by a message's text.

Never a lost acknowledgement: a commit that returned is on the surviving server only
if the primary waited for the standby to have it — ``synchronous_commit = on`` with
the standby named in ``synchronous_standby_names``. That is the database's
configuration, not dracap's; ``docs/event-log.md`` says why it is required.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Final

import asyncpg

from services.runtime.ground.errors import ConnectionLost, RetryableError, map_database_error

__all__ = [
    "AMBIGUOUS",
    "BACKOFF_MAX_S",
    "Connector",
    "Deadline",
    "connect_through",
    "is_ambiguous",
    "quiet_pool_log",
]

_log = logging.getLogger("dracap.failover")

BACKOFF_FIRST_S: Final = 0.02
BACKOFF_MAX_S: Final = 0.5

#: Failures after which an append may or may not have been committed: the connection
#: broke while the statement ran (the server died, or was shut down under it).
AMBIGUOUS: Final[tuple[type[BaseException], ...]] = (
    ConnectionLost,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    ConnectionError,
    OSError,
    asyncio.TimeoutError,
)


def is_ambiguous(exc: BaseException) -> bool:
    """Whether a write that failed with ``exc`` may have been committed all the same."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return isinstance(cause, AMBIGUOUS) or isinstance(exc, AMBIGUOUS)


class Deadline:
    """Tries of one operation until ``timeout`` seconds after the first failure, with a
    capped exponential back-off between them."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._ends: float | None = None
        self._delay = BACKOFF_FIRST_S
        self.tries = 0  #: failed tries so far

    def expired(self) -> bool:
        """Whether no further try fits (counted from the first failure)."""
        return self._ends is not None and time.monotonic() >= self._ends

    async def wait(self) -> bool:
        """Note a failed try and sleep the back-off; False when the deadline has passed
        (then the caller raises the last error)."""
        now = time.monotonic()
        if self._ends is None:
            self._ends = now + self._timeout
        self.tries += 1
        left = self._ends - now
        if left <= 0:
            return False
        await asyncio.sleep(min(self._delay, left))
        self._delay = min(self._delay * 2, BACKOFF_MAX_S)
        return True


async def connect_through(
    dsn: str | None,
    timeout: float,  # noqa: ASYNC109 (a deadline of tries, not one call's)
    **options: Any,
) -> asyncpg.Connection:
    """``asyncpg.connect(dsn, **options)``, tried again while the server is away or no
    host accepts writes yet, until ``timeout`` seconds have passed (module docstring)."""
    deadline = Deadline(timeout)
    while True:
        try:
            connection: asyncpg.Connection = await asyncpg.connect(dsn, **options)
        except Exception as exc:
            if not isinstance(map_database_error(exc), RetryableError):
                raise
            _OUTAGE.began(exc)
            if not await deadline.wait():
                raise
        else:
            _OUTAGE.ended()
            return connection


class _Outage:
    """One line when connects begin to fail, one when one succeeds again (per process)."""

    def __init__(self) -> None:
        self.since: float | None = None

    def began(self, exc: BaseException) -> None:
        if self.since is None:
            self.since = time.monotonic()
            _log.warning("no database server accepts writes (%s); trying again", _line(exc))

    def ended(self) -> None:
        if self.since is not None:
            _log.info("a database server accepts writes again after %.1fs", self._took())
            self.since = None

    def _took(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since


_OUTAGE: Final = _Outage()


class Connector:
    """What ``asyncpg.create_pool(connect=...)`` calls: a plain connect until
    :meth:`opened` (a pool that cannot open says so at once, as before), then
    :func:`connect_through`."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._opened = False

    def opened(self) -> None:
        """The pool is open: from now on a connect rides out a failover."""
        self._opened = True

    async def __call__(self, dsn: str | None = None, **options: Any) -> asyncpg.Connection:
        if not self._opened:
            connection: asyncpg.Connection = await asyncpg.connect(dsn, **options)
            return connection
        return await connect_through(dsn, self._timeout, **options)


class _PoolLogLine(logging.Filter):
    """asyncpg's pool logs, with a traceback, each failure to refill its floor of
    connections; while no server accepts writes that is the failover, not a bug: one
    warning line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and isinstance(map_database_error(exc), RetryableError):
            record.msg = f"{record.getMessage()}: {_line(exc)}"
            record.args = None
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_POOL_LOG_LINE: Final = _PoolLogLine()


class _LostConnects:
    """The running loop's exception handler, less asyncpg's leftovers of a server that
    went away: a connect cancelled as its TCP connection came up leaves a bare future that
    the connection's loss then fails (``connection_lost()`` during the SSL request), and
    asyncio logged it as an error with its traceback ("Future exception was never
    retrieved") — during a failover, an expected failure. Such a future (not a task)
    failed with an error the store counts as retryable is one warning line; anything else
    goes to the handler that was there."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        future = context.get("future")
        if (
            isinstance(future, asyncio.Future)
            and not isinstance(future, asyncio.Task)
            and isinstance(exc, Exception)
            and isinstance(map_database_error(exc), RetryableError)
        ):
            _log.warning("a connection ended as its server went away: %s", _line(exc))
            return
        if self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)


def quiet_pool_log() -> None:
    """Have asyncpg's pool log a failover as one line (see :class:`_PoolLogLine`), and
    the running loop its lost connects (:class:`_LostConnects`)."""
    pool_log = logging.getLogger("asyncpg.pool")
    if _POOL_LOG_LINE not in pool_log.filters:
        pool_log.addFilter(_POOL_LOG_LINE)
    loop = asyncio.get_running_loop()
    handler = loop.get_exception_handler()
    if not isinstance(handler, _LostConnects):
        loop.set_exception_handler(_LostConnects(handler))


def _line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]
