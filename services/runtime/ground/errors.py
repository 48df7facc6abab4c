"""The typed error tree of the I/O runtime.

Callers decide what to do by type, never by message text::

    RuntimeServiceError
    ├── RetryableError        transient: serialization failure, deadlock, lost
    │   │                     connection, statement timeout, a failover (no host
    │   │                     accepts writes yet, a session on a server that turned
    │   │                     read-only), a NATS request nobody answered (yet); the
    │   │                     same call may succeed
    │   ├── ConnectionLost    the session broke during the operation: a write may or
    │   │                     may not have been committed (services.runtime.store.failover)
    │   └── NotActive         a single-active service's instance is not (or no longer)
    │                         the active one: it must not act (services.runtime.ops.leadership)
    ├── PermanentError        the same call will fail the same way again
    │   ├── InvalidEvent      an event is not part of the catalog or fails validation
    │   │                     (here, or in the database: SQLSTATE DR006)
    │   ├── NotFound          the thing asked for does not exist (a JetStream stream)
    │   ├── CapacityNotPublished  a reservation names a device capacity that no
    │   │                     published slice has (SQLSTATE DR002)
    │   ├── NodeScopeViolation  a node agent's append (its login bound to a node, or
    │   │                     the enforcement service's for it) holds an event of
    │   │                     another node (SQLSTATE DR004)
    │   ├── AppendForbidden   the session's database user may not append this: an
    │   │                     event type or an actor that is not its job's
    │   │                     (SQLSTATE DR005, migration 0011)
    │   ├── StaleEpoch        a node agent appended under a lease epoch that is no
    │   │                     longer its node's (expired, fenced or superseded); the
    │   │                     store recorded the refusal instead (migration 0007)
    │   └── EndpointError     a server cannot be found or reached (runtime.endpoints)
    └── ConflictError         somebody else changed the same thing first: a stream
        │                     version clash, a unique violation (a second exclusive
        │                     hold of a dedicated device, a duplicate event id), a
        │                     JetStream publish with a wrong expected last sequence
        ├── CapacityExceeded  the ledger's CHECK (allocated <= total) refused the write
        ├── AlreadyHandled    a consumer's message was recorded as handled before
        └── LogDiverged       rows a reader read from the log are not the database's
                              rows at those positions any more: events an old primary
                              showed that the promoted standby never got
                              (services.runtime.store.continuity)

``CapacityExceeded`` is a :class:`ConflictError` rather than a permanent error: it
means that the decision was taken on a stale view of the ledger (the allocator never
proposes more than the free capacity it saw), so the right reaction is the same as for
a version clash — re-read the state, decide again. Retrying the *same* write blindly
would fail again, which is why conflicts are not :class:`RetryableError`.
``CapacityNotPublished`` is not a shortage: the reservation names a capacity the
ledger has never heard of, so no amount of re-reading makes that write succeed.
``NodeScopeViolation`` is permanent too: the append acts for one node (migration 0006),
and the same events stay outside its node however often they are sent; so is
``AppendForbidden``: a login's job (migration 0011, ``events/writers.py``) does not
change between tries.

:func:`map_database_error` turns an ``asyncpg`` exception into this tree by its class
(which asyncpg derives from the SQLSTATE) and by dracap's own SQLSTATEs, so the mapping
does not depend on the server's message language or wording. Constraint names are
matched exactly to tell the capacity CHECK from other CHECKs. :func:`map_bus_error` does
the same for ``nats-py``: by exception class, and for JetStream API errors by their
numeric ``err_code``.
"""

from __future__ import annotations

import asyncio
from typing import Final

import asyncpg
import nats.errors
import nats.js.errors

LEDGER_CAPACITY_CHECK = "capacity_ledger_within_total"
#: SQLSTATE of ``dracap_append`` (migration 0003) when a stream is not at the expected version.
STALE_VERSION_SQLSTATE = "DR001"
#: SQLSTATE of ``dracap_guard`` (migration 0005) when a reservation names a capacity no slice
#: published; it means exactly that, and nothing else.
UNKNOWN_CAPACITY_SQLSTATE = "DR002"
#: SQLSTATE of ``dracap_append_guarded`` (0005) when a message was handled before.
ALREADY_HANDLED_SQLSTATE = "DR003"
#: SQLSTATE of ``dracap_append_guarded`` (0006) when a node-bound database user appends an
#: event that is not its node's; the detail is the event type.
NODE_SCOPE_SQLSTATE = "DR004"
#: SQLSTATE of ``dracap_append_guarded`` (0011) when the session's database user may not
#: append an event type, or as that actor; the detail is the event type (or ``actor``).
FORBIDDEN_SQLSTATE = "DR005"
#: SQLSTATE of ``dracap_append_guarded`` (0011) when a payload is not one the catalog
#: decodes; the detail is the event type.
UNDECODABLE_SQLSTATE = "DR006"
LEDGER_NONNEGATIVE_CHECK = "capacity_ledger_nonnegative"
STREAM_VERSION_UNIQUE = "events_stream_version_key"


class RuntimeServiceError(Exception):
    """Root of every error raised by :mod:`services.runtime`."""


class RetryableError(RuntimeServiceError):
    """A transient failure; repeating the same operation may succeed."""


class ConnectionLost(RetryableError):  # noqa: N818 (a condition, like NotFound)
    """The database session broke while an operation ran on it (its server died, a
    failover): a write may or may not have been committed; look before writing again."""


class Unanswered(RetryableError):  # noqa: N818 (a condition, like NotFound)
    """A request that nobody answered in time (a JetStream API request while the stream
    or a consumer has no leader, say): it may yet be answered if asked again."""


