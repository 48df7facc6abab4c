"""Running the alembic migrations from code, so that they work from an installed package.

The alembic ``Config`` is built programmatically: ``script_location`` points at the
``migrations`` package wherever it is installed, and the process's
:class:`~services.runtime.ground.settings.Settings` travel in ``config.attributes`` so that
``migrations/env.py`` and the revisions (which need the app role's name) read the same
values as every other component. No ``alembic.ini`` is needed.

Execution: alembic renders the revision range as SQL (offline mode, see
``migrations/env.py``) and the script runs over asyncpg in a single transaction
holding a transaction-level advisory lock, so two processes migrating the same
database at once do not interleave: the second waits, re-reads the current revision
and finds nothing left to do. The schema change and the ``alembic_version`` row commit
together or not at all.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import asyncpg
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

import migrations
from services.runtime.ground.settings import Settings

HEAD = "head"
BASE = "base"
_MIGRATION_LOCK = 0x64726163_6D696772  # "dracmigr"


def alembic_config(settings: Settings, buffer: io.StringIO | None = None) -> Config:
    """An alembic configuration for ``settings``, independent of the working directory."""
    config = Config(output_buffer=buffer)
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.attributes["settings"] = settings
    return config


def render(settings: Settings, current: str | None, target: str) -> str:
    """The SQL that moves a database at ``current`` to ``target`` ('' if nothing to do)."""
    buffer = io.StringIO()
    config = alembic_config(settings, buffer)
    script = ScriptDirectory.from_config(config)
    start = current or BASE
    if target == "-1":
        if current is None:
            return ""
        down = script.get_revision(current)
        assert down is not None
        target = str(down.down_revision or BASE)
    if target == HEAD:
        target = str(script.get_current_head())
    if target == start:
        return ""
    ups = {rev.revision for rev in script.iterate_revisions(target, BASE)}
    if target != BASE and start in ups | {BASE}:
        command.upgrade(config, f"{start}:{target}" if current else target, sql=True)
    else:
        command.downgrade(config, f"{start}:{target}", sql=True)
    return buffer.getvalue()


async def _current(connection: asyncpg.Connection) -> str | None:
    if await connection.fetchval("SELECT to_regclass('alembic_version')") is None:
        return None
    version: str | None = await connection.fetchval("SELECT version_num FROM alembic_version")
    return version


async def current_revision_async(settings: Settings) -> str | None:
    """The revision the database is at (``None`` for an empty database)."""
    connection = await asyncpg.connect(settings.database_url)
    try:
        return await _current(connection)
    finally:
        await connection.close()


async def migrate_async(settings: Settings, target: str) -> str | None:
    """Move the database to ``target`` (a revision, ``head``, ``base`` or ``-1``)."""
    connection = await asyncpg.connect(settings.database_url)
    try:
        async with connection.transaction():
            await connection.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
            current = await _current(connection)
            sql = await asyncio.to_thread(render, settings, current, target)
            if sql:
                if current is None:  # an empty alembic_version left by a downgrade to base
                    await connection.execute("DROP TABLE IF EXISTS alembic_version")
                await connection.execute(_strip_transaction(sql))
        return await _current(connection)
    finally:
        await connection.close()


def _strip_transaction(sql: str) -> str:
    """Drop the script's own BEGIN/COMMIT: it runs inside our locked transaction."""
    keep = [line for line in sql.splitlines() if line.strip() not in ("BEGIN;", "COMMIT;")]
    return "\n".join(keep)


async def upgrade_async(settings: Settings, revision: str = HEAD) -> str | None:
    """Migrate up to ``revision``; returns the revision reached."""
    return await migrate_async(settings, revision)


async def downgrade_async(settings: Settings, revision: str = "-1") -> str | None:
    """Migrate down to ``revision`` (default: one step); returns the revision reached."""
    return await migrate_async(settings, revision)


def upgrade(settings: Settings, revision: str = HEAD) -> str | None:
    """:func:`upgrade_async` for synchronous callers (the CLI)."""
    return asyncio.run(upgrade_async(settings, revision))


def downgrade(settings: Settings, revision: str = "-1") -> str | None:
    """:func:`downgrade_async` for synchronous callers (the CLI)."""
    return asyncio.run(downgrade_async(settings, revision))


def current_revision(settings: Settings) -> str | None:
    """:func:`current_revision_async` for synchronous callers."""
    return asyncio.run(current_revision_async(settings))
