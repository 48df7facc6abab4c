"""``dracap usage verify``: billing's tables recomputed from the log, row by row.

Billing's tables are a function of the log, but the ledger's database login writes
them, so a holder of that login could rewrite a tenant's usage and nothing would notice
(issue 24, finding 10). :func:`verify` reads the log from the start up to billing's
position (``ledger_positions``), in pages, keeps the events billing acts on
(:data:`~services.billing.service.EVENTS`), and recomputes each page with the same pure
:func:`~services.billing.usage.apply`, carrying what it knows of claims, shares and
nodes from page to page as the tables do. It then compares, whole,

* ``billing_usage``: the sum of every closed stretch per namespace, DeviceClass,
  capacity, hour and state (``unit_seconds``, exact);
* ``billing_shares``, ``billing_claims`` and ``billing_nodes``.

Memory follows the shares, claims and hours, not the log's length. The check reads as
any login that may read the log and the tables (the read-only role); it writes nothing.
"""

from __future__ import annotations

import datetime
from decimal import Decimal
from typing import Final

import msgspec

from events.envelopes import Envelope
from services.billing.service import CONSUMER, SHARES, TYPES, share_of
from services.billing.usage import BillingShare, NodeEpochs, Update, apply, needs
from services.runtime.delivery.subscribers import Difference, differences, read_node_epochs
from services.runtime.store.eventstore import Connection, iter_rows
from services.runtime.store.rows import TYPE, envelope_of

__all__ = ["PAGE", "verify"]

PAGE: Final = 2000
_POSITION: Final = "SELECT position FROM ledger_positions WHERE subscriber = $1"
UsageKey = tuple[str, str, str, datetime.datetime, str]


class UsageTotal(msgspec.Struct, frozen=True):
    """One row of ``billing_usage``: amount x time, in the capacity's base unit x seconds."""

    unit_seconds: Decimal


class RequestClasses(msgspec.Struct, frozen=True):
    """One row of ``billing_claims``: the DeviceClass of each request."""

    classes: dict[str, str]


class _Known:
    """What billing's tables say after the pages read so far, as the projector has it."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, str]] = {}
        self.shares: dict[str, BillingShare] = {}
        self.open_on_node: dict[str, set[str]] = {}
        self.nodes: dict[str, NodeEpochs] = {}
        self.usage: dict[UsageKey, Decimal] = {}

    def apply(self, envs: list[Envelope]) -> None:
        """Apply ``envs`` (the next page's events billing acts on) as the projector does."""
        claim_keys, share_ids, nodes = needs(envs)
        wanted = set(share_ids)
        for node in nodes:
            wanted |= self.open_on_node.get(node, set())
        update = apply(
            envs,
            {k: self.claims[k] for k in claim_keys if k in self.claims},
            {s: self.shares[s] for s in wanted if s in self.shares},
            {n: self.nodes[n] for n in nodes if n in self.nodes},
        )
        self._remember(update)

    def _remember(self, update: Update) -> None:
        self.claims.update(update.claims)
        self.nodes.update(update.nodes)
        for share in update.shares.values():
            self.shares[share.share_id] = share
            if share.node is not None:
                on_node = self.open_on_node.setdefault(share.node, set())
                if share.state == "closed":
                    on_node.discard(share.share_id)
                else:
                    on_node.add(share.share_id)
        for row in update.usage():
            key = (row.namespace, row.device_class, row.capacity, row.hour, row.state)
            self.usage[key] = self.usage.get(key, Decimal(0)) + row.unit_seconds


async def verify(connection: Connection) -> list[Difference]:
    """Every row of billing's tables that differs from the log (see the module)."""
    upto = await connection.fetchval(_POSITION, CONSUMER) or 0
    known = _Known()
    async for rows in iter_rows(connection, 0, PAGE, upto):
        envs = [envelope_of(row) for row in rows if row[TYPE] in TYPES]
        if envs:
            known.apply(envs)
    out = differences(
        "billing_usage",
        {key: UsageTotal(total) for key, total in known.usage.items()},
        {
            (r[0], r[1], r[2], r[3], r[4]): UsageTotal(Decimal(r[5]))
            for r in await connection.fetch(
                "SELECT namespace, device_class, capacity, hour, state, unit_seconds "
                "FROM billing_usage"
            )
        },
    )
    shares = {row[0]: share_of(row) for row in await connection.fetch(SHARES)}
    out += differences("billing_shares", known.shares, shares)
    out += differences(
        "billing_claims",
        {key: RequestClasses(classes) for key, classes in known.claims.items()},
        {
            (r[0], r[1]): RequestClasses(msgspec.json.decode(r[2]))
            for r in await connection.fetch(
                "SELECT namespace, name, classes::text FROM billing_claims"
            )
        },
    )
    nodes = await read_node_epochs(connection, "billing_nodes")
    out += differences("billing_nodes", known.nodes, nodes)
    return out
