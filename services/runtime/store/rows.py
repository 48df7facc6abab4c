"""The row codec of the ``events`` table: one place that knows its column order.

A stored event is one row of twelve columns (:data:`COLUMNS`). Readers select them in
that order (:data:`SELECT`), ``dracap replay import`` copies them in that order;
:func:`decoded` gives a row's event, or the :class:`~events.folding.Refusal` of one the
fold's driver refuses to decode (every reader skips those: :mod:`events.folding`);
:func:`envelope_of` turns a row into the :class:`~events.envelopes.Envelope` every service
folds (``CatalogError`` for a refused one), :func:`raw_envelope_of` into the relay's
:class:`~events.envelopes.RawEnvelope`, which keeps the stored JSON of the event as it is,
and :func:`addressed_node` reads the node a row's event is addressed to off that JSON
(its bus subject: the relay's, and the stream keeper's look for what the bus carries).
Hot loops (replay) index rows with the named positions below rather than building
objects per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, TypeVar

import asyncpg
import msgspec

from events.catalog import Event
from events.envelopes import Envelope, RawEnvelope
from events.errors import CatalogError
from events.folding import Refusal, decode
from events.subjects import NODE_TAGS

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
ACTOR: Final = 7
PAYLOAD: Final = 11

#: ``SELECT`` of every column in :data:`COLUMNS` order (event ids as text).
SELECT: Final = (
    "SELECT "
    + ", ".join("event_id::text" if c == "event_id" else c for c in COLUMNS)
    + " FROM events"
)


class _NodeField(msgspec.Struct):
    node: str | None = None


_NODE_DECODER: Final = msgspec.json.Decoder(_NodeField)

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


def decoded(row: Row) -> Event | Refusal:
    """The event of one stored row (:func:`events.folding.decode`: tolerant, upcast,
    bounded in depth), or the :class:`~events.folding.Refusal` of a payload that does not
    decode."""
    return decode(row[PAYLOAD], row[TYPE], row[SCHEMA_VERSION], row[POSITION])


def event_of(row: Row) -> Event:
    """The event of one stored row; ``CatalogError`` if the fold's driver refuses it."""
    event = decoded(row)
    if isinstance(event, Refusal):
        raise CatalogError(f"position {event.position}: {event.detail}")
    return event


def envelope_with(row: Row, event: Event) -> Envelope:
    """The envelope of one stored row whose event was decoded already."""
    return _envelope(Envelope, row, event)


def envelope_of(row: Row) -> Envelope:
    """The envelope of one stored row (payload decoded tolerantly, with upcasting);
    ``CatalogError`` if the fold's driver refuses to decode it."""
    return _envelope(Envelope, row, event_of(row))


def addressed_node(row: Row) -> str | None:
    """The node an event row is addressed to (None: to none, or not an event of
    :data:`~events.subjects.NODE_TAGS`), read off the stored JSON without decoding the
    event; msgspec's error for a payload whose ``node`` does not decode."""
    if row[TYPE] not in NODE_TAGS:
        return None
    return _NODE_DECODER.decode(row[PAYLOAD]).node


def raw_envelope_of(row: Row) -> RawEnvelope:
    """The envelope of one stored row with the event's JSON as stored."""
    return _envelope(RawEnvelope, row, msgspec.Raw(row[PAYLOAD]))
