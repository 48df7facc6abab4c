"""The embedded servers of ``dracap up``: start, use, stop, start again, data still there."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import nats
import pytest

from services.runtime.ops.embedded import EmbeddedError, data_dir_lock, embedded_servers

STREAM = "EMBEDDED_TEST"


async def _write(database_url: str, nats_url: str) -> None:
    connection = await asyncpg.connect(database_url)
    try:
        await connection.execute("CREATE TABLE kept (value text)")
        await connection.execute("INSERT INTO kept VALUES ('survives a restart')")
    finally:
        await connection.close()
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(name=STREAM, subjects=["embedded.>"])
        await js.publish("embedded.one", b"kept")
    finally:
        await nc.close()


async def _read(database_url: str, nats_url: str) -> tuple[str, bytes]:
    connection = await asyncpg.connect(database_url)
    try:
        value: str = await connection.fetchval("SELECT value FROM kept")
    finally:
        await connection.close()
    nc = await nats.connect(nats_url)
    try:
        message = await nc.jetstream().get_last_msg(STREAM, "embedded.one")
        data: bytes = message.data or b""
    finally:
        await nc.close()
    return value, data


async def test_servers_restart_with_their_data(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    async with embedded_servers(data_dir) as servers:
        assert servers.database_url.endswith("/dracap")
        await _write(servers.database_url, servers.nats_url)
        with pytest.raises(EmbeddedError, match="in use"), data_dir_lock(data_dir):
            pass
    assert not (data_dir / "postgres" / "postmaster.pid").exists()  # stopped cleanly

    async with embedded_servers(data_dir) as servers:
        assert await _read(servers.database_url, servers.nats_url) == (
            "survives a restart",
            b"kept",
        )
    assert {p.name for p in data_dir.iterdir()} >= {"postgres", "nats", "postgres.log", "nats.log"}


async def test_only_the_servers_asked_for(tmp_path: Path) -> None:
    async with embedded_servers(tmp_path, postgres=False) as servers:
        assert servers.database_url == "" and servers.nats_url.startswith("nats://")
    assert not (tmp_path / "postgres" / "PG_VERSION").exists()
