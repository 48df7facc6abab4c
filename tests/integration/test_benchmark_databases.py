"""``benchmarks.databases``: each benchmark's database of its own, made on a real server,
migrated, and dropped however the run ends (kept only when asked); a server it cannot
reach ends a benchmark with one line and status 1, never a traceback."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import asyncpg
import pytest

from benchmarks import databases
from services.runtime.ops.embedded import free_port

ROOT = Path(__file__).resolve().parents[2]


async def _exists(admin_url: str, name: str) -> bool:
    root = await asyncpg.connect(admin_url)
    try:
        return bool(await root.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name))
    finally:
        await root.close()


async def test_a_benchmark_database_is_migrated_and_dropped_at_the_end(
    postgres_admin_url: str,
) -> None:
    async with databases.fresh(postgres_admin_url, pool=2) as settings:
        name = settings.database_url.rsplit("/", 1)[1]
        assert name.startswith("dracap_bench_") and settings.pool_max_size == 2
        connection = await asyncpg.connect(settings.database_url)
        try:  # migrated: the log's head is there
            assert await connection.fetchval("SELECT position FROM event_log_head") == 0
        finally:
            await connection.close()
    assert not await _exists(postgres_admin_url, name)


async def test_a_failed_run_drops_its_database_and_a_kept_one_stays_named(
    postgres_admin_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    names: list[str] = []

    async def failing_run() -> None:
        async with databases.fresh(postgres_admin_url) as settings:
            names.append(settings.database_url.rsplit("/", 1)[1])
            raise RuntimeError("the run failed")

    with pytest.raises(RuntimeError):
        await failing_run()
    assert not await _exists(postgres_admin_url, names[0])
    async with databases.fresh(postgres_admin_url, keep=True) as settings:
        kept = settings.database_url.rsplit("/", 1)[1]
    try:
        assert await _exists(postgres_admin_url, kept)
        assert f"kept the database: {settings.database_url}" in capsys.readouterr().out
    finally:
        root = await asyncpg.connect(postgres_admin_url)
        await root.execute(f"DROP DATABASE IF EXISTS {kept} WITH (FORCE)")
        await root.close()


@pytest.mark.parametrize(
    "command",
    [["eventlog"], ["ledger"], ["replay", "--no-file"], ["takeover"]],
    ids=lambda c: c[0],
)
async def test_a_benchmark_whose_server_is_away_says_so_in_one_line(command: list[str]) -> None:
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        f"benchmarks.{command[0]}",
        *command[1:],
        "--admin-url",
        url,
        cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(120):
        _, err = await process.communicate()
    assert process.returncode == 1, err.decode()
    [line] = err.decode().splitlines()
    assert line.startswith(f"{command[0]}: PostgreSQL at {url}: ")
