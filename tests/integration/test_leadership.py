"""The lease of a single-active service (:mod:`services.runtime.ops.leadership`), against the
real PostgreSQL: one of two instances is active; when the server ends the holder's
session (what a crash, a partition past the idle timeout or a failover come to), the
holder's work is told to stop, it no longer counts itself active, and the other takes
over; a holder whose session sits idle past its timeout loses it; and through a
failover of a primary and its synchronous standby (``tests/fixtures/replicas.py``) the
holder stands by and one instance leads on the promoted server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import asyncpg
import pytest

from services.runtime.ground.errors import NotActive
from services.runtime.ground.settings import Settings
from services.runtime.ops.leadership import Leadership
from tests.fixtures.replicas import PostgresPair, postgres_binaries
from tests.integration.test_failover import ha_settings, pair  # noqa: F401 (fixtures)

KEY = 0x64726163_617000FF  # a test's own: no service's


class Instance:
    """One instance running its lease, its work recording each term."""

    def __init__(self, lease: Leadership) -> None:
        self.lease = lease
        self.terms: list[asyncio.Event] = []  # per term: set when its stop came
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(lease.run(self.stop, self._work))

    async def _work(self, stop: asyncio.Event) -> None:
        self.terms.append(stop)
        await stop.wait()

    def active(self) -> bool:
        return bool(self.terms) and not self.terms[-1].is_set() and self.lease.active()


@contextlib.asynccontextmanager
async def _instances(
    settings: Settings, count: int, **options: float
) -> AsyncIterator[list[Instance]]:
    instances = [
        Instance(Leadership(settings, KEY, "test", retry_s=0.05, **options)) for _ in range(count)
    ]
    try:
        yield instances
    finally:
        for instance in instances:
            instance.stop.set()
        await asyncio.wait_for(asyncio.gather(*(i.task for i in instances)), 15)


async def _one_active(instances: list[Instance]) -> Instance:
    async with asyncio.timeout(30):
        while True:
            active = [i for i in instances if i.active()]
            assert len(active) <= 1, "two instances active at once"
            if active:
                return active[0]
            await asyncio.sleep(0.01)


async def _end_sessions(db: asyncpg.Connection) -> int:
    """End the session holding the test's key, as the server does for a dead client."""
    return int(
        await db.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_locks "
            "WHERE locktype = 'advisory' AND granted "
            "AND ((classid::bigint << 32) | objid::bigint) = $1",
            KEY,
        )
    )


async def test_one_instance_is_active_and_the_other_takes_over_when_its_session_ends(
    settings: Settings, db: asyncpg.Connection
) -> None:
    async with _instances(settings, 2) as instances:
        first = await _one_active(instances)
        assert await _end_sessions(db) == 1
        async with asyncio.timeout(30):
            await first.terms[-1].wait()  # its work was told to stop
        assert not first.lease.active()
        with pytest.raises(NotActive):
            first.lease.check()
        second = await _one_active(instances)
        assert second is not first or len(first.terms) == 2  # or it was granted it again


async def test_a_holder_whose_session_sits_idle_past_its_timeout_loses_it(
    settings: Settings, db: asyncpg.Connection
) -> None:
    """No pings (as from a paused process): the server ends the session after the
    lease's time, so the key is free for another, and the holder no longer counts
    itself active."""
    lease = Leadership(settings, KEY, "test", ttl_s=0.5, retry_s=0.05)
    stop = asyncio.Event()
    granted = asyncio.Event()

    async def work(its_stop: asyncio.Event) -> None:
        for task in asyncio.all_tasks():
            if task.get_coro().__qualname__ == "Leadership._keep":  # type: ignore[union-attr]
                task.cancel()  # no more pings
        granted.set()
        await its_stop.wait()

    task = asyncio.create_task(lease.run(stop, work))
    try:
        async with asyncio.timeout(30):
            await granted.wait()
            while not await db.fetchval("SELECT pg_try_advisory_lock($1)", KEY):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert not lease.active()
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await db.execute("SELECT pg_advisory_unlock_all()")


@pytest.mark.skipif(postgres_binaries() is None, reason="no PostgreSQL server binaries")
async def test_after_a_failover_the_holder_stands_by_and_one_leads_on_the_new_primary(
    ha_settings: Settings,  # noqa: F811 (test_failover's fixture: a primary and a standby)
    pair: PostgresPair,  # noqa: F811
) -> None:
    """The new primary holds no locks: the holder learns at its next ping that its
    session died with the old primary and stops its work; once the standby is promoted,
    one instance leads again there."""
    async with _instances(ha_settings, 2) as instances:
        first = await _one_active(instances)
        term = first.terms[-1]
        pair.kill_primary()
        async with asyncio.timeout(60):
            await term.wait()
        assert not first.lease.active()
        pair.promote()
        await _one_active(instances)
