"""The subscribers' look-ups probe keys, never scan the table (issue 25).

Each batch of the audit and billing projectors reads what they know of the claims and
shares the batch names. ``billing_claims``, ``billing_shares`` and ``audit_shares``
hold a row for every claim or share ever seen, so a look-up the planner answers with a
sequential scan costs a batch more the more claims there are. Shown here on real
PostgreSQL, the two ways it happened (:mod:`services.runtime.delivery.subscribers`,
"Look-ups by key"):

* with the table filled and analysed as after a long run, billing's former claim
  look-up, ``(namespace, name) IN (SELECT * FROM unnest(...))``, scans it (a hash join);
  the key probe does not;
* a look-up prepared on a connection while the table was small and analysed, then run
  after the table grew (no ``ANALYZE`` since, as on a server without autovacuum): the
  plan PostgreSQL cached for the former ``share_id = ANY($1)`` scans the whole table
  (audit's took 190 ms a batch at 100,000 claims), and so does a key probe's; the
  readers the projectors use (:func:`services.audit.service.read_shares`,
  :func:`services.billing.service.read_known`), warmed up the same way, read only the
  rows they name. Counted with ``pg_stat_xact_user_tables``: the rows the transaction
  read by sequential scan and its index scans, per table.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

from services.audit import service as audit
from services.billing import service as billing
from services.runtime.delivery.subscribers import key_probe

pytestmark = pytest.mark.integration

#: rows already in the table, the claims of one namespace as in a benchmark run (enough
#: that a scan is no longer the planner's cheap choice for a small table, and that
#: ``BATCH`` keys are a small part of it)
ROWS = 20_000
#: keys one batch names (a projector batch of up to 1,000 positions names hundreds)
BATCH = 300


def _scans(plan: Any) -> list[str]:
    """The relations a plan (``EXPLAIN (FORMAT JSON)``'s node) reads with a sequential scan."""
    found = [plan["Relation Name"]] if plan.get("Node Type") == "Seq Scan" else []
    for child in plan.get("Plans", ()):
        found += _scans(child)
    return found


async def _plan(connection: asyncpg.Connection, sql: str, *args: Any) -> Any:
    rows = await connection.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *args)
    return json.loads(rows)[0]["Plan"]


#: billing's claim look-up before issue 25: the form the planner answered with a scan
_CLAIMS_BEFORE = (
    "SELECT namespace, name, classes::text FROM billing_claims "
    "WHERE (namespace, name) IN (SELECT * FROM unnest($1::text[], $2::text[]))"
)


