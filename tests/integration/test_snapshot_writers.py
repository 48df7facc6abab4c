"""Two snapshot writers on one log (issue 29, item 1).

As processes (``dracap replay snapshot`` twice, each as a member of
``dracap_snapshots``): one holds the lease and writes, the other folds and stands by
(``dracap_service_active{service="snapshots"}`` says which); when the active one is
killed, the other takes over and writes the snapshots that follow.

And safe even when two write at once (what a lease's overlap can let happen for a
moment, :mod:`services.runtime.ops.leadership`): two writers without a lease, racing on
the same log as it grows, store only snapshots that verify, keep the newest
:data:`~services.runtime.store.snapshots.KEEP`, and ``replay verify`` is clean.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.replay.verify import summary, verify
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import EventStore
from services.runtime.store.livestate import HEAD, LiveState
from services.runtime.store.snapshots import KEEP, SnapshotWriter, verify_snapshot
from tests.integration.test_forensics import (  # noqa: F401 (a fixture)
    SnapshotService,
    _admit,
    snapshots_user,
)

EVERY = 5
ACTIVE = 'dracap_service_active{service="snapshots"} 1.0'
STANDING_BY = 'dracap_service_active{service="snapshots"} 0.0'


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[EventStore]:
    async with await EventStore.open(settings) as store:
        yield store


async def _newest_passes(store: EventStore, position: int) -> int:
    """Until a snapshot newer than ``position`` is stored; its position."""
    async with asyncio.timeout(60):
        while True:
            newest = await store.pool.fetchval("SELECT max(position) FROM snapshots")
            if newest is not None and newest > position:
                return int(newest)
            await asyncio.sleep(0.05)


async def _which_is_active(writers: list[SnapshotService]) -> SnapshotService:
    async with asyncio.timeout(60):
        while True:
            shown = [await asyncio.to_thread(w._scrape) or "" for w in writers]
            active = [w for w, text in zip(writers, shown, strict=True) if ACTIVE in text]
            if active and all(ACTIVE in t or STANDING_BY in t for t in shown):
                assert len(active) == 1, "two snapshot writers active at once"
                return active[0]
            await asyncio.sleep(0.05)


async def test_one_snapshot_writer_writes_and_the_other_takes_over(
    store: EventStore,
    snapshots_user: str,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    settings: Settings,
) -> None:
    writers = [SnapshotService(store, snapshots_user, tmp_path / n) for n in ("a", "b")]
    for writer in writers:
        writer.tmp.mkdir()
        await writer.start(EVERY)
    try:
        for writer in writers:
            await writer.started(1)
        active = await _which_is_active(writers)
        other = writers[1] if active is writers[0] else writers[0]
        await _admit(store, 3 * EVERY)
        await _newest_passes(store, 0)
        assert "snapshot written" not in other.log(), "the standby wrote a snapshot"

        assert active.process is not None
        active.process.send_signal(signal.SIGKILL)
        await active.process.wait()
        before = int(await store.pool.fetchval("SELECT max(position) FROM snapshots"))
        await _admit(store, 2 * EVERY)  # at least EVERY past any snapshot: one is due
        await _newest_passes(store, before)  # written by the one left
        await other.metrics_show(ACTIVE)
        assert "snapshot written" in other.log()
        assert await other.stop() == 0, other.log()
    finally:
        for writer in writers:
            if writer.process is not None and writer.process.returncode is None:
                writer.process.kill()
                await writer.process.wait()
    report = await verify(settings)
    assert report.ok, summary(report)


async def test_two_writers_at_once_store_only_snapshots_that_verify(
    store: EventStore, settings: Settings
) -> None:
    stop = asyncio.Event()
    lives = [LiveState(store), LiveState(store)]
    tasks = []
    for live in lives:
        await live.fresh(HEAD)
        writer = SnapshotWriter(
            store.pool, lambda live=live: live.state, every_events=3, check_every_s=0.01
        )
        tasks += [asyncio.create_task(live.run(stop)), asyncio.create_task(writer.run(stop))]
    try:
        for _ in range(10):
            await _admit(store, 7)
        head = await store.head()
        async with asyncio.timeout(60):
            while any(live.state.position < head for live in lives):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    rows = await store.pool.fetch(
        "SELECT s.position, s.schema_version, s.payload, e.event_id::text FROM snapshots s "
        "JOIN events e ON e.position = s.position ORDER BY s.position"
    )
    assert 0 < len(rows) <= KEEP
    assert rows[-1]["position"] == head  # both stopped at the head: one of them wrote it
    for row in rows:
        verify_snapshot(row[0], row[1], bytes(row[2]), head, row[3])  # raises if torn
    report = await verify(settings)
    assert report.ok, summary(report)
