"""``dracap audit verify``: the audit's tables recomputed from the log, row by row.

The audit tables are a function of the log, but the ledger's database login writes
them, so a holder of that login could rewrite an attribution and nothing would notice
(issue 24, finding 10). :func:`verify` reads the log from the start up to the audit's
position (``ledger_positions``: what it has applied), in pages, and recomputes what
the projector wrote for each page with the same pure :func:`~services.audit.records.
build`, carrying what it knows of shares and nodes from page to page as the tables
do. It compares

* ``audit_records`` page by page (the rows of the page's positions): every record
  missing, extra or with a column that differs;
* at the end ``audit_shares`` and ``audit_nodes`` whole.

Memory follows the shares and nodes, not the log's length. The check reads as any
login that may read the log and the tables (the read-only role); it writes nothing.
"""

from __future__ import annotations

from typing import Final

from events.envelopes import Envelope
from services.audit.records import AuditRecord, NodeEpochs, ShareInfo, build, needs
from services.audit.service import CONSUMER, RECORDS, SHARES, record_of, share_of
from services.runtime.delivery.subscribers import Difference, differences, read_node_epochs
from services.runtime.store.eventstore import Connection, iter_rows
from services.runtime.store.rows import envelope_of

__all__ = ["PAGE", "verify"]

PAGE: Final = 2000
_POSITION: Final = "SELECT position FROM ledger_positions WHERE subscriber = $1"
_RECORDS_IN: Final = f"{RECORDS} WHERE position >= $1 AND position <= $2"


class _Known:
    """What the audit's tables say after the pages read so far, as the projector has it."""

    def __init__(self) -> None:
        self.shares: dict[str, ShareInfo] = {}
        self.on_node: dict[str, set[str]] = {}
        self.nodes: dict[str, NodeEpochs] = {}

    def records(self, envs: list[Envelope]) -> list[AuditRecord]:
        """The records of ``envs`` (the next page), remembering what they change."""
        share_ids, nodes = needs(envs)
        wanted = set(share_ids)
        for node in nodes:
            wanted |= self.on_node.get(node, set())
        update = build(
            envs,
            {s: self.shares[s] for s in wanted if s in self.shares},
            {n: sorted(self.on_node.get(n, ())) for n in nodes},
            {n: self.nodes[n] for n in nodes if n in self.nodes},
        )
        for info in update.shares.values():
            self.shares[info.share_id] = info
            if info.node is not None:
                live = self.on_node.setdefault(info.node, set())
                if info.live:
                    live.add(info.share_id)
                else:
                    live.discard(info.share_id)
        self.nodes.update(update.nodes)
        return update.records


async def verify(connection: Connection) -> list[Difference]:
    """Every row of the audit's tables that differs from the log (see the module)."""
    upto = await connection.fetchval(_POSITION, CONSUMER) or 0
    known = _Known()
    out: list[Difference] = []
    async for rows in iter_rows(connection, 0, PAGE, upto):
        envs = [envelope_of(row) for row in rows]
        expected = {(r.position, r.seq): r for r in known.records(envs)}
        found = {
            (r.position, r.seq): r
            for r in map(
                record_of, await connection.fetch(_RECORDS_IN, envs[0].position, envs[-1].position)
            )
        }
        out += differences("audit_records", expected, found)
    # records past the position: the projector cannot have written them yet
    out += [
        Difference(table="audit_records", key=f"{r[0]}/{r[1]}", problem="extra")
        for r in await connection.fetch(
            "SELECT position, seq FROM audit_records WHERE position > $1 ORDER BY 1, 2", upto
        )
    ]
    shares = {row[0]: share_of(row) for row in await connection.fetch(SHARES)}
    out += differences("audit_shares", known.shares, shares)
    out += differences(
        "audit_nodes", known.nodes, await read_node_epochs(connection, "audit_nodes")
    )
    return out
