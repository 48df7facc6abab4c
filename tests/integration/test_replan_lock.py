"""The planner's round without a message never gives the pool a session holding its lock.

``ReservationService.replan`` takes the planner lock (a session lock) on a pooled
connection, and the pool resets nothing when a connection comes back
(``eventstore._keep_session``). A round cancelled as the lock was granted — the server
granted it, the caller never learned (a task cancelled while its service restarts) —
used to give the session back holding the lock: every later ask (``dracap_try_lock``,
then ``dracap_lock``) waited for a session nobody used. The round now closes such a
session, and the server drops the lock with it.
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from services.reservation import service as reservation
from services.reservation.service import ReservationService
from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import EventStore
from tests.fixtures.contexts import folded

HOLDERS = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objid = $1 "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


async def test_a_round_cancelled_as_its_lock_was_granted_leaves_no_session_holding_it(
    settings: Settings, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = reservation.take_lock

    async def granted_then_cancelled(connection: object, key: int) -> tuple[int, bool]:
        await real(connection, key)  # type: ignore[arg-type]  # the server granted it...
        raise asyncio.CancelledError  # ...and the round was cancelled before it learned

    key = reservation.PLANNER_LOCK & 0xFFFFFFFF  # pg_locks' objid: the key's low half
    store = await EventStore.open(settings)
    admin = await asyncpg.connect(settings.database_url)
    nc, js = await connect_bus(nats_url)  # the worker's; the round itself uses no bus
    try:
        worker = ReservationService(folded(store, js=js))
        monkeypatch.setattr(reservation, "take_lock", granted_then_cancelled)
        with pytest.raises(asyncio.CancelledError):
            await worker.replan()
        async with asyncio.timeout(30):  # the server ends the closed session's backend
            while await admin.fetchval(HOLDERS, key):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        monkeypatch.setattr(reservation, "take_lock", real)
        async with asyncio.timeout(30):  # the next round gets the lock (it would wait forever)
            await worker.replan()
        assert await admin.fetchval(HOLDERS, key) == 0
    finally:
        await nc.close()
        await admin.close()
        await store.close()
