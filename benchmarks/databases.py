"""A benchmark's own database: made on a PostgreSQL server, migrated, dropped at the end.

Every benchmark that needs PostgreSQL takes ``--admin-url`` (:func:`add_admin_url`: the
server's administrator URL, by default ``DRACAP_TEST_DATABASE_URL`` or the local server)
and runs on a database of its own, with a fresh name (``dracap_bench_<hex>``), so that
runs never meet each other's rows and nothing of a run is left behind: :func:`fresh`
creates it, migrates it to the head, and drops it when the run ends, however it ends
(``keep``: left in place and named, for a look afterwards). A server it cannot reach is
:class:`~services.runtime.bus.endpoints.ServerUnavailable`, which
:func:`benchmarks.stopping.run` ends the command with in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import uuid
from collections.abc import AsyncIterator

import asyncpg
import msgspec

from migrations import runner as migrating
from services.runtime.bus.endpoints import reaching
from services.runtime.ground.settings import Settings

__all__ = ["LOCAL_ADMIN_URL", "add_admin_url", "fresh"]

#: the administrator URL a benchmark uses without ``--admin-url`` or the environment's
LOCAL_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def add_admin_url(parser: argparse.ArgumentParser) -> None:
    """``--admin-url``: the server a fresh database is made on."""
    parser.add_argument(
        "--admin-url",
        default=os.environ.get("DRACAP_TEST_DATABASE_URL", LOCAL_ADMIN_URL),
        help="PostgreSQL server (a fresh database is created on it)",
    )


@contextlib.asynccontextmanager
async def fresh(
    admin_url: str, *, pool: int = 4, nats_url: str | None = None, keep: bool = False
) -> AsyncIterator[Settings]:
    """The settings of a new, migrated database on ``admin_url``'s server (``pool``: the
    services' pool size; ``nats_url``, if given, carried along); dropped at the end
    unless ``keep``."""
    name = f"dracap_bench_{uuid.uuid4().hex[:8]}"
    with reaching("PostgreSQL", admin_url):
        root = await asyncpg.connect(admin_url)
    try:
        await root.execute(f"CREATE DATABASE {name}")
    finally:
        await root.close()
    settings = Settings(database_url=admin_url.rsplit("/", 1)[0] + "/" + name, pool_max_size=pool)
    if nats_url is not None:
        settings = msgspec.structs.replace(settings, nats_url=nats_url)
    try:
        await migrating.upgrade_async(settings)
        yield settings
    finally:
        if not keep:
            root = await asyncpg.connect(admin_url)
            try:
                await root.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            finally:
                await root.close()
        else:
            print(f"kept the database: {settings.database_url}", flush=True)
