"""A service started against a database its release's migrations have not reached.

``dracap serve reservation`` as a deployment runs it (its own process; its session in the
app role, as every service's is) on a database migrated to the revision before
:data:`~services.runtime.store.schema.SCHEMA_REVISION`: it ends at once with exit 1 and
one line naming the revision and ``dracap db upgrade`` (it used to start, and call the
missing ``dracap_try_lock`` at its first round). Migrated to the head it starts; on a revision
above it (a rolling upgrade: the database migrated first) it starts too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path

import asyncpg

from migrations import runner as migrating
from services.exitcodes import ExitCode
from services.runtime.ground.settings import Settings
from services.runtime.store.schema import SCHEMA_REVISION
from tests.fixtures.polling import until
from tests.fixtures.services import APP_ROLE

ROOT = Path(__file__).resolve().parents[2]


def _argv(url: str, nats_url: str, tmp: Path) -> list[str]:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    return [
        sys.executable, "-m", "services.cli", "serve", "reservation",
        "--database-url", url, "--nats", nats_url, "--prefix", prefix,
        "--data-dir", str(tmp / "d"), "--metrics-port", "0",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    env = {**os.environ, "DRACAP_APP_ROLE": APP_ROLE}
    env.pop("DRACAP_NATS_CREDS", None)
    return env


async def _refused(url: str, nats_url: str, tmp: Path) -> str:
    """Run the service; it must end by itself with exit 1 and one line: that line."""
    process = await asyncio.create_subprocess_exec(
        *_argv(url, nats_url, tmp),
        cwd=ROOT,
        env=_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(120):
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    text = err.decode() + out.decode()
    assert process.returncode == ExitCode.ERROR, text
    assert text.count("\n") == 1 and "Traceback" not in text, text
    return text


async def _serves(url: str, nats_url: str, tmp: Path) -> None:
    """Run the service until it says it started, then stop it: it must end with 0."""
    log = tmp / f"serve-{uuid.uuid4().hex[:6]}.log"
    with log.open("wb") as sink:
        process = await asyncio.create_subprocess_exec(
            *_argv(url, nats_url, tmp), cwd=ROOT, env=_env(), stdout=sink, stderr=sink
        )
    try:
        await until(
            lambda: process.returncode is not None or " started" in log.read_text(errors="replace"),
            120,
            "the service starting",
        )
        assert process.returncode is None, log.read_text(errors="replace")
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            assert await process.wait() == 0, log.read_text(errors="replace")
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_service_refuses_an_older_schema_and_serves_the_head_and_newer(
    empty_database_url: str, nats_url: str, tmp_path: Path
) -> None:
    settings = Settings(database_url=empty_database_url, app_role=APP_ROLE)
    older = f"{int(SCHEMA_REVISION) - 1:04d}"
    assert await migrating.upgrade_async(settings, older) == older
    line = await _refused(empty_database_url, nats_url, tmp_path)
    assert f"older than revision {SCHEMA_REVISION}" in line and "dracap db upgrade" in line

    assert await migrating.upgrade_async(settings) == SCHEMA_REVISION
    await _serves(empty_database_url, nats_url, tmp_path)

    admin = await asyncpg.connect(empty_database_url)
    try:
        newer = f"{int(SCHEMA_REVISION) + 1:04d}"
        await admin.execute("UPDATE alembic_version SET version_num = $1", newer)
        await _serves(empty_database_url, nats_url, tmp_path)
        await admin.execute("UPDATE alembic_version SET version_num = $1", older)
        line = await _refused(empty_database_url, nats_url, tmp_path)
        assert f"at revision {older}, this release needs {SCHEMA_REVISION}" in line
    finally:
        await admin.execute("UPDATE alembic_version SET version_num = $1", SCHEMA_REVISION)
        await admin.close()
