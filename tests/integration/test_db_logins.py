"""``dracap db logins``: each service kind's own login on a real PostgreSQL, its URL file.

The command (as an operator runs it: a subprocess with the administrator's URL) makes a
login per kind in that kind's group role and writes ``<data-dir>/database/<kind>.url``
(mode 0600); each URL connects as its own user with its group's rights and no more; run
again it keeps every password (the files and the server agree), ``--rotate KIND`` gives
that kind a new one; a database not migrated is one line saying to migrate.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from services.runtime.ground.loginfiles import login_file, read_login_url
from services.runtime.store.dbroles import group_role
from services.runtime.store.provisioning import KINDS

ROOT = Path(__file__).resolve().parents[2]


def _logins(
    data_dir: Path, admin_url: str, prefix: str, *extra: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRACAP_")}
    env["DRACAP_DATABASE_URL"] = admin_url
    argv = ["db", "logins", "--data-dir", str(data_dir), "--login-prefix", prefix, *extra]
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


@pytest.fixture
async def prefix(database_url: str) -> AsyncIterator[str]:
    token = f"t{uuid.uuid4().hex[:8]}"
    yield token
    admin = await asyncpg.connect(database_url)
    try:
        for kind in KINDS:
            await admin.execute(f'DROP ROLE IF EXISTS "{token}_{kind.value}_login"')
    finally:
        await admin.close()


async def _verifier(admin_url: str, user: str) -> str:
    admin = await asyncpg.connect(admin_url)
    try:
        found: str = await admin.fetchval(
            "SELECT rolpassword FROM pg_authid WHERE rolname = $1", user
        )
        return found
    finally:
        await admin.close()


async def test_db_logins_makes_keeps_and_rotates_each_kinds_login(
    database_url: str, prefix: str, tmp_path: Path
) -> None:
    done = await asyncio.to_thread(_logins, tmp_path, database_url, prefix)
    assert done.returncode == 0, done.stderr
    urls = {}
    for kind in KINDS:
        path = login_file(tmp_path, kind.value)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        url = read_login_url(tmp_path, kind.value)
        assert url is not None
        urls[kind] = url
        connection = await asyncpg.connect(url)
        try:
            assert (
                await connection.fetchval("SELECT session_user") == f"{prefix}_{kind.value}_login"
            )
            assert await connection.fetchval(
                "SELECT pg_has_role(session_user, $1, 'MEMBER')", group_role(kind)
            )
            assert not await connection.fetchval(
                "SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = session_user"
            )
        finally:
            await connection.close()
        assert done.stdout.count(f"{prefix}_{kind.value}_login") == 1
    assert "password" not in done.stdout and urls[KINDS[0]].split("@")[0] not in done.stdout

    relay = f"{prefix}_relay_login"
    before = await _verifier(database_url, relay)
    again = await asyncio.to_thread(_logins, tmp_path, database_url, prefix)
    assert again.returncode == 0, again.stderr
    assert {k: read_login_url(tmp_path, k.value) for k in KINDS} == urls  # kept
    assert " kept " in again.stdout and " created " not in again.stdout

    rotated = await asyncio.to_thread(_logins, tmp_path, database_url, prefix, "--rotate", "relay")
    assert rotated.returncode == 0, rotated.stderr
    assert read_login_url(tmp_path, "relay") != next(
        u for k, u in urls.items() if k.value == "relay"
    )
    assert await _verifier(database_url, relay) != before
    assert read_login_url(tmp_path, "claims") == next(
        u for k, u in urls.items() if k.value == "claims"
    )


async def test_db_logins_on_a_database_not_migrated_says_to_migrate(
    empty_database_url: str, tmp_path: Path
) -> None:
    done = await asyncio.to_thread(_logins, tmp_path, empty_database_url, "tnone")
    assert done.returncode != 0 and done.stderr.count("\n") == 1, done.stderr
    assert "dracap db upgrade" in done.stderr


async def test_db_logins_refuses_an_unknown_kind_to_rotate(
    database_url: str, tmp_path: Path
) -> None:
    done = await asyncio.to_thread(_logins, tmp_path, database_url, "tbad", "--rotate", "agent")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--rotate 'agent'" in done.stderr
