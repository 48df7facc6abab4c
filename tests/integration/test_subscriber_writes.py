"""A batch of the audit and billing projectors writes each table in one statement (issue 25).

:func:`services.runtime.delivery.subscribers.insert_rows`: a batch's rows of a table go
in as one ``INSERT ... SELECT ... FROM json_to_recordset(...)``, not as an
``executemany``, which PostgreSQL runs as one statement per row. Shown on real PostgreSQL with a
statement-level trigger on each table the batch writes, counting the ``INSERT``
statements that reach it: a batch of many claims' lifecycles, through the projectors'
own :func:`~services.audit.service.write_update` and
:func:`~services.billing.service.write_update`, is one statement per table, and every
row is there (an ``executemany`` fires the trigger once per row). The rows' content is
checked against the log by the pipeline tests (``dracap audit verify`` /
``dracap usage verify``, ``test_audit_billing.py``).
"""

from __future__ import annotations

import datetime
import json

import asyncpg
import pytest

from events import catalog
from events.catalog import Event
from events.envelopes import Envelope, new_envelope
from services.audit import service as audit
from services.billing import service as billing
from services.runtime.delivery.subscribers import insert_columns, insert_rows
from services.runtime.store.eventstore import _init_connection
from tests.integration import sample as s

pytestmark = pytest.mark.integration

T0 = datetime.datetime(2026, 12, 1, 9, 30, tzinfo=datetime.UTC)
#: claims in the batch: enough that one statement per row could not pass for one per table
CLAIMS = 40
TABLES = (
    "audit_records",
    "audit_shares",
    "audit_nodes",
    "billing_claims",
    "billing_shares",
    "billing_usage",
    "billing_nodes",
)

_COUNTING = """
CREATE TABLE test_inserts (tab text NOT NULL);
CREATE FUNCTION test_count_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO test_inserts VALUES (TG_TABLE_NAME);
    RETURN NULL;
END
$$;
"""


def _env(event: Event, position: int, minutes: float, actor: str) -> Envelope:
    return new_envelope(
        event,
        stream_version=1,
        actor=actor,
        position=position,
        recorded_at=T0 + datetime.timedelta(minutes=minutes),
    )


def _batch() -> list[Envelope]:
    """Each claim submitted, admitted, reserved, limited and released; then a node's
    lease expires (the nodes' tables)."""
    envs: list[Envelope] = []
    for i in range(CLAIMS):
        name = f"c{i}"
        r = s.reserved("team-a", name, device=f"gpu-{i}", consumed="10Gi", pool="node-a")
        for minutes, event, actor in (
            (0, s.claim_submitted("team-a", name), "tenant:alice@team-a"),
            (0, catalog.ClaimAdmitted(namespace="team-a", name=name), "tenant:alice@team-a"),
            (1, r, "system:reservation-0"),
            (
                2,
                catalog.LimitApplied(share_id=r.share_id, node="node-a", level="hard", actual={}),
                "agent:node-a#1",
            ),
            (30, s.released(r), "agent:node-a#1"),
        ):
            envs.append(_env(event, len(envs) + 1, minutes, actor))
    envs.append(
        _env(catalog.NodeLeaseExpired(node="node-b", epoch=1), len(envs) + 1, 40, "system:x")
    )
    return envs


async def _counting(connection: asyncpg.Connection, tables: tuple[str, ...]) -> None:
    """Count each ``INSERT`` statement on ``tables`` in ``test_inserts``."""
    await connection.execute(_COUNTING)
    for table in tables:
        await connection.execute(
            f"CREATE TRIGGER test_count AFTER INSERT ON {table} "
            "FOR EACH STATEMENT EXECUTE FUNCTION test_count_insert()"
        )


async def _statements(connection: asyncpg.Connection) -> dict[str, int]:
    rows = await connection.fetch("SELECT tab, count(*) FROM test_inserts GROUP BY tab")
    return {row[0]: row[1] for row in rows}


async def test_a_batch_writes_each_table_in_one_statement(database_url: str) -> None:
    connection = await asyncpg.connect(database_url)
    try:
        await _counting(connection, TABLES)
        await _init_connection(connection)  # the store's jsonb codec
        envs = _batch()
        async with connection.transaction():
            audited = await audit.write_update(connection, envs)
            billed = await billing.write_update(
                connection, [e for e in envs if type(e.event) in billing.EVENTS]
            )
        assert len(audited.records) >= 5 * CLAIMS
        assert len(billed.shares) == CLAIMS and billed.usage()
        assert await _statements(connection) == dict.fromkeys(TABLES, 1)
        counts = {t: await connection.fetchval(f"SELECT count(*) FROM {t}") for t in TABLES}
        assert counts == {
            "audit_records": len(audited.records),
            "audit_shares": CLAIMS,
            "audit_nodes": 1,
            "billing_claims": CLAIMS,
            "billing_shares": CLAIMS,
            "billing_usage": len(billed.usage()),
            "billing_nodes": 1,
        }
        # each value lands as the struct has it
        reserved = next(r for r in audited.records if r.decision == "capacity_reserved")
        row = await connection.fetchrow(
            "SELECT event_id::text, recorded_at, amounts::text, policy_version, actor_epoch,"
            " reason, namespace FROM audit_records WHERE position = $1 AND seq = $2",
            reserved.position,
            reserved.seq,
        )
        assert row is not None
        assert (row[0], row[1], json.loads(row[2]), row[3], row[4], row[5], row[6]) == (
            reserved.event_id,
            reserved.recorded_at,
            reserved.amounts,
            reserved.policy_version,
            reserved.actor_epoch,
            reserved.reason,
            reserved.namespace,
        )
        used = await connection.fetch("SELECT unit_seconds FROM billing_usage ORDER BY hour")
        assert [r[0] for r in used] == [u.unit_seconds for u in billed.usage()]
        amounts = await connection.fetch("SELECT amounts::text FROM billing_shares")
        assert all(json.loads(a[0]) == {"memory": str(10 * 2**30 * 10**9)} for a in amounts)
        closed = await connection.fetchval(
            "SELECT count(*) FROM billing_shares WHERE state = 'closed'"
        )
        assert closed == CLAIMS
    finally:
        await connection.close()


def _node(node: str, lease_epoch: int) -> dict[str, object]:
    return {"node": node, "lease_epoch": lease_epoch, "fenced_epoch": 0}


async def test_an_upsert_of_rows_updates_what_is_there_and_an_empty_batch_sends_nothing(
    database_url: str,
) -> None:
    statement = insert_columns(
        "billing_nodes",
        (("node", "text"), ("lease_epoch", "bigint"), ("fenced_epoch", "bigint")),
        "(node) DO UPDATE SET lease_epoch = excluded.lease_epoch",
    )
    connection = await asyncpg.connect(database_url)
    try:
        await insert_rows(connection, statement, [_node("n1", 1), _node("n2", 1)])
        await _counting(connection, ("billing_nodes",))
        await insert_rows(connection, statement, [_node("n2", 5), _node("n3", 2), _node("n4", 3)])
        await insert_rows(connection, statement, [])
        assert await _statements(connection) == {"billing_nodes": 1}
        rows = await connection.fetch("SELECT node, lease_epoch FROM billing_nodes ORDER BY node")
        assert [tuple(r) for r in rows] == [("n1", 1), ("n2", 5), ("n3", 2), ("n4", 3)]
    finally:
        await connection.close()
