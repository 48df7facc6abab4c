"""The typed error tree of the I/O runtime.

Callers decide what to do by type, never by message text::

    RuntimeServiceError
    ├── RetryableError        transient: serialization failure, deadlock, lost
    │                         connection, statement timeout; the same call may succeed
    ├── PermanentError        the same call will fail the same way again
    │   ├── InvalidEvent      an event is not part of the catalog or fails validation
    │   └── NotFound          the thing asked for does not exist
    └── ConflictError         somebody else changed the same thing first: a stream
        │                     version clash, a unique violation (a second exclusive
        │                     hold of a dedicated device, a duplicate event id)
        ├── CapacityExceeded  the ledger's CHECK (allocated <= total) refused the write
        └── AlreadyHandled    a consumer's message was recorded as handled before

``CapacityExceeded`` is a :class:`ConflictError` rather than a permanent error: it
means that the decision was taken on a stale view of the ledger (the allocator never
proposes more than the free capacity it saw), so the right reaction is the same as for
a version clash — re-read the state, decide again. Retrying the *same* write blindly
would fail again, which is why conflicts are not :class:`RetryableError`.

:func:`map_database_error` turns an ``asyncpg`` exception into this tree by its class
(which asyncpg derives from the SQLSTATE), so the mapping does not depend on the
server's message language or wording. Constraint names are matched exactly to tell
the capacity CHECK from other CHECKs.
"""

from __future__ import annotations

import asyncio

import asyncpg

LEDGER_CAPACITY_CHECK = "capacity_ledger_within_total"
#: SQLSTATE of ``dracap_append`` (migration 0003) when a stream is not at the expected version.
STALE_VERSION_SQLSTATE = "DR001"
#: SQLSTATE of ``dracap_project`` (migration 0004) for a capacity no slice published.
UNKNOWN_CAPACITY_SQLSTATE = "DR002"
#: SQLSTATE of ``dracap_append_projected`` (0004) when a message was handled before.
ALREADY_HANDLED_SQLSTATE = "DR003"
LEDGER_NONNEGATIVE_CHECK = "capacity_ledger_nonnegative"
STREAM_VERSION_UNIQUE = "events_stream_version_key"


class RuntimeServiceError(Exception):
    """Root of every error raised by :mod:`services.runtime`."""


class RetryableError(RuntimeServiceError):
    """A transient failure; repeating the same operation may succeed."""


class PermanentError(RuntimeServiceError):
    """The operation cannot succeed as asked; repeating it changes nothing."""


class InvalidEvent(PermanentError, ValueError):  # noqa: N818 (names from the design)
    """An event (or its envelope) is not acceptable for the log."""


class NotFound(PermanentError, LookupError):  # noqa: N818
    """The object asked for does not exist."""


class ConflictError(RuntimeServiceError):
    """A concurrent writer got there first; re-read and decide again."""

    def __init__(self, message: str, *, stream: str | None = None) -> None:
        super().__init__(message)
        self.stream = stream


class CapacityExceeded(ConflictError):  # noqa: N818
    """The capacity ledger refused a reservation: ``allocated`` would pass ``total``."""


class AlreadyHandled(ConflictError):  # noqa: N818
    """An append that records consumed messages found one recorded before; nothing written."""


_RETRYABLE: tuple[type[BaseException], ...] = (
    asyncpg.SerializationError,
    asyncpg.DeadlockDetectedError,
    asyncpg.QueryCanceledError,  # statement_timeout, lock_timeout
    asyncpg.LockNotAvailableError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.AdminShutdownError,
    ConnectionError,
    OSError,
    asyncio.TimeoutError,
)


def map_database_error(exc: BaseException, *, stream: str | None = None) -> RuntimeServiceError:
    """The runtime error for a database exception (by type and constraint name)."""
    if isinstance(exc, RuntimeServiceError):
        return exc
    if isinstance(exc, asyncpg.CheckViolationError):
        if exc.constraint_name in (LEDGER_CAPACITY_CHECK, LEDGER_NONNEGATIVE_CHECK):
            return CapacityExceeded(f"capacity ledger refused the write: {exc}", stream=stream)
        return PermanentError(f"check constraint failed: {exc}")
    if getattr(exc, "sqlstate", None) == ALREADY_HANDLED_SQLSTATE:
        return AlreadyHandled(str(getattr(exc, "message", exc)), stream=stream)
    if getattr(exc, "sqlstate", None) == UNKNOWN_CAPACITY_SQLSTATE:  # raised by dracap_project
        return CapacityExceeded(str(getattr(exc, "message", exc)), stream=stream)
    if getattr(exc, "sqlstate", None) == STALE_VERSION_SQLSTATE:  # raised by dracap_append
        stale = getattr(exc, "detail", None) or stream
        return ConflictError(str(getattr(exc, "message", exc)), stream=stale)
    if isinstance(exc, asyncpg.UniqueViolationError):
        return ConflictError(f"unique constraint {exc.constraint_name} violated", stream=stream)
    if isinstance(exc, asyncpg.ExclusionViolationError):
        return ConflictError(f"exclusion constraint {exc.constraint_name} violated", stream=stream)
    if isinstance(exc, _RETRYABLE):
        return RetryableError(f"transient database failure: {type(exc).__name__}: {exc}")
    return PermanentError(f"database error: {type(exc).__name__}: {exc}")


def is_retryable(exc: BaseException) -> bool:
    """Whether ``exc`` (raw or mapped) is worth retrying unchanged."""
    return isinstance(map_database_error(exc), RetryableError)
