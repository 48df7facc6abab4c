"""An append retried after its connection broke is written once (issue 29, item 3).

A real PostgreSQL; the fault is the one a failover makes: the session breaks while the
append runs, before the client learns whether it was committed. Here the first try
runs for real and its session is then terminated — committed, but unanswered — or
terminated before it is sent. Either way the caller gets the append's envelopes, and
the log holds its events exactly once (looked up by event id, never written twice).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import asyncpg
import msgspec
import pytest

from events import catalog
from events.envelopes import Envelope
from services.runtime.ground.errors import ConflictError, ConnectionLost, RetryableError
from services.runtime.ground.settings import Settings
from services.runtime.store.appends import Batch, Pending
from services.runtime.store.eventstore import EventStore, session_gone
from tests.integration import sample as s


class _BreakingStore(EventStore):
    """A store whose first try of an append loses its session, after (``committed``)
    or before the statement ran."""

    def __init__(self, *args: object, committed: bool, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.committed = committed
        self.tries = 0

    async def _append_pooled(self, batches: Sequence[Batch], pending: Pending) -> list[Envelope]:
        self.tries += 1
        if self.tries > 1:
            return await super()._append_pooled(batches, pending)
        async with self.pool.acquire() as connection:
            if self.committed:
                await self._write(connection, batches, pending)
            connection.terminate()
        raise ConnectionLost("the session broke during the append (injected)")


@pytest.fixture
async def plain(settings: Settings) -> AsyncIterator[EventStore]:
    async with await EventStore.open(settings) as store:
        yield store


async def _breaking(plain: EventStore, settings: Settings, *, committed: bool) -> _BreakingStore:
    return _BreakingStore(plain.pool, settings, committed=committed)


def _claim(name: str) -> list[catalog.Event]:
    return [s.claim_submitted("a", name), catalog.ClaimAdmitted(namespace="a", name=name)]


@pytest.mark.parametrize("committed", [True, False], ids=["committed", "not-committed"])
@pytest.mark.parametrize("expected", [0, None], ids=["expected-version", "any-version"])
async def test_a_retried_append_is_written_once(
    plain: EventStore, settings: Settings, committed: bool, expected: int | None
) -> None:
    store = await _breaking(plain, settings, committed=committed)
    heard: list[list[Envelope]] = []
    store.on_commit(heard.append)
    envelopes = await store.append("claim:a/x", expected, _claim("x"), actor="t")

    assert store.tries == (1 if committed else 2), "a committed append is found, not sent"
    assert [(e.stream_version, e.position) for e in envelopes] == [(1, 1), (2, 2)]
    logged = await plain.read_stream("claim:a/x")
    assert [e.event_id for e in logged] == [e.event_id for e in envelopes]
    assert await plain.head() == 2, "written once"
    assert [[e.event_id for e in envs] for envs in heard] == [[e.event_id for e in envelopes]]


async def test_a_real_conflict_after_a_break_stays_a_conflict(
    plain: EventStore, settings: Settings
) -> None:
    await plain.append("claim:a/x", 0, _claim("x"), actor="other")
    store = await _breaking(plain, settings, committed=False)
    with pytest.raises(ConflictError):
        await store.append("claim:a/x", 0, _claim("x"), actor="t")
    assert await plain.head() == 2


async def test_retries_end_at_the_deadline(plain: EventStore, settings: Settings) -> None:
    class _Gone(EventStore):
        async def _append_pooled(
            self, batches: Sequence[Batch], pending: Pending
        ) -> list[Envelope]:
            raise ConnectionLost("the server is gone (injected)")

        async def _stored_already(self, pending: Pending) -> list[Envelope]:
            return []

    store = _Gone(plain.pool, msgspec.structs.replace(settings, failover_timeout_s=0.3))
    with pytest.raises(RetryableError):
        await store.append("claim:a/y", 0, _claim("y"), actor="t")
    assert await plain.head() == 0


async def test_a_pooled_session_that_ended_reads_as_broken(plain: EventStore) -> None:
    """asyncpg takes a connection that closed back into its pool at once and detaches the
    caller's proxy, whose ``is_closed()`` then raises: the store's appends and reads of
    the log must still see a broken session there (and retry), not that error."""
    async with plain.pool.acquire() as connection:
        connection.terminate()  # what a session that broke ends in
        with pytest.raises(asyncpg.InterfaceError):
            connection.is_closed()
        assert session_gone(connection)
