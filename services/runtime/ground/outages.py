"""A server that cannot be reached is a state, not a bug: say so once, without a traceback.

When PostgreSQL or nats-server is away, everything that uses it fails, and most of it
retries and logs each failure: nats-py's error callback on every reconnect attempt
(twice a second, with a traceback), asyncpg's pool refilling its floor, the relay and
the live state's tailer retrying, a service the stack restarts. Those lines say
nothing after the first one — and the first one's traceback says nothing either.

* :func:`is_unreachable` tells such an error from the others by type (the error or
  any error it was raised from): refused or reset connections, timeouts, asyncpg's
  connection errors (SQLSTATE class 08, "starting up", "shutting down", a connection
  closed in mid-operation, and its internal protocol-state error, which is what a
  pooled connection whose server just died raises), nats-py's closed / reconnecting /
  no-responders errors.
* :class:`QuietOutages` is a logging filter: a record whose exception (``exc_info``,
  or an argument) is unreachable is dropped while an outage is known (``during()``,
  in ``dracap up`` the health monitor: a check is down, and it logs the change of
  state itself), and otherwise written as one line — the message and ``Type: text``
  of the error — since the outage is usually seen a moment before a check fails.
  Every other record passes untouched: other errors keep their tracebacks.
* :class:`StateLog` is what a retrying loop (the relay, a consumer) logs: one line when
  a kind of trouble begins, one when it ends, nothing per retry in between; an error
  that says nothing about a server (a bug) keeps its traceback, once.
* :func:`one_line` is the ``Type: text`` form used for these lines.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Final

import asyncpg
import nats.errors
import nats.js.errors

from services.runtime.ground.errors import RetryableError, RuntimeServiceError

__all__ = ["QuietOutages", "StateLog", "is_unreachable", "one_line", "quiet_outages"]

_UNREACHABLE: Final[tuple[type[BaseException], ...]] = (
    ConnectionError,  # refused, reset, aborted, broken pipe
    TimeoutError,  # asyncio's and nats-py's timeouts too
    asyncpg.PostgresConnectionError,  # SQLSTATE class 08
    asyncpg.CannotConnectNowError,  # starting up, shutting down
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.ConnectionDoesNotExistError,  # closed in the middle of an operation
    # a pooled connection whose server died mid-operation, reused before its socket's
    # end was read: the protocol is still waiting for the end of the failed operation
    asyncpg.InternalClientError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoServersError,
    nats.errors.UnexpectedEOF,
    nats.errors.StaleConnectionError,
    nats.errors.NoRespondersError,  # JetStream not (yet) there
    nats.js.errors.ServiceUnavailableError,
)
#: Failures a loop expects while a server or its data is away (not bugs): one line each.
_EXPECTED: Final[tuple[type[BaseException], ...]] = (
    nats.js.errors.Error,  # JetStream's answers: no stream, not found, ...
    RuntimeServiceError,
)
#: What a plain OSError of a failed connect carries (several addresses tried, say).
_UNREACHABLE_ERRNOS: Final = frozenset(
    {errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH}
)


def is_unreachable(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, says a server cannot be reached."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, _UNREACHABLE):
            return True
        if isinstance(current, OSError) and current.errno in _UNREACHABLE_ERRNOS:
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` is a server away or slow to answer (retryable, or unreachable): an
    expected failure, worth one line and another try, not a traceback."""
    return isinstance(exc, RetryableError) or is_unreachable(exc)


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class StateLog:
    """The trouble of one retrying loop, logged once per change of state."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._log = logger
        self._what = what
        self.trouble: str | None = None  #: the kind of trouble now (None: none)
        self.changes = 0  #: changes of state logged so far

    def failed(self, exc: BaseException, context: str = "") -> None:
        """A try failed: one line (a traceback for a bug) when the trouble is new."""
        # every "cannot reach the server" is one kind: they take turns while it is away
        kind = "unreachable" if is_unreachable(exc) else type(exc).__qualname__
        where = f" {context}" if context else ""
        if kind == self.trouble:
            self._log.debug("%s failed again%s: %s", self._what, where, one_line(exc))
            return
        self.trouble = kind
        self.changes += 1
        if is_unreachable(exc) or isinstance(exc, _EXPECTED):
            self._log.warning("%s failed%s; retrying: %s", self._what, where, one_line(exc))
        else:
            self._log.error("%s failed%s; retrying", self._what, where, exc_info=exc)

    def recovered(self) -> None:
        """A try succeeded: one line if there was trouble."""
        if self.trouble is not None:
            self._log.info("%s works again", self._what)
            self.trouble = None
            self.changes += 1


def _exception_of(record: logging.LogRecord) -> BaseException | None:
    if record.exc_info and record.exc_info[1] is not None:
        return record.exc_info[1]
    args = record.args
    values: Iterable[object] = args.values() if isinstance(args, Mapping) else (args or ())
    return next((a for a in values if isinstance(a, BaseException)), None)


class QuietOutages(logging.Filter):
    """Drops "cannot reach the server" records during an outage; one line otherwise."""

    def __init__(self, during: Callable[[], bool]) -> None:
        super().__init__()
        self._during = during
        self.dropped = 0  #: records dropped so far

    def filter(self, record: logging.LogRecord) -> bool:
        exc = _exception_of(record)
        if exc is None or not is_unreachable(exc):
            return True
        if self._during():
            self.dropped += 1
            return False
        if record.exc_info:
            record.msg = f"{record.getMessage()} ({one_line(exc)})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


@contextlib.contextmanager
def quiet_outages(during: Callable[[], bool]) -> Iterator[QuietOutages]:
    """Put a :class:`QuietOutages` on every handler of the root logger while inside."""
    quiet = QuietOutages(during)
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield quiet
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)