class NotActive(RetryableError):  # noqa: N818 (a condition, like NotFound)
    """This instance of a single-active service does not hold its lease (it never did,
    or its session ended): it stands by, and acts again only once granted the lease."""


class PermanentError(RuntimeServiceError):
    """The operation cannot succeed as asked; repeating it changes nothing."""


class InvalidEvent(PermanentError, ValueError):  # noqa: N818 (names from the design)
    """An event (or its envelope) is not acceptable for the log."""


class NotFound(PermanentError, LookupError):  # noqa: N818
    """The object asked for does not exist."""


class CapacityNotPublished(PermanentError):  # noqa: N818
    """A reservation names a device capacity that no published slice has."""

    def __init__(self, message: str, *, stream: str | None = None) -> None:
        super().__init__(message)
        self.stream = stream


class NodeScopeViolation(PermanentError):  # noqa: N818
    """A database user bound to one node appended what is not that node's to write.

    The message names the user, its node and the event type; ``event_type`` is the type.
    """

    def __init__(self, message: str, *, event_type: str | None = None) -> None:
        super().__init__(message)
        self.event_type = event_type


class AppendForbidden(PermanentError):  # noqa: N818 (names from the design)
    """The session's database user may not append this (migration 0011): not its job's
    event type, or not its job's actor. ``event_type``: the type (``actor`` when the
    actor itself is not the login's)."""

    def __init__(self, message: str, *, event_type: str | None = None) -> None:
        super().__init__(message)
        self.event_type = event_type


class StaleEpoch(PermanentError):  # noqa: N818 (names from the design)
    """An agent's append named a lease epoch its node no longer holds; refused and logged.

    Permanent for that epoch: the agent must take a new lease (and reconcile) before
    it writes again. ``node``, ``epoch`` (the stale one) and ``current`` (the node's).
    """

    def __init__(self, node: str, epoch: int, current: int) -> None:
        super().__init__(
            f"node {node}: lease epoch {epoch} is stale (the node is at epoch {current}); "
            "the append was refused and the refusal recorded"
        )
        self.node = node
        self.epoch = epoch
        self.current = current


class ConflictError(RuntimeServiceError):
    """A concurrent writer got there first; re-read and decide again."""

    def __init__(self, message: str, *, stream: str | None = None) -> None:
        super().__init__(message)
        self.stream = stream


class CapacityExceeded(ConflictError):  # noqa: N818
    """The capacity ledger refused a reservation: ``allocated`` would pass ``total``."""


class AlreadyHandled(ConflictError):  # noqa: N818
    """An append that records consumed messages found one recorded before; nothing written."""


class LogDiverged(ConflictError):  # noqa: N818
    """What a reader read of the log is not what the database holds at those positions
    (a failover lost events an old primary had shown): read again from before
    :attr:`position`, the first position that differs (:mod:`services.runtime.store.continuity`)."""

    def __init__(self, message: str, *, position: int) -> None:
        super().__init__(message)
        self.position = position


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
    asyncpg.CrashShutdownError,
    # a failover (services.runtime.store.failover): no host accepts writes yet
    # (TargetServerAttributeNotMatched), or a session on a server that is read-only now
    asyncpg.InternalClientError,  # also a pooled connection whose server just died
    asyncpg.ReadOnlySQLTransactionError,
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
    if getattr(exc, "sqlstate", None) == UNKNOWN_CAPACITY_SQLSTATE:
        return CapacityNotPublished(str(getattr(exc, "message", exc)), stream=stream)
    if getattr(exc, "sqlstate", None) == NODE_SCOPE_SQLSTATE:
        detail = getattr(exc, "detail", None)
        return NodeScopeViolation(str(getattr(exc, "message", exc)), event_type=detail)
    if getattr(exc, "sqlstate", None) == FORBIDDEN_SQLSTATE:
        detail = getattr(exc, "detail", None)
        return AppendForbidden(str(getattr(exc, "message", exc)), event_type=detail)
    if getattr(exc, "sqlstate", None) == UNDECODABLE_SQLSTATE:
        return InvalidEvent(str(getattr(exc, "message", exc)))
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


#: JetStream API error codes (``err_code``) of a write that lost a race: the stream's
#: last sequence or message id was not the one the publish expected, or a stream of
#: that name was created by somebody else first.
BUS_CONFLICT_CODES: Final = frozenset({10058, 10070, 10071})

_BUS_RETRYABLE: Final[tuple[type[BaseException], ...]] = (
    nats.errors.TimeoutError,  # also flush, drain and fetch timeouts
    nats.errors.NoRespondersError,  # nobody subscribed (yet): JetStream or a service
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionDrainingError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoServersError,
    nats.errors.StaleConnectionError,  # UnexpectedEOF too
    nats.errors.SlowConsumerError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.ServiceUnavailableError,  # 503: JetStream not ready
    nats.js.errors.ServerError,  # 500
    ConnectionError,
    OSError,
    TimeoutError,
)


def map_bus_error(exc: BaseException, *, subject: str | None = None) -> RuntimeServiceError:
    """The runtime error for a NATS / JetStream exception (by type and ``err_code``)."""
    if isinstance(exc, RuntimeServiceError):
        return exc
    where = f" ({subject})" if subject else ""
    text = f"{type(exc).__name__}: {exc}{where}"
    if isinstance(exc, nats.js.errors.APIError) and exc.err_code in BUS_CONFLICT_CODES:
        return ConflictError(f"bus write lost a race: {text}", stream=subject)
    if isinstance(exc, nats.js.errors.NotFoundError):
        return NotFound(f"not found on the bus: {text}")
    if isinstance(exc, _BUS_RETRYABLE):
        return RetryableError(f"transient bus failure: {text}")
    return PermanentError(f"bus error: {text}")
