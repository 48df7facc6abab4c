"""Rows copied into ``events`` past every check of an append, as only the table's owner can.

What an older log, a restored hole or a writer from before the database refused bad
payloads could hold: a payload that does not decode, an event the fold refuses. The rows
go in as the database's administrator (the test's ``database_url``) with triggers off
(``session_replication_role = replica``), never through an application login, which the
database is meant to stop.
"""

from __future__ import annotations

import datetime
import uuid
from typing import Any

import asyncpg

from events import catalog
from events.envelopes import stream_of
from events.eventcodec import encode_payload
from services.runtime.store.eventstore import CHANNEL
from services.runtime.store.rows import COLUMNS


def row(
    position: int,
    event: catalog.Event | None = None,
    *,
    payload: bytes | None = None,
    type_tag: str | None = None,
    actor: str = "test",
    stream: str | None = None,
    version: int = 1,
) -> tuple[Any, ...]:
    """A stored row at ``position`` of ``event``, or of a raw ``payload`` tagged ``type_tag``."""
    if event is not None:
        payload = payload if payload is not None else encode_payload(event)
        type_tag = type_tag or catalog.tag_of(event)
        stream = stream or stream_of(event)
    assert payload is not None and type_tag is not None
    return (
        position,
        uuid.uuid4(),
        stream or f"injected:{position}",
        version,
        type_tag,
        1,
        None,
        actor,
        str(uuid.uuid4()),
        None,
        datetime.datetime.now(datetime.UTC),
        payload,
    )


async def inject(database_url: str, rows: list[tuple[Any, ...]]) -> int:
    """Copy ``rows`` into the log as its owner; returns the new head (and announces it)."""
    connection = await asyncpg.connect(database_url)
    try:
        async with connection.transaction():
            await connection.execute("SET LOCAL session_replication_role = replica")
            text = [(*r[:-1], r[-1].decode() if isinstance(r[-1], bytes) else r[-1]) for r in rows]
            await connection.copy_records_to_table("events", records=text, columns=list(COLUMNS))
            head: int = await connection.fetchval("SELECT max(position) FROM events")
            await connection.execute("UPDATE event_log_head SET position = $1", head)
            await connection.execute("SELECT pg_notify($1, $2)", CHANNEL, str(head))
        return head
    finally:
        await connection.close()
