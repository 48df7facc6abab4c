"""The audit subscriber: every decision and change of the log, as rows people can query.

A :class:`AuditService` is a catch-up projector of the log (``audit``,
:mod:`services.runtime.delivery.projecting`): it reads every event from its position in
``ledger_positions``, in log order, and writes nothing to the log. Per batch of events
(hundreds under load, one transaction, a bounded number of statements whatever its
size), :func:`write_update`

1. reads what the audit knows of the shares and nodes the batch names
   (``audit_shares`` by ShareID, one probe of its primary key per share named; the live
   shares of the nodes an expiry or fence names, through ``audit_shares_node_idx``;
   ``audit_nodes``): one statement each, only the node ones when the batch has
   node-wide events,
2. builds the records with the pure :func:`services.audit.records.build`,
3. inserts them into ``audit_records`` (keyed by log position and sequence), upserts
   ``audit_shares`` / ``audit_nodes``: one statement each, the rows sent as one JSON
   array (:func:`~services.runtime.delivery.subscribers.insert_rows`);

and the projector moves its position in the same transaction. Exactly once: a crash
before the commit leaves nothing, and a batch at or behind the position is never read
again. The inserts would be harmless twice anyway (``ON CONFLICT DO NOTHING`` on the
position key). (A share the log never reserved is recorded without a namespace rather
than stopping the audit: :mod:`services.audit.records`.)

Queries (:func:`query`) read ``audit_records`` with the filters of ``dracap audit``;
the tenant endpoint scopes them to the subject's namespace (:mod:`services.runtime.bus.queries`).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Collection, Sequence
from typing import Any, Final

import msgspec

from events.envelopes import Envelope
from services.audit.records import AuditRecord, ShareInfo, Update, build, needs
from services.runtime.bus.queries import QueryError, limited_to
from services.runtime.delivery.subscribers import (
    QueryingSubscriber,
    decode_query,
    insert_columns,
    insert_rows,
    key_probe,
    planned_now,
    read_node_epochs,
    write_node_epochs,
)
from services.runtime.store.eventstore import Connection

__all__ = [
    "CONSUMER",
    "RECORDS",
    "SHARES",
    "AuditFilter",
    "AuditService",
    "query",
    "read_shares",
    "record_of",
    "share_of",
    "write_update",
]

log = logging.getLogger("dracap.audit")

CONSUMER: Final = "audit"
MAX_ROWS: Final = 10_000

_COLUMNS_OF_SHARES: Final = (
    "share_id, namespace, claim, request, device, node, amounts::text, policy_version, live"
)
_SHARE_COLUMNS: Final = f"SELECT {_COLUMNS_OF_SHARES} FROM audit_shares"
#: the shares a batch names, one probe of the key each (``key_probe``); two statements,
#: not one with an ``OR`` for the nodes' (which the planner answers with a scan)
_SHARES: Final = key_probe("audit_shares", _COLUMNS_OF_SHARES, ("share_id",))
#: every row of ``audit_shares``, in :func:`share_of`'s order
SHARES: Final = _SHARE_COLUMNS
_NODE_SHARES: Final = f"{_SHARE_COLUMNS} WHERE live AND node = ANY($1::text[])"
_INSERT: Final = insert_columns(
    "audit_records",
    (
        ("position", "bigint"),
        ("seq", "integer"),
        ("event_id", "uuid"),
        ("recorded_at", "timestamptz"),
        ("type", "text"),
        ("decision", "text"),
        ("reason", "text"),
        ("namespace", "text"),
        ("claim", "text"),
        ("request", "text"),
        ("share_id", "text"),
        ("device", "text"),
        ("node", "text"),
        ("amounts", "jsonb"),
        ("policy_version", "integer"),
        ("actor", "text"),
        ("actor_kind", "text"),
        ("actor_name", "text"),
        ("actor_epoch", "bigint"),
    ),
    "DO NOTHING",
)
_UPSERT_SHARE: Final = insert_columns(
    "audit_shares",
    (
        ("share_id", "text"),
        ("namespace", "text"),
        ("claim", "text"),
        ("request", "text"),
        ("device", "text"),
        ("node", "text"),
        ("amounts", "jsonb"),
        ("policy_version", "integer"),
        ("live", "boolean"),
    ),
    "(share_id) DO UPDATE SET live = excluded.live",
)


async def write_update(connection: Connection, envs: Sequence[Envelope]) -> Update:
    """Build the records of ``envs`` (the log's next events, in order) on what the tables
    know; write them."""
    share_ids, nodes = needs(envs)
    shares: dict[str, ShareInfo] = {}
    node_shares: dict[str, list[str]] = {}
    for row in await read_shares(connection, share_ids, nodes):
        info = share_of(row)
        shares[info.share_id] = info
        if info.live and info.node in nodes:
            node_shares.setdefault(info.node, []).append(info.share_id)
    epochs = await read_node_epochs(connection, "audit_nodes", nodes)
    update = build(envs, shares, node_shares, epochs)
    # AuditRecord's and ShareInfo's fields are the tables' columns
    await insert_rows(connection, _INSERT, update.records)
    await insert_rows(connection, _UPSERT_SHARE, list(update.shares.values()))
    await write_node_epochs(connection, "audit_nodes", update.nodes)
    return update


async def read_shares(
    connection: Connection, share_ids: Collection[str], nodes: Collection[str]
) -> list[Any]:
    """The rows of ``audit_shares`` of ``share_ids`` and the live ones of ``nodes``: one
    probe of the key per share, planned for the table as it is now (in a transaction;
    :mod:`services.runtime.delivery.subscribers`, "Look-ups by key")."""
    async with planned_now(connection):
        rows = list(await connection.fetch(_SHARES, sorted(share_ids))) if share_ids else []
        if nodes:
            rows += await connection.fetch(_NODE_SHARES, sorted(nodes))
    return rows


class AuditService(QueryingSubscriber):
    """The audit projector, and its query endpoints when given a connection to serve on."""

    service = "audit"
    consumer = CONSUMER

    async def write(self, connection: Connection, envs: Sequence[Envelope]) -> None:
        """Records for ``envs``, in the transaction that moves the position."""
        await write_update(connection, envs)
        return None

    async def query(self, namespace: str | None, data: bytes) -> dict[str, Any]:
        """The records a query asks for; ``namespace``: the tenant it is limited to."""
        wanted = limited_to(decode_filter(data), namespace)
        async with self.store.pool.acquire() as connection:
            records = await query(connection, wanted)
        return {"records": msgspec.to_builtins(records)}


class AuditFilter(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``dracap audit`` filters on (every field optional)."""

    namespace: str | None = None
    claim: str | None = None
    share: str | None = None
    device: str | None = None
    node: str | None = None
    since: datetime.datetime | None = None
    until: datetime.datetime | None = None
    limit: int = MAX_ROWS


def decode_filter(data: bytes) -> AuditFilter:
    """The filter of a query payload; :class:`QueryError` naming the field otherwise."""
    wanted = decode_query(data, AuditFilter)
    if not 1 <= wanted.limit <= MAX_ROWS:
        raise QueryError("limit", f"must be between 1 and {MAX_ROWS}")
    return wanted


_COLUMNS: Final = (
    "position, seq, event_id::text, recorded_at, type, decision, reason, namespace, claim, "
    "request, share_id, device, node, amounts::text, policy_version, actor, actor_kind, "
    "actor_name, actor_epoch"
)


async def query(connection: Connection, wanted: AuditFilter) -> list[AuditRecord]:
    """The newest ``wanted.limit`` records matching ``wanted``, in log order."""
    where: list[str] = []
    args: list[Any] = []
    device = wanted.device
    if device is not None and device.count("/") == 1:  # POOL/DEVICE, as `dracap devices`
        args.append("/" + device)
        where.append(f"right(device, length(${len(args)})) = ${len(args)}")
        device = None
    for column, value in (
        ("namespace", wanted.namespace),
        ("claim", wanted.claim),
        ("share_id", wanted.share),
        ("device", device),
        ("node", wanted.node),
    ):
        if value is not None:
            args.append(value)
            where.append(f"{column} = ${len(args)}")
    if wanted.since is not None:
        args.append(wanted.since)
        where.append(f"recorded_at >= ${len(args)}")
    if wanted.until is not None:
        args.append(wanted.until)
        where.append(f"recorded_at < ${len(args)}")
    args.append(wanted.limit)
    sql = (  # the newest ``limit``, answered in log order
        f"SELECT {_COLUMNS} FROM audit_records"
        + (f" WHERE {' AND '.join(where)}" if where else "")
        + f" ORDER BY position DESC, seq DESC LIMIT ${len(args)}"
    )
    return [record_of(r) for r in reversed(await connection.fetch(sql, *args))]


#: every column of ``audit_records``, in :func:`record_of`'s order
RECORDS: Final = f"SELECT {_COLUMNS} FROM audit_records"


def record_of(r: Any) -> AuditRecord:
    """A row of ``audit_records`` (:data:`RECORDS`' columns) as a record."""
    return AuditRecord(
        position=r[0],
        seq=r[1],
        event_id=r[2],
        recorded_at=r[3],
        type=r[4],
        decision=r[5],
        reason=r[6],
        namespace=r[7],
        claim=r[8],
        request=r[9],
        share_id=r[10],
        device=r[11],
        node=r[12],
        amounts=msgspec.json.decode(r[13]),
        policy_version=r[14],
        actor=r[15],
        actor_kind=r[16],
        actor_name=r[17],
        actor_epoch=r[18],
    )


def share_of(row: Any) -> ShareInfo:
    """A row of ``audit_shares`` (:data:`_SHARE_COLUMNS`) as what the audit knows."""
    return ShareInfo(
        share_id=row[0],
        namespace=row[1],
        claim=row[2],
        request=row[3],
        device=row[4],
        node=row[5],
        amounts=msgspec.json.decode(row[6]),
        policy_version=row[7],
        live=row[8],
    )
