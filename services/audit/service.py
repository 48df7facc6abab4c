"""The audit subscriber: every decision and change of the log, as rows people can query.

A :class:`AuditService` is one durable JetStream consumer (``audit``, every event
subject) whose group handler writes nothing to the log: it returns
``Handled.writes`` (:mod:`services.runtime.consuming`), a function that, inside **one
transaction** with the group's ``processed_messages`` rows,

1. takes the events from its position in the log up to the group's newest
   (:func:`services.runtime.inorder.catch_up`: a message is a wake-up; the log, read
   in order, is the work),
2. reads what the audit knows of the shares and nodes they name
   (``audit_shares``, ``audit_nodes``),
3. builds the records with the pure :func:`services.audit.records.build`,
4. inserts them into ``audit_records`` (keyed by log position and sequence), updates
   ``audit_shares`` / ``audit_nodes``, and moves its position.

Exactly once: the transaction commits only if every message of the group is new in
``processed_messages``; a redelivered message rolls it back (``AlreadyHandled``) and
the consumer handles the rest again. A crash before the commit leaves nothing; a crash
after it makes the redelivery a no-op. The inserts would be harmless twice anyway
(``ON CONFLICT DO NOTHING`` on the position key), so even a lost ``processed_messages``
row could not duplicate a record. Order: events are applied in log order whatever
order JetStream delivers in (step 1); a message behind the position changes nothing.
(A share the log never reserved is recorded without a namespace rather than stopping
the audit: :mod:`services.audit.records`.)

Queries (:func:`query`) read ``audit_records`` with the filters of ``dracap audit``;
the tenant endpoint scopes them to the subject's namespace (:mod:`services.runtime.queries`).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from events.catalog import Envelope
from services.audit.records import AuditRecord, NodeEpochs, ShareInfo, Update, build, needs
from services.runtime.consuming import Handled, HandlerContext
from services.runtime.eventstore import Connection
from services.runtime.inorder import catch_up
from services.runtime.livestate import LiveState
from services.runtime.queries import QueryError, limited_to
from services.runtime.subscribers import QueryingSubscriber, decode_query

__all__ = ["CONSUMER", "AuditFilter", "AuditService", "query"]

log = logging.getLogger("dracap.audit")

CONSUMER: Final = "audit"
MAX_ROWS: Final = 10_000

_SHARES: Final = (
    "SELECT share_id, namespace, claim, request, device, node, amounts::text, policy_version, "
    "live FROM audit_shares WHERE share_id = ANY($1::text[]) OR (live AND node = ANY($2::text[]))"
)
_NODES: Final = (
    "SELECT node, lease_epoch, fenced_epoch FROM audit_nodes WHERE node = ANY($1::text[])"
)
_INSERT: Final = """
INSERT INTO audit_records (position, seq, event_id, recorded_at, type, decision, reason,
    namespace, claim, request, share_id, device, node, amounts, policy_version, actor,
    actor_kind, actor_name, actor_epoch)
VALUES ($1, $2, $3::uuid, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14::jsonb, $15, $16,
    $17, $18, $19)
ON CONFLICT DO NOTHING
"""
_UPSERT_SHARE: Final = """
INSERT INTO audit_shares (share_id, namespace, claim, request, device, node, amounts,
    policy_version, live)
VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8, $9)
ON CONFLICT (share_id) DO UPDATE SET live = excluded.live
"""
_UPSERT_NODE: Final = """
INSERT INTO audit_nodes (node, lease_epoch, fenced_epoch) VALUES ($1, $2, $3)
ON CONFLICT (node) DO UPDATE SET lease_epoch = excluded.lease_epoch,
    fenced_epoch = excluded.fenced_epoch
"""


async def write_update(
    connection: Connection,
    envs: Sequence[Envelope],
    subscriber: str = CONSUMER,
    live: LiveState | None = None,
) -> Update:
    """Build the records of the log up to ``envs`` on what the tables know; write them."""
    envs = await catch_up(connection, subscriber, envs, live)
    share_ids, nodes = needs(envs)
    shares: dict[str, ShareInfo] = {}
    node_shares: dict[str, list[str]] = {}
    for row in await connection.fetch(_SHARES, sorted(share_ids), sorted(nodes)):
        info = ShareInfo(
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
        shares[info.share_id] = info
        if info.live and info.node in nodes:
            node_shares.setdefault(info.node, []).append(info.share_id)
    epochs = {
        row[0]: NodeEpochs(node=row[0], lease_epoch=row[1], fenced_epoch=row[2])
        for row in await connection.fetch(_NODES, sorted(nodes))
    }
    update = build(envs, shares, node_shares, epochs)
    if update.records:
        await connection.executemany(_INSERT, [_row(r) for r in update.records])
    if update.shares:
        await connection.executemany(
            _UPSERT_SHARE,
            [
                (
                    s.share_id,
                    s.namespace,
                    s.claim,
                    s.request,
                    s.device,
                    s.node,
                    msgspec.json.encode(s.amounts),
                    s.policy_version,
                    s.live,
                )
                for s in update.shares.values()
            ],
        )
    if update.nodes:
        await connection.executemany(
            _UPSERT_NODE, [(n.node, n.lease_epoch, n.fenced_epoch) for n in update.nodes.values()]
        )
    return update


def _row(r: AuditRecord) -> tuple[Any, ...]:
    return (
        r.position,
        r.seq,
        r.event_id,
        r.recorded_at,
        r.type,
        r.decision,
        r.reason,
        r.namespace,
        r.claim,
        r.request,
        r.share_id,
        r.device,
        r.node,
        msgspec.json.encode(r.amounts),
        r.policy_version,
        r.actor,
        r.actor_kind,
        r.actor_name,
        r.actor_epoch,
    )


class AuditService(QueryingSubscriber):
    """The audit consumer, and its query endpoints when given a connection to serve on."""

    service = "audit"
    consumer_name = CONSUMER

    async def handle(self, ctx: HandlerContext, envs: list[Envelope]) -> Handled:
        """Records for ``envs``, written with their ``processed_messages`` rows."""

        async def writes(connection: Connection) -> None:
            await write_update(connection, envs, self.consumer.name, self.live)

        return Handled(writes=writes)

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
    """The records matching ``wanted``, in log order."""
    where: list[str] = []
    args: list[Any] = []
    for column, value in (
        ("namespace", wanted.namespace),
        ("claim", wanted.claim),
        ("share_id", wanted.share),
        ("device", wanted.device),
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
    sql = (
        f"SELECT {_COLUMNS} FROM audit_records"
        + (f" WHERE {' AND '.join(where)}" if where else "")
        + f" ORDER BY position, seq LIMIT ${len(args)}"
    )
    rows = await connection.fetch(sql, *args)
    return [
        AuditRecord(
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
        for r in rows
    ]
