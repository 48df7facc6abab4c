"""The row codec of the ``events`` table: one place that knows its column order.

A stored event is one row of twelve columns (:data:`COLUMNS`). Readers select them in
that order (:data:`SELECT`), ``dracap replay import`` copies them in that order;
:func:`envelope_of` turns a row into the
:class:`~events.catalog.Envelope` every service folds, :func:`raw_envelope_of` into
the relay's :class:`~events.catalog.RawEnvelope`, which keeps the stored JSON of the
event as it is. Hot loops (replay) index rows with the named positions below rather
than building objects per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, TypeVar

import asyncpg
import msgspec

from events.catalog import Envelope, Event, RawEnvelope, current_decoders, decode_stored

#: The columns of ``events``, in the order every read and bulk write uses.
COLUMNS: Final = (
    "position",
    "event_id",
    "stream",
    "stream_version",
    "type",
    "schema_version",
    "namespace",
    "actor",
    "correlation_id",
    "causation_id",
    "recorded_at",
    "payload",
)
POSITION: Final = 0
EVENT_ID: Final = 1
STREAM: Final = 2
STREAM_VERSION: Final = 3
TYPE: Final = 4
SCHEMA_VERSION: Final = 5
PAYLOAD: Final = 11

#: ``SELECT`` of every column in :data:`COLUMNS` order (event ids as text).
SELECT: Final = (
    "SELECT "
    + ", ".join("event_id::text" if c == "event_id" else c for c in COLUMNS)
    + " FROM events"
)

#: A stored row as asyncpg returns it (or any sequence in :data:`COLUMNS` order).
Row = asyncpg.Record | Sequence[Any]
E = TypeVar("E", Envelope, RawEnvelope)


def _envelope(cls: type[E], row: Row, event: Any) -> E:
    (
        position,
        event_id,
        stream,
        stream_version,
        _type,
        schema_version,
        namespace,
        actor,
        correlation_id,
        causation_id,
        recorded_at,
        _payload,
    ) = row
    return cls(
        event_id=event_id,
        stream=stream,
        stream_version=stream_version,
        position=position,
        namespace=namespace,
        actor=actor,
        correlation_id=correlation_id,
        causation_id=causation_id,
        recorded_at=recorded_at,
        schema_version=schema_version,
        event=event,
    )


_CURRENT: Final = current_decoders()


def event_of(row: Row) -> Event:
    """The event of one stored row: :func:`~events.catalog.decode_stored`, with a payload
    at its type's current schema version going straight to that type's decoder."""
    tag, version, payload = row[TYPE], row[SCHEMA_VERSION], row[PAYLOAD]
    entry = _CURRENT.get(tag)
    if entry is not None and entry[0] == version:
        try:
            return entry[1](payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass  # decode_stored raises the catalog's error for it
    return decode_stored(payload, tag, version)


def envelope_of(row: Row) -> Envelope:
    """The envelope of one stored row (payload decoded tolerantly, with upcasting)."""
    return _envelope(Envelope, row, event_of(row))


def raw_envelope_of(row: Row) -> RawEnvelope:
    """The envelope of one stored row with the event's JSON as stored."""
    return _envelope(RawEnvelope, row, msgspec.Raw(row[PAYLOAD]))
