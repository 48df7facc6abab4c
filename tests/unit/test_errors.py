"""Each package has one root error, and what a caller must do is told by type alone."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import msgspec
import pytest

import events
from events import celcost
from events.errors import EventsError, SnapshotError, SubjectError
from events.fold import ClusterState, snapshot_decode, snapshot_encode
from events.subjects import node_token
from services.enforcement.enforcers import (
    EnforcementError,
    PermanentEnforcementError,
    RetryableEnforcementError,
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
