"""The fault harness's view of the log reads it again from position 0 after a lost
connection (``benchmarks/hachecks.py``): a commit the old primary showed and the new
one never got must not hide the appends that take its positions.

The failover is played on one server: the view reads an event, the event is taken out
of the log (as a promoted standby never got it) and the view's session is ended, then
another event is appended at the same position.
"""

from __future__ import annotations

import asyncpg

from benchmarks.hachecks import LogView
from events.quantities import Quantity
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import EventStore
from tests.fixtures.lostcommits import admit, lose_last


async def test_a_view_that_connects_again_reads_the_log_from_the_start(
    settings: Settings, db: asyncpg.Connection, database_url: str
) -> None:
    view = LogView(Settings(database_url=database_url), "t", {("d", "p", "x"): Quantity(1)})
    async with await EventStore.open(settings) as store:
        await _play_a_failover(store, db, view)


async def _play_a_failover(store: EventStore, db: asyncpg.Connection, view: LogView) -> None:
    try:
        await admit(store, "a")
        ghost, _ = await admit(store, "ghost")
        await view.refresh()
        assert view.submitted == {"a", "ghost"}
        await lose_last(db, ghost)
        assert view._connection is not None
        await db.execute("SELECT pg_terminate_backend($1)", view._connection.get_server_pid())
        assert (await admit(store, "b"))[0] == ghost  # the lost event's position, taken again
        for _ in range(2):  # the first call may learn that its session is gone
            try:
                await view.refresh()
                break
            except Exception:  # (as the harness does: it reads again on its next call)
                continue
        assert view.submitted == {"a", "b"}
        assert view.state.position == ghost
    finally:
        await view.close()
