"""Billing's claim look-up probes keys, never scans the table (issue 25).

Each batch of the billing projector reads what it knows of the claims the batch names.
``billing_claims`` holds a row for every claim billing ever saw, so a look-up the
planner answers with a sequential scan costs a batch more the more claims there are:
the former ``(namespace, name) IN (SELECT * FROM unnest(...))`` was, for any batch of
more than ~100 claims (a hash join over the whole table). Shown here on real
PostgreSQL, with the table filled and analysed as after a long run: the former
statement scans it, the current one probes the primary key once per claim named, so
its cost follows the batch, not the table. (The share look-ups, ``share_id = ANY``,
are the planner's to answer by index or scan as the share of the table they name
warrants: a scan there is chosen when it is the cheaper, not whatever the table holds.)
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

from services.billing import service as billing

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
