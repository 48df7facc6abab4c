"""The billing subscriber: usage per namespace and DeviceClass, rolled up per hour.

A :class:`BillingService` is a catch-up projector of the log (``billing``,
:mod:`services.runtime.delivery.projecting`) that reads only the events of :data:`EVENTS` (the
database filters them; its position moves past the others all the same) and writes
nothing to the log. Per batch (one transaction, a bounded number of statements
whatever its size), :func:`write_update`

1. reads what billing knows of the claims, shares and nodes the batch names
   (``billing_claims`` and ``billing_shares`` through their primary keys, one probe per
   claim or ShareID the batch names, never a scan of the table; the open shares of the
   nodes an expiry or fence names through ``billing_shares_node_idx``; ``billing_nodes``):
   one statement each, only those the batch needs,
2. applies the pure :func:`services.billing.usage.apply`,
3. upserts those rows and *adds* the closed segments, cut per hour, to
   ``billing_usage``: one statement each, the rows sent as one JSON array
   (:func:`~services.runtime.delivery.subscribers.insert_rows`);

and the projector moves its position in the same transaction. Step 3 adds, so it
must happen once per event: an event at or behind the projector's position is never
read again, and a crash before the commit leaves nothing. Each share also keeps the
log position of the last event applied to it, and an event at or before it changes
nothing. The Prometheus counter ``dracap_usage_unit_seconds_total`` is counted after
the commit: a rolled-back try counts nothing.

Queries (:func:`usage`) sum ``billing_usage`` per namespace, class, capacity and state
within ``--from``/``--to`` (whole hours: a row is in when its hour starts within), and
add the stretch each open share has run so far, up to ``--to`` or now (``open``).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Collection, Sequence
from decimal import Decimal
from typing import Any, Final

import msgspec

from events.catalog import EVENT_TYPES
from events.envelopes import Envelope
from events.transitions import events_meaning
from services.billing.usage import (
    BILLED,
    BillingShare,
    Segment,
    Update,
    apply,
    display,
    needs,
    usage_rows,
)
from services.runtime.bus.queries import limited_to
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
from services.runtime.ground.metrics import USAGE
from services.runtime.store.eventstore import Connection

__all__ = [
    "CONSUMER",
    "EVENTS",
    "SHARES",
    "TYPES",
    "BillingService",
    "UsageFilter",
    "read_known",
    "share_of",
    "usage",
    "write_update",
]

log = logging.getLogger("dracap.billing")

CONSUMER: Final = "billing"
#: The events billing acts on (the only ones it reads): those that stand for a
#: transition :func:`services.billing.usage.apply` bills (:data:`~services.billing.usage.BILLED`).
EVENTS: Final = events_meaning(*BILLED)

#: Their tags (the ``type`` column of the log).
TYPES: Final = frozenset(tag for tag, cls in EVENT_TYPES.items() if cls in EVENTS)

#: one probe of the primary key per claim the batch names, whatever the table holds
#: (``key_probe``): as ``(namespace, name) IN (SELECT * FROM unnest(...))`` the planner
#: answered a batch of more than ~100 claims with a hash join over a scan of every claim
#: billing ever saw (a cost per batch that grew with the claims, issue 25)
_CLAIMS: Final = key_probe(
    "billing_claims", "namespace, name, classes::text", ("namespace", "name")
)
_COLUMNS_OF_SHARES: Final = (
    "share_id, namespace, device_class, node, amounts::text, billed, state, since, position"
)
_SHARE_COLUMNS: Final = f"SELECT {_COLUMNS_OF_SHARES} FROM billing_shares"
#: the shares a batch names, one probe of the key each (``key_probe``); two statements,
#: not one with an ``OR`` for the nodes' (which the planner answers with a scan)
_SHARES: Final = key_probe("billing_shares", _COLUMNS_OF_SHARES, ("share_id",))
_NODE_SHARES: Final = f"{_SHARE_COLUMNS} WHERE state <> 'closed' AND node = ANY($1::text[])"
_UPSERT_CLAIM: Final = insert_columns(
    "billing_claims",
    (("namespace", "text"), ("name", "text"), ("classes", "jsonb")),
    "(namespace, name) DO UPDATE SET classes = excluded.classes",
)
_UPSERT_SHARE: Final = insert_columns(
    "billing_shares",
    (
        ("share_id", "text"),
        ("namespace", "text"),
        ("device_class", "text"),
        ("node", "text"),
        ("amounts", "jsonb"),
        ("billed", "boolean"),
        ("state", "text"),
        ("since", "timestamptz"),
        ("position", "bigint"),
    ),
    "(share_id) DO UPDATE SET state = excluded.state, since = excluded.since, "
    "position = excluded.position",
)
#: the usage rows of a batch are summed per key (:func:`services.billing.usage.usage_rows`)
_ADD_USAGE: Final = insert_columns(
    "billing_usage",
    (
        ("namespace", "text"),
        ("device_class", "text"),
        ("capacity", "text"),
        ("hour", "timestamptz"),
        ("state", "text"),
        ("unit_seconds", "numeric"),
    ),
    "(namespace, device_class, capacity, hour, state) "
    "DO UPDATE SET unit_seconds = billing_usage.unit_seconds + excluded.unit_seconds",
)


#: every row of ``billing_shares``, in :func:`share_of`'s order
SHARES: Final = _SHARE_COLUMNS


def share_of(row: Any) -> BillingShare:
    """A row of ``billing_shares`` (:data:`SHARES`' columns) as billing's share."""
    return BillingShare(
        share_id=row[0],
        namespace=row[1],
        device_class=row[2],
        node=row[3],
        amounts={k: int(v) for k, v in msgspec.json.decode(row[4]).items()},
        billed=row[5],
        state=row[6],
        since=row[7],
        position=row[8],
    )


async def read_known(
    connection: Connection,
    claim_keys: Collection[tuple[str, str]],
    share_ids: Collection[str],
    nodes: Collection[str],
) -> tuple[dict[tuple[str, str], Any], dict[str, BillingShare]]:
    """What billing knows of the claims (``(namespace, name)``) and shares a batch names,
    and of the open shares of ``nodes``: one probe of the key per claim or share, planned
    for the tables as they are now (in a transaction; :mod:`services.runtime.delivery.
    subscribers`, "Look-ups by key")."""
    ordered = sorted(claim_keys)
    async with planned_now(connection):
        found = (
            await connection.fetch(_CLAIMS, [k[0] for k in ordered], [k[1] for k in ordered])
            if ordered
            else []
        )
        claims = {(row[0], row[1]): msgspec.json.decode(row[2]) for row in found}
        found = list(await connection.fetch(_SHARES, sorted(share_ids))) if share_ids else []
        if nodes:
            found += await connection.fetch(_NODE_SHARES, sorted(nodes))
    return claims, {row[0]: share_of(row) for row in found}


async def write_update(connection: Connection, envs: Sequence[Envelope]) -> Update:
    """Apply ``envs`` (the log's next events billing acts on, in order) to what the
    tables know, and write the result."""
    claim_keys, share_ids, nodes = needs(envs)
    claims, shares = await read_known(connection, claim_keys, share_ids, nodes)
    epochs = await read_node_epochs(connection, "billing_nodes", nodes)
    update = apply(envs, claims, shares, epochs)
    await insert_rows(
        connection,
        _UPSERT_CLAIM,
        [{"namespace": ns, "name": name, "classes": c} for (ns, name), c in update.claims.items()],
    )
    await insert_rows(
        connection,
        _UPSERT_SHARE,
        [
            # the amounts as strings, as stored (nano-units outgrow a 64-bit integer)
            {
                "share_id": s.share_id,
                "namespace": s.namespace,
                "device_class": s.device_class,
                "node": s.node,
                "amounts": {k: str(v) for k, v in s.amounts.items()},
                "billed": s.billed,
                "state": s.state,
                "since": s.since,
                "position": s.position,
            }
            for s in update.shares.values()
        ],
    )
    await write_node_epochs(connection, "billing_nodes", update.nodes)
    await insert_rows(connection, _ADD_USAGE, update.usage())  # UsageRow's fields: the columns
    return update


def _counter(update: Update) -> Callable[[], None]:
    rows = update.usage()

    def count() -> None:
        for r in rows:
            USAGE.labels(r.namespace, r.device_class, r.capacity, r.state).inc(
                float(r.unit_seconds)
            )

    return count


class BillingService(QueryingSubscriber):
    """The billing projector, and the usage endpoints when given a connection to serve on."""

    service = "usage"
    consumer = CONSUMER
    types = TYPES

    async def write(self, connection: Connection, envs: Sequence[Envelope]) -> Callable[[], None]:
        """Billing's changes for ``envs``; counts the usage once the batch commits."""
        return _counter(await write_update(connection, envs))

    async def query(self, namespace: str | None, data: bytes) -> dict[str, Any]:
        """The usage a query asks for; ``namespace``: the tenant it is limited to."""
        wanted = limited_to(decode_filter(data), namespace)
        async with self.store.pool.acquire() as connection:
            rows = await usage(connection, wanted)
        return {"usage": rows}


class UsageFilter(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``dracap usage`` filters on (every field optional)."""

    namespace: str | None = None
    device_class: str | None = None
    start: datetime.datetime | None = None  #: ``--from``
    end: datetime.datetime | None = None  #: ``--to``
    open: bool = True  #: add the stretch open shares have run so far


def decode_filter(data: bytes) -> UsageFilter:
    """The filter of a query payload; :class:`QueryError` naming the field otherwise."""
    return decode_query(data, UsageFilter)


async def usage(connection: Connection, wanted: UsageFilter) -> list[dict[str, Any]]:
    """Usage per namespace, class, capacity and state (closed stretches, then open ones)."""
    where: list[str] = []
    args: list[Any] = []
    for column, value in (("namespace", wanted.namespace), ("device_class", wanted.device_class)):
        if value is not None:
            args.append(value)
            where.append(f"{column} = ${len(args)}")
    if wanted.start is not None:
        args.append(_hour_of(wanted.start))
        where.append(f"hour >= ${len(args)}")
    if wanted.end is not None:
        args.append(wanted.end)
        where.append(f"hour < ${len(args)}")
    sql = (
        "SELECT namespace, device_class, capacity, state, sum(unit_seconds) FROM billing_usage"
        + (f" WHERE {' AND '.join(where)}" if where else "")
        + " GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4"
    )
    sums: dict[tuple[str, str, str, str], Decimal] = {
        (r[0], r[1], r[2], r[3]): Decimal(r[4]) for r in await connection.fetch(sql, *args)
    }
    opened: set[tuple[str, str, str, str]] = set()
    if wanted.open:
        for key, so_far in (await _open_usage(connection, wanted)).items():
            sums[key] = sums.get(key, Decimal(0)) + so_far
            opened.add(key)
    out: list[dict[str, Any]] = []
    for (namespace, device_class, capacity, state), unit_seconds in sorted(sums.items()):
        amount, unit = display(capacity, unit_seconds)
        out.append(
            {
                "namespace": namespace,
                "device_class": device_class,
                "capacity": capacity,
                "state": state,
                "unit_seconds": plain(unit_seconds),
                "amount": plain(round(amount, 6)),
                "unit": unit,
                "open": (namespace, device_class, capacity, state) in opened,
            }
        )
    return out


def plain(number: Decimal) -> str:
    """``number`` in positional notation (``162000000000``, never ``1.62E+11``), without
    trailing zeros after the point: what a spreadsheet or ``bc`` reads as it is."""
    text = format(number, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _hour_of(at: datetime.datetime) -> datetime.datetime:
    return at.astimezone(datetime.UTC).replace(minute=0, second=0, microsecond=0)


async def _open_usage(
    connection: Connection, wanted: UsageFilter
) -> dict[tuple[str, str, str, str], Decimal]:
    """What open shares have run so far, within the window (up to ``end`` or now)."""
    now = await connection.fetchval("SELECT now()")
    end = min(wanted.end, now) if wanted.end is not None else now
    rows = await connection.fetch(
        "SELECT share_id, namespace, device_class, node, amounts::text, billed, state, since, "
        "position FROM billing_shares WHERE state <> 'closed' AND billed "
        "AND ($1::text IS NULL OR namespace = $1) AND ($2::text IS NULL OR device_class = $2)",
        wanted.namespace,
        wanted.device_class,
    )
    segments = []
    for row in rows:
        share = share_of(row)
        start = share.since
        if wanted.start is not None:
            start = max(start, _hour_of(wanted.start))
        segments.append(
            Segment(
                namespace=share.namespace,
                device_class=share.device_class,
                amounts=share.amounts,
                state="held" if share.state == "held" else "unknown",
                start=start,
                end=end,
            )
        )
    sums: dict[tuple[str, str, str, str], Decimal] = {}
    for r in usage_rows(segments):
        key = (r.namespace, r.device_class, r.capacity, r.state)
        sums[key] = sums.get(key, Decimal(0)) + r.unit_seconds
    return sums
