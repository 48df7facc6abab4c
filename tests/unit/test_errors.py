"""Each package has one root error, and what a caller must do is told by type alone.

Retryable, permanent and conflict are different types in every tree; the mappings of
driver exceptions (asyncpg, nats-py) to the runtime tree read classes, SQLSTATEs and
JetStream error codes, never message text.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import asyncpg
import msgspec
import nats.errors
import nats.js.errors
import pytest

import events
from events import celcost
from events.errors import EventsError, SnapshotError, SubjectError
from events.state import ClusterState
from events.statecodec import snapshot_decode, snapshot_encode
from events.subjects import node_token
from services.enforcement.enforcers import (
    EnforcementError,
    PermanentEnforcementError,
    RetryableEnforcementError,
)
from services.runtime.ground.errors import (
    LEDGER_CAPACITY_CHECK,
    AlreadyHandled,
    AppendForbidden,
    CapacityExceeded,
    CapacityNotPublished,
    ConflictError,
    InvalidEvent,
    NodeScopeViolation,
    NotFound,
    PermanentError,
    RetryableError,
    map_bus_error,
    map_database_error,
)

#: BaseException signals of the CEL meter: never errors, never seen outside the evaluator.
SIGNALS = {celcost.OverBudget, celcost.Interrupted}


def _classes_defined_in(package: object) -> list[type]:
    path = getattr(package, "__path__", [])
    prefix = f"{getattr(package, '__name__', '')}."
    found: list[type] = []
    for info in pkgutil.walk_packages(path, prefix):
        module = importlib.import_module(info.name)
        found += [
            obj
            for _, obj in inspect.getmembers(module, inspect.isclass)
            if obj.__module__ == info.name
        ]
    return found


def test_every_error_of_events_is_under_its_root() -> None:
    errors = [c for c in _classes_defined_in(events) if issubclass(c, BaseException)]
    assert len(errors) > 10  # the walk found the package's errors
    stray = [c for c in errors if not issubclass(c, EventsError) and c not in SIGNALS]
    assert stray == []
    assert not any(issubclass(s, Exception) for s in SIGNALS)


def test_a_bad_subject_name_is_an_events_error() -> None:
    with pytest.raises(SubjectError) as caught:
        node_token("")
    assert isinstance(caught.value, EventsError)


def test_a_snapshot_that_cannot_be_restored_is_a_snapshot_error() -> None:
    snap = msgspec.json.decode(snapshot_encode(ClusterState()))
    foreign = msgspec.json.encode({**snap, "format": 1})
    with pytest.raises(SnapshotError, match="format 1"):
        snapshot_decode(foreign)
    with pytest.raises(SnapshotError, match="does not decode"):
        snapshot_decode(b"{")


def test_retryable_and_permanent_enforcement_errors_are_apart() -> None:
    retryable, permanent = RetryableEnforcementError("busy"), PermanentEnforcementError("no")
    assert isinstance(retryable, EnforcementError) and isinstance(permanent, EnforcementError)
    assert not isinstance(retryable, PermanentEnforcementError)
    assert not isinstance(permanent, RetryableEnforcementError)


# --- services.runtime: database and bus errors mapped by type, never by text ------------


def _postgres(sqlstate: str, **fields: str) -> Exception:
    error: Exception = asyncpg.PostgresError.new({"C": sqlstate, "M": "anything", **fields})
    return error


@pytest.mark.parametrize(
    ("raw", "mapped"),
    [
        (
            _postgres("DR002", M="no capacity 'memory' published for device d/p/gpu-9"),
            CapacityNotPublished,
        ),
        (_postgres("23514", n=LEDGER_CAPACITY_CHECK), CapacityExceeded),
        (_postgres("23514", n="some_other_check"), PermanentError),
        (_postgres("DR001", D="claim:a/b"), ConflictError),
        (_postgres("DR003"), AlreadyHandled),
        (_postgres("DR004", D="enforcement.limit_applied"), NodeScopeViolation),
        (_postgres("DR005", D="admin.namespace_access_set"), AppendForbidden),
        (_postgres("DR006", D="enforcement.limit_applied"), InvalidEvent),
        (_postgres("23505", n="device_holds_pkey"), ConflictError),
        (_postgres("40001"), RetryableError),  # serialization failure
        (_postgres("42601"), PermanentError),  # syntax error: a bug, not weather
    ],
)
def test_database_errors_map_by_sqlstate(raw: Exception, mapped: type[Exception]) -> None:
    assert type(map_database_error(raw)) is mapped


def test_an_unpublished_capacity_is_not_a_shortage() -> None:
    error = map_database_error(_postgres("DR002", M="no capacity 'memory' published"))
    assert isinstance(error, PermanentError)
    assert not isinstance(error, CapacityExceeded | ConflictError | RetryableError)


def test_a_node_scope_violation_is_permanent_and_names_the_event_type() -> None:
    message = "database user u acts for node 'a' only: enforcement.limit_applied for node 'b'"
    error = map_database_error(_postgres("DR004", M=message, D="enforcement.limit_applied"))
    assert isinstance(error, NodeScopeViolation) and isinstance(error, PermanentError)
    assert not isinstance(error, ConflictError | RetryableError)
    assert error.event_type == "enforcement.limit_applied" and str(error) == message


def test_a_refused_job_or_payload_is_permanent_and_says_what() -> None:
    message = "database user r (reservation) may not append as actor 'operator:operator'"
    forbidden = map_database_error(_postgres("DR005", M=message, D="actor"))
    assert isinstance(forbidden, AppendForbidden) and isinstance(forbidden, PermanentError)
    assert forbidden.event_type == "actor" and str(forbidden) == message
    assert not isinstance(forbidden, ConflictError | RetryableError)
    undecodable = map_database_error(_postgres("DR006", M="event 1: $.level: expected"))
    assert isinstance(undecodable, InvalidEvent) and isinstance(undecodable, PermanentError)


@pytest.mark.parametrize(
    ("raw", "mapped"),
    [
        (nats.js.errors.BadRequestError(code=400, err_code=10071), ConflictError),
        (nats.js.errors.BadRequestError(code=400, err_code=10058), ConflictError),
        (nats.js.errors.BadRequestError(code=400, err_code=10025), PermanentError),
        (nats.js.errors.NotFoundError(code=404, err_code=10059), NotFound),
        (nats.js.errors.ServiceUnavailableError(code=503), RetryableError),
        (nats.errors.TimeoutError(), RetryableError),
        (nats.errors.NoRespondersError(), RetryableError),
        (nats.errors.ConnectionClosedError(), RetryableError),
        (nats.errors.MaxPayloadError(), PermanentError),
        (nats.errors.AuthorizationError(), PermanentError),
    ],
)
def test_bus_errors_map_by_type_and_code(raw: Exception, mapped: type[Exception]) -> None:
    assert type(map_bus_error(raw, subject="dracap.ev.>")) is mapped


def test_a_mapped_error_is_kept_as_it_is() -> None:
    error = RetryableError("already mapped")
    assert map_bus_error(error) is error and map_database_error(error) is error
