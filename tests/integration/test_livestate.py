"""LiveState.fresh against the real log: shared reads, SEEN, positions still to come."""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import AsyncIterator, Sequence

import pytest

from events import catalog
from events.envelopes import Envelope, stream_of
from events.eventcodec import encode_payload
from services.runtime.delivery.projecting import Projector
from services.runtime.ground.settings import Settings
from services.runtime.store.appends import Batch, Metadata
from services.runtime.store.eventstore import EventStore
from services.runtime.store.livestate import HEAD, SEEN, LiveState
from services.runtime.store.rows import COLUMNS
from tests.fixtures.polling import until
from tests.integration import sample as s
from tests.integration.scenario import put

META = Metadata(actor="test")


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[EventStore]:
    async with await EventStore.open(settings) as store:
        yield store


async def _admit(store: EventStore, name: str) -> int:
    event = catalog.ClaimAdmitted(namespace="t", name=name)
    [env] = await store.append_many([Batch(f"claim:t/{name}", 0, [event])], META)
    return env.position


async def test_concurrent_callers_share_reads(store: EventStore) -> None:
    live = LiveState(store)
    await _admit(store, "a")
    reads = live._reads_started
    states = await asyncio.gather(*(live.fresh(HEAD) for _ in range(8)))
    # the first read, then one that began after every other call: they share it
    assert live._reads_started - reads == 2
    assert all(s is live.state and s.claim("t", "a") is not None for s in states)


async def test_seen_reads_the_log_when_the_store_knows_of_no_commit(
    store: EventStore, settings: Settings
) -> None:
    async with await EventStore.open(settings) as other:  # another process's store
        await _admit(other, "a")
    assert store.committed_head() is None  # not listening: it knows nothing
    state = await LiveState(store).fresh(SEEN)
    assert state.claim("t", "a") is not None


async def test_a_position_reached_reads_nothing(store: EventStore) -> None:
    live = LiveState(store)
    position = await _admit(store, "a")
    await live.fresh(position)
    reads = live._reads_started
    assert (await live.fresh(position)).position >= position
    assert live._reads_started == reads


async def test_a_position_still_to_come_is_waited_for(store: EventStore) -> None:
    live = LiveState(store)
    head = await _admit(store, "a")
    waiting = asyncio.create_task(live.fresh(head + 1, timeout=30))
    await live.fresh(head)  # meanwhile the waiter reads what is there, then waits
    await _admit(store, "b")
    state = await waiting
    assert state.position >= head + 1 and state.claim("t", "b") is not None


async def test_a_position_that_does_not_come_times_out(store: EventStore) -> None:
    live = LiveState(store)
    head = await _admit(store, "a")
    with pytest.raises(TimeoutError):
        await live.fresh(head + 1, timeout=0.2)
    assert live.state.position == head  # what was committed is folded all the same


async def test_a_catch_up_without_listeners_folds_as_one_with_them(store: EventStore) -> None:
    """The row path of a read (nobody listens) gives the envelope path's state, stream
    versions, inventory generation and skipped violations; listeners do not hear of an
    event the fold refused."""
    r1 = s.reserved("t", "c1", "gpu-0", "50Gi")
    await put(store, s.slice_published(), s.claim_submitted("t", "c1"), r1, s.bound(r1))
    head = await store.head()
    greedy = s.reserved("t", "greedy", "gpu-0", "60Gi")  # 110Gi of 80Gi: the fold refuses it
    later = catalog.ClaimAdmitted(namespace="t", name="later")
    rows = [
        (
            head + i + 1,
            uuid.uuid4(),
            stream_of(e),
            version,
            catalog.tag_of(e),
            catalog.schema_version_of(e),
            "t",
            "test",
            str(uuid.uuid4()),
            None,
            datetime.datetime.now(datetime.UTC),
            encode_payload(e),
        )
        for i, (e, version) in enumerate(((greedy, 2), (later, 1)))  # r1 took gpu-0's 1
    ]  # copied in past the database's guards, as a broken writer might have
    async with store.pool.acquire() as connection:
        await connection.copy_records_to_table("events", records=rows, columns=list(COLUMNS))
        await connection.execute("UPDATE event_log_head SET position = $1", head + 2)

    heard: list[int] = []
    listened = LiveState(store, batch_size=3)
    listened.subscribe(lambda envelope: heard.append(envelope.position))
    quiet = LiveState(store, batch_size=3)
    for live in (listened, quiet):
        await live.fresh(HEAD)
    assert heard == [p for p in range(1, head + 3) if p != head + 1]  # not the refused one
    assert quiet.state == listened.state and quiet.state.position == head + 2
    assert quiet.state.claim("t", "later") is not None
    assert [p for p, _ in quiet.violations] == [p for p, _ in listened.violations] == [head + 1]
    assert quiet.inventory_generation == listened.inventory_generation == 1
    assert quiet._versions == listened._versions
    assert await quiet.stream_version(stream_of(greedy)) == 2


async def test_a_view_followed_on_demand_reads_the_log_only_when_asked(
    store: EventStore, settings: Settings
) -> None:
    """The audit and billing subscribers' view (issue 25): commits announced while nobody
    asks are not read (a tailer reads one per commit); a projector's batch then reads
    them at once, in one read. (Refused events left out: test_readers.py.)"""
    live = LiveState(store)
    await live.fresh(HEAD)
    await store.wait_for_new(0, 0.01)  # listening: NOTIFY announces each commit
    stop = asyncio.Event()
    following = asyncio.create_task(live.follow_on_demand(stop))
    try:
        await until(lambda: live.tailing, 10, "the view to follow the log")
        reads = live._reads_started
        async with await EventStore.open(settings) as other:  # another process's commits
            heads = [await _admit(other, f"c{i}") for i in range(5)]
        await until(lambda: store.known_head >= heads[-1], 30, "every commit announced")
        assert live._reads_started == reads and live.state.position < heads[0]

        caught: list[int] = []

        async def apply(_connection: object, envs: Sequence[Envelope]) -> None:
            caught.extend(e.position for e in envs)

        await Projector(store, "on-demand", apply, live=live).catch_up(heads[-1])
        assert live._reads_started == reads + 1 and live.state.position >= heads[-1]
        assert caught[-5:] == heads
    finally:
        stop.set()
        await following
    assert not live.tailing
