"""The audit and billing projectors' look-ups probe keys, never scan a table (issue 25).

Each batch of a projector reads what it knows of the claims and shares the batch names.
Those tables hold a row for every claim and share ever seen, so a look-up the planner
answers with a sequential scan costs a batch more the more claims there are: billing's
claim look-up did, for any batch of more than ~100 claims (a hash join over the whole
``billing_claims``). Shown here on real PostgreSQL, with the tables filled and analysed
as after a long run: the plan of each look-up for a large batch scans no table, so its
cost follows the batch, not the tables.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

from services.audit import service as audit
from services.billing import service as billing

pytestmark = pytest.mark.integration

#: rows already in each table, the claims of one namespace as in a benchmark run (enough
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


async def test_claim_and_share_lookups_probe_keys_on_full_tables(database_url: str) -> None:
    connection = await asyncpg.connect(database_url)
    try:
        await connection.execute(
            "INSERT INTO billing_claims (namespace, name, classes) "
            "SELECT 'team-a', 'claim-' || i, '{}'::jsonb FROM generate_series(1, $1) i",
            ROWS,
        )
        await connection.execute(
            "INSERT INTO billing_shares (share_id, namespace, device_class, node, amounts, "
            "billed, state, since, position) "
            "SELECT 'share-' || i, 'ns', 'gpu', 'node-' || (i % 4), '{}'::jsonb, true, "
            "'held', now(), i FROM generate_series(1, $1) i",
            ROWS,
        )
        await connection.execute(
            "INSERT INTO audit_shares (share_id, namespace, claim, request, device, node, "
            "amounts, policy_version, live) "
            "SELECT 'share-' || i, 'ns', 'claim-' || i, 'r', 'd', 'node-' || (i % 4), "
            "'{}'::jsonb, 1, true FROM generate_series(1, $1) i",
            ROWS,
        )
        await connection.execute("ANALYZE billing_claims, billing_shares, audit_shares")
        keys = [("team-a", f"claim-{i}") for i in range(1, ROWS, ROWS // BATCH)]
        shares = [f"share-{i}" for i in range(1, ROWS, ROWS // BATCH)]
        plans = {
            "billing claims": await _plan(
                connection,
                billing._CLAIMS,
                [k[0] for k in keys],
                [k[1] for k in keys],
            ),
            "billing shares": await _plan(connection, billing._SHARES, shares),
            "audit shares": await _plan(connection, audit._SHARES, shares),
        }
        assert {name: _scans(plan) for name, plan in plans.items()} == {name: [] for name in plans}
        # and each still finds what it names
        found = await connection.fetch(billing._CLAIMS, [k[0] for k in keys], [k[1] for k in keys])
        assert sorted((r[0], r[1]) for r in found) == sorted(keys)
    finally:
        await connection.close()
