"""The real-service fixtures work: migrations up and down, NATS with JetStream."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from services import cli
from services.runtime.ground.settings import ServiceKind
from services.runtime.store.dbroles import group_role

#: the group role of every kind of service login
SERVICE_LOGINS = tuple(group_role(kind) for kind in ServiceKind)


def db(argv: list[str]) -> int:
    """``dracap db ...`` as a user runs it."""
    return cli.main(["db", *argv])


async def _tables(url: str) -> set[str]:
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {row[0] for row in rows}
    finally:
        await connection.close()


async def _functions(url: str) -> set[str]:
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch(
            "SELECT proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = 'public' AND proname LIKE 'dracap\\_%'"
        )
        return {row[0] for row in rows}
    finally:
        await connection.close()


async def _scope_source(url: str) -> str:
    """The body of the node-scope check (which event types a node agent may write)."""
    connection = await asyncpg.connect(url)
    try:
        return str(
            await connection.fetchval(
                "SELECT prosrc FROM pg_proc WHERE proname = 'dracap_check_node_scope'"
            )
        )
    finally:
        await connection.close()


async def _append_source(url: str) -> str:
    """The body of the append function."""
    connection = await asyncpg.connect(url)
    try:
        return str(
            await connection.fetchval(
                "SELECT prosrc FROM pg_proc WHERE proname = 'dracap_append_guarded'"
            )
        )
    finally:
        await connection.close()


async def _table_privileges(url: str, role: str) -> set[str]:
    """``table:privilege`` of what ``role`` may do in the database at ``url``."""
    return {p for p in await _privileges(url, role) if not p.startswith("function:")}


async def _privileges(url: str, role: str) -> set[str]:
    """What ``role`` may do in the database at ``url``: ``table:privilege`` and
    ``function:name``, and whether ``dracap_append_guarded`` runs as its owner."""
    connection = await asyncpg.connect(url)
    try:
        tables = await connection.fetch(
            "SELECT t.tablename || ':' || p.privilege FROM pg_tables t, "
            "unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE']) p(privilege) "
            "WHERE t.schemaname = 'public' AND has_table_privilege($1, t.tablename, p.privilege)",
            role,
        )
        functions = await connection.fetch(
            "SELECT 'function:' || proname || CASE WHEN prosecdef THEN ':definer' ELSE '' END "
            "FROM pg_proc WHERE pronamespace = 'public'::regnamespace "
            "AND has_function_privilege($1, oid, 'EXECUTE')",
            role,
        )
        return {row[0] for row in [*tables, *functions]}
    finally:
        await connection.close()


async def test_db_upgrade_then_downgrade(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DRACAP_DATABASE_URL", empty_database_url)
    assert await asyncio.to_thread(db, ["upgrade"]) == 0
    guards = {"events", "capacity_ledger", "device_holds", "held_shares", "node_epochs"}
    assert guards <= await _tables(empty_database_url)
    assert not {"shares", "claims"} & await _tables(empty_database_url)
    # 0012: node agents have no database login; their group keeps nothing (PUBLIC's aside)
    assert "dracap_node_roles" not in await _tables(empty_database_url)
    assert not {"dracap_renew_lease", "dracap_bound_node"} & await _functions(empty_database_url)
    agent = await _privileges(empty_database_url, "dracap_agent")
    assert not [p for p in agent if ":" in p.removeprefix("function:")], agent
    assert not {"function:dracap_append_guarded:definer", "events:SELECT"} & agent
    assert "function:dracap_append_guarded:definer" in await _privileges(
        empty_database_url, "dracap_reclamation"
    )
    assert await asyncio.to_thread(db, ["upgrade"]) == 0  # idempotent
    enforcement = await _privileges(empty_database_url, "dracap_enforcement")
    assert {"function:dracap_append_guarded:definer", "function:dracap_renew_leases:definer"} <= (
        enforcement
    )
    assert not {"events:INSERT", "node_leases:UPDATE"} & enforcement
    reservation = await _privileges(empty_database_url, "dracap_reservation")
    assert not {"events:INSERT", "capacity_ledger:UPDATE", "function:dracap_guard"} & reservation
    # 0013: the claims login (only) checks an admission's quota premise with its append
    premise = "function:dracap_expect_admissions:definer"
    assert premise in await _privileges(empty_database_url, "dracap_claims")
    assert not [p for p in reservation if "dracap_expect_admissions" in p]
    # 0015: the reservation login (only) asks for the planner lock without a wait
    assert "function:dracap_try_lock" in reservation
    assert not [p for p in await _privileges(empty_database_url, "dracap_claims") if "try" in p]
    # 0016: every service login reads the schema's revision (a check at its start)
    for role in (*SERVICE_LOGINS, "dracap_app"):
        version = {p for p in await _privileges(empty_database_url, role) if "alembic" in p}
        assert version == {"alembic_version:SELECT"}, role  # read it, never move it
    assert "alembic_version:SELECT" not in await _privileges(empty_database_url, "dracap_agent")
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # one step: 0015
    for role in (*SERVICE_LOGINS, "dracap_app"):
        assert "alembic_version:SELECT" not in await _privileges(empty_database_url, role), role
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # one more: 0014
    assert "dracap_try_lock" not in await _functions(empty_database_url)
    # 0014: the same function checks every admission's premise; down to 0013 it stays
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # one step: 0013
    assert premise in await _privileges(empty_database_url, "dracap_claims")
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # one more: 0012
    assert "dracap_expect_admissions" not in await _functions(empty_database_url)
    assert "dracap_node_roles" not in await _tables(empty_database_url)
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # and one more: 0011
    assert "dracap_node_roles" in await _tables(empty_database_url)
    agent = await _privileges(empty_database_url, "dracap_agent")
    assert "function:dracap_append_guarded:definer" in agent
    assert not {"events:INSERT", "events:UPDATE", "capacity_ledger:UPDATE"} & agent
    assert "function:dracap_renew_lease:definer" in agent
    assert {"node_leases:SELECT", "node_epochs:SELECT"} <= agent
    assert "dracap_node_roles" in await _append_source(empty_database_url)
    assert await asyncio.to_thread(db, ["upgrade"]) == 0  # 0016 again, then back
    assert "dracap_node_roles" not in await _append_source(empty_database_url)
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # 0015
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # 0014
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # 0013
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # 0012
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # 0011
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # one more step: 0010
    assert not await _table_privileges(empty_database_url, "dracap_enforcement")
    assert {"events:INSERT", "capacity_ledger:UPDATE"} <= await _privileges(
        empty_database_url, "dracap_reservation"
    )
    assert "share_used" in await _scope_source(empty_database_url)
    assert {"audit_records", "billing_usage", "ledger_positions"} <= await _tables(
        empty_database_url
    )
    ledger = await _privileges(empty_database_url, "dracap_ledger")
    assert {"events:SELECT", "processed_messages:INSERT", "billing_usage:UPDATE"} <= ledger
    assert not {"events:INSERT", "capacity_ledger:UPDATE"} & ledger
    snapshots = await _table_privileges(empty_database_url, "dracap_snapshots")
    assert snapshots == {
        "events:SELECT",
        "event_log_head:SELECT",
        *(f"snapshots:{p}" for p in ("SELECT", "INSERT", "UPDATE", "DELETE")),
    }
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # and 0009
    assert not await _table_privileges(empty_database_url, "dracap_snapshots")
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # and 0008
    assert "audit_records" not in await _tables(empty_database_url)
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # and 0007
    assert "share_used" not in await _scope_source(empty_database_url)
    assert "node_lease_acquired" in await _scope_source(empty_database_url)
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # and 0006
    assert "dracap_renew_lease" not in await _functions(empty_database_url)
    agent = await _privileges(empty_database_url, "dracap_agent")
    assert "function:dracap_append_guarded:definer" in agent
    assert not {"node_leases:SELECT", "function:dracap_renew_lease"} & agent
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # one more: 0005
    assert "dracap_node_roles" not in await _tables(empty_database_url)
    assert await _privileges(empty_database_url, "dracap_agent") == {
        "function:dracap_append",  # PUBLIC's again, as before 0006
        "function:dracap_events_append_only",
        "function:dracap_append_guarded",
        "function:dracap_guard",
        "function:dracap_release_held",
        "function:dracap_lock",
    }
    assert "events:INSERT" in await _privileges(empty_database_url, "dracap_app")
    assert await asyncio.to_thread(db, ["upgrade"]) == 0  # and up again
    for _ in range(11):  # 0015, 0014, 0013, 0012, 0011, 0010, 0009, 0008, 0007, 0006, 0005
        assert await asyncio.to_thread(db, ["downgrade"]) == 0
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # one more step: 0004
    assert {"shares", "claims"} <= await _tables(empty_database_url)
    assert "held_shares" not in await _tables(empty_database_url)
    assert "dracap_append_projected" in await _functions(empty_database_url)
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # and 0003
    assert await _functions(empty_database_url) == {"dracap_append", "dracap_events_append_only"}
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # and 0002
    assert "processed_messages" in await _tables(empty_database_url)
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # and 0001
    assert "processed_messages" not in await _tables(empty_database_url)
    assert "events" in await _tables(empty_database_url)
    assert await asyncio.to_thread(db, ["downgrade", "base"]) == 0
    assert await _tables(empty_database_url) <= {"alembic_version"}
    assert await asyncio.to_thread(db, ["upgrade"]) == 0
    assert "events" in await _tables(empty_database_url)
    out = capsys.readouterr().out
    assert "database at 0006" in out
    assert "database at 0005" in out and "database at 0004" in out
    assert "database at 0003" in out
    assert "database at 0002" in out
    assert "database at 0001" in out
    assert "database at base" in out


async def test_nats_with_jetstream(nats_url: str) -> None:
    import nats

    client = await nats.connect(nats_url)
    try:
        info = await client.jetstream().account_info()
        assert info.limits is not None
    finally:
        await client.close()


async def test_0012_drops_the_node_agents_users(
    empty_database_url: str, postgres_admin_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The users ``dracap db node-role`` made (bound to a node in ``dracap_node_roles``)
    are dropped; one that still holds a right elsewhere is kept, out of ``dracap_agent``."""
    monkeypatch.setenv("DRACAP_DATABASE_URL", empty_database_url)
    assert await asyncio.to_thread(db, ["upgrade", "0011"]) == 0
    token = uuid.uuid4().hex[:8]
    gone, kept = f"dracap_node_a_{token}", f"dracap_node_b_{token}"
    admin = await asyncpg.connect(empty_database_url)
    try:
        for user, node in ((gone, "node-a"), (kept, "node-b")):
            await admin.execute(f'CREATE ROLE "{user}" LOGIN IN ROLE dracap_agent')
            await admin.execute("INSERT INTO dracap_node_roles VALUES ($1, $2)", user, node)
        await admin.execute("CREATE TABLE elsewhere (x int)")
        await admin.execute(f'GRANT SELECT ON elsewhere TO "{kept}"')  # a right of its own
        assert await asyncio.to_thread(db, ["upgrade"]) == 0
        roles = await admin.fetch(
            "SELECT rolname, pg_has_role(rolname, 'dracap_agent', 'MEMBER') FROM pg_roles "
            "WHERE rolname = ANY($1::text[])",
            [gone, kept],
        )
        assert [tuple(r) for r in roles] == [(kept, False)]
    finally:
        await admin.close()
        cleanup = await asyncpg.connect(empty_database_url)
        try:
            await cleanup.execute("DROP TABLE IF EXISTS elsewhere")
        finally:
            await cleanup.close()
        root = await asyncpg.connect(postgres_admin_url)
        try:
            for user in (gone, kept):
                await root.execute(f'DROP ROLE IF EXISTS "{user}"')
        finally:
            await root.close()