async def test_billing_claim_lookup_probes_keys_on_a_full_table(database_url: str) -> None:
    connection = await asyncpg.connect(database_url)
    try:
        await connection.execute(
            "INSERT INTO billing_claims (namespace, name, classes) "
            "SELECT 'team-a', 'claim-' || i, '{}'::jsonb FROM generate_series(1, $1) i",
            ROWS,
        )
        await connection.execute("ANALYZE billing_claims")
        keys = [("team-a", f"claim-{i}") for i in range(1, ROWS, ROWS // BATCH)]
        args = ([k[0] for k in keys], [k[1] for k in keys])
        # the premise: on this table the former statement scans it whole
        assert _scans(await _plan(connection, _CLAIMS_BEFORE, *args)) == ["billing_claims"]
        assert _scans(await _plan(connection, billing._CLAIMS, *args)) == []
        # and it still finds each claim it names, once
        found = await connection.fetch(billing._CLAIMS, *args)
        assert sorted((r[0], r[1]) for r in found) == sorted(keys)
    finally:
        await connection.close()


#: rows of a "small" table when the look-ups were first planned (analysed so)
SMALL = 20
#: executions before PostgreSQL may switch a prepared statement to its generic plan
WARM = 7


async def _reads(connection: asyncpg.Connection, table: str) -> tuple[int, int]:
    """(rows read by sequential scan, index scans) of ``table`` in this transaction."""
    row = await connection.fetchrow(
        "SELECT coalesce(seq_tup_read, 0), coalesce(idx_scan, 0) "
        "FROM pg_stat_xact_user_tables WHERE relname = $1",
        table,
    )
    return (int(row[0]), int(row[1])) if row is not None else (0, 0)


async def _cost(connection: asyncpg.Connection, table: str, run: Any) -> tuple[int, int, list[Any]]:
    """(rows read by scan, index scans, rows returned) of ``await run()`` on ``table``,
    in a transaction of its own (as a projector's batch)."""
    async with connection.transaction():
        scanned, probed = await _reads(connection, table)
        rows = await run()
        scanned_after, probed_after = await _reads(connection, table)
    return scanned_after - scanned, probed_after - probed, rows


_FILL_AUDIT = (
    "INSERT INTO audit_shares (share_id, namespace, claim, request, device, node, amounts, "
    "policy_version, live) SELECT 'share-' || i, 'team-a', 'claim-' || i, 'gpu', "
    "'drv/pool/gpu-' || (i % 8), 'node-' || (i % 4), '{}', 1, true "
    "FROM generate_series($1::int, $2::int) i"
)
_FILL_BILLING = (
    "INSERT INTO billing_shares (share_id, namespace, device_class, node, amounts, billed, "
    "state, since, position) SELECT 'share-' || i, 'team-a', 'gpu', 'node-' || (i % 4), "
    "'{}', true, 'held', now(), i FROM generate_series($1::int, $2::int) i"
)
_AUDIT_BEFORE = f"{audit.SHARES} WHERE share_id = ANY($1::text[])"


async def test_share_lookups_planned_while_small_read_only_the_shares_named(
    database_url: str,
) -> None:
    former = await asyncpg.connect(database_url)  # each its own cache of statements
    probe = await asyncpg.connect(database_url)
    reader = await asyncpg.connect(database_url)
    try:
        await former.execute(_FILL_AUDIT, 1, SMALL)
        await former.execute("ANALYZE audit_shares")
        small = [f"share-{i}" for i in range(1, SMALL, 3)]
        before = await former.prepare(_AUDIT_BEFORE)
        lateral = await probe.prepare(key_probe("audit_shares", "share_id", ["share_id"]))
        for _ in range(WARM):
            await before.fetch(small)
            await lateral.fetch(small)
            async with reader.transaction():
                await audit.read_shares(reader, small, ())
        await former.execute(_FILL_AUDIT, SMALL + 1, ROWS)  # grown, not analysed since
        named = [f"share-{i}" for i in range(1, ROWS, ROWS // BATCH)]

        # the premises: the plans cached while the table was small scan it whole
        scanned, _, rows = await _cost(former, "audit_shares", lambda: before.fetch(named))
        assert scanned >= ROWS and len(rows) == len(named)
        scanned, _, rows = await _cost(probe, "audit_shares", lambda: lateral.fetch(named))
        assert scanned >= ROWS and len(rows) == len(named)

        # the projector's reader probes the key, once per share named
        scanned, probed, rows = await _cost(
            reader, "audit_shares", lambda: audit.read_shares(reader, named, ())
        )
        assert scanned == 0 and probed >= len(named)  # one probe per share named
        assert sorted(r[0] for r in rows) == sorted(named)
    finally:
        for connection in (former, probe, reader):
            await connection.close()


async def test_billing_lookups_planned_while_small_read_only_what_they_name(
    database_url: str,
) -> None:
    reader = await asyncpg.connect(database_url)
    try:
        await reader.execute(_FILL_BILLING, 1, SMALL)
        await reader.execute(
            "INSERT INTO billing_claims (namespace, name, classes) "
            "SELECT 'team-a', 'claim-' || i, '{}'::jsonb FROM generate_series(1, $1) i",
            SMALL,
        )
        await reader.execute("ANALYZE billing_shares, billing_claims")
        small = [f"share-{i}" for i in range(1, SMALL, 3)]
        claims = [("team-a", f"claim-{i}") for i in range(1, SMALL, 3)]
        for _ in range(WARM):
            async with reader.transaction():
                await billing.read_known(reader, claims, small, ())
        await reader.execute(_FILL_BILLING, SMALL + 1, ROWS)
        await reader.execute(
            "INSERT INTO billing_claims (namespace, name, classes) "
            "SELECT 'team-a', 'claim-' || i, '{}'::jsonb FROM generate_series($1::int, $2::int) i",
            SMALL + 1,
            ROWS,
        )
        named = [f"share-{i}" for i in range(1, ROWS, ROWS // BATCH)]
        named_claims = [("team-a", f"claim-{i}") for i in range(1, ROWS, ROWS // BATCH)]
        for table in ("billing_shares", "billing_claims"):
            scanned, probed, (found_claims, found_shares) = await _cost(
                reader, table, lambda: billing.read_known(reader, named_claims, named, ())
            )
            assert scanned == 0 and probed >= len(named), table
            assert sorted(found_shares) == sorted(named)
            assert sorted(found_claims) == sorted(named_claims)
    finally:
        await reader.close()
