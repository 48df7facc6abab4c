"""The real-service fixtures work: migrations up and down, NATS with JetStream."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from services import cli


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


async def test_db_upgrade_then_downgrade(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DRACAP_DATABASE_URL", empty_database_url)
    assert await asyncio.to_thread(db, ["upgrade"]) == 0
    guards = {"events", "capacity_ledger", "device_holds", "held_shares", "node_epochs"}
    assert guards <= await _tables(empty_database_url)
    assert not {"shares", "claims"} & await _tables(empty_database_url)
    assert await asyncio.to_thread(db, ["upgrade"]) == 0  # idempotent
    assert await asyncio.to_thread(db, ["downgrade"]) == 0  # one step: 0004
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
