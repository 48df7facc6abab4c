"""The commit hand-over (services.runtime.store.handover); first_of and all_of
(services.runtime.ground.waiting)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from events import catalog as c
from events.envelopes import Envelope, new_envelope
from services.runtime.ground.waiting import all_of, first_of
from services.runtime.store.handover import Handover


def _envelopes(*positions: int) -> list[Envelope]:
    event = c.ClaimAdmitted(namespace="t", name="a")
    return [new_envelope(event, stream_version=p, actor="t", position=p) for p in positions]


class _Reader:
    """A reader at ``position`` with a hand-over of at most ``kept`` envelopes."""

    def __init__(self, position: int = 0, kept: int = 100) -> None:
        self.position = position
        self.handover = Handover(lambda: self.position, kept=kept)

    def take(self, limit: int | None = None) -> list[int]:
        taken = [env.position for env in self.handover.take(limit)]
        if taken:
            self.position = taken[-1]
        return taken


def test_what_comes_next_is_taken_in_order() -> None:
    reader = _Reader(position=2)
    reader.handover.offer(_envelopes(5, 3, 4, 2, 1))  # at or before the reader: dropped
    assert len(reader.handover) == 3 and reader.handover.offered.is_set()
    assert reader.take() == [3, 4, 5]
    assert len(reader.handover) == 0


def test_a_gap_stops_the_take_until_the_reader_passes_it() -> None:
    reader = _Reader()
    reader.handover.offer(_envelopes(1, 2, 4, 5))
    assert reader.take() == [1, 2]
    assert reader.take() == []  # position 3 is another process's: read from the log
    reader.position = 3
    assert reader.take() == [4, 5]


def test_a_take_is_limited_and_the_rest_waits() -> None:
    reader = _Reader()
    reader.handover.offer(_envelopes(1, 2, 3))
    assert reader.take(limit=2) == [1, 2]
    assert reader.take(limit=2) == [3]


def test_what_the_reader_read_from_the_log_is_discarded() -> None:
    reader = _Reader()
    reader.handover.offer(_envelopes(1, 2, 3))
    reader.position = 2  # it read 1 and 2 from the log
    reader.handover.discard_passed()
    assert len(reader.handover) == 1
    assert reader.take() == [3]


def test_a_reader_far_behind_gets_no_more_offers() -> None:
    reader = _Reader(kept=2)
    reader.handover.offer(_envelopes(2, 3, 4))
    reader.handover.offer(_envelopes(5))  # more than kept already wait: the log has it
    assert len(reader.handover) == 3


class _Store:
    def __init__(self) -> None:
        self.listeners: list[Callable[[list[Envelope]], None]] = []

    def on_commit(self, listener: Callable[[list[Envelope]], None]) -> Callable[[], None]:
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)


def test_offers_arrive_while_attached_and_are_forgotten_after() -> None:
    reader, store = _Reader(), _Store()
    with reader.handover.attached(store):  # type: ignore[arg-type]
        for listener in store.listeners:
            listener(_envelopes(2))
        assert len(reader.handover) == 1
    assert store.listeners == [] and len(reader.handover) == 0


# --- first_of ---------------------------------------------------------------------------


async def _forever(cancelled: list[str], name: str, running: asyncio.Event | None = None) -> None:
    if running is not None:
        running.set()
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.append(name)
        raise


async def test_the_first_done_ends_the_wait_and_the_others_are_cancelled() -> None:
    cancelled: list[str] = []
    done = asyncio.Event()
    done.set()
    await first_of(_forever(cancelled, "a"), done.wait(), _forever(cancelled, "b"))
    assert sorted(cancelled) == ["a", "b"]


async def test_a_failure_of_the_first_done_is_raised() -> None:
    async def fails() -> None:
        raise ConnectionResetError("the database went away")

    cancelled: list[str] = []
    with pytest.raises(ConnectionResetError):
        await first_of(fails(), _forever(cancelled, "stop"))
    assert cancelled == ["stop"]


async def test_cancelling_the_waiter_cancels_everything_it_waits_for() -> None:
    cancelled: list[str] = []
    a, b = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(first_of(_forever(cancelled, "a", a), _forever(cancelled, "b", b)))
    await a.wait()
    await b.wait()  # both waits run
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(cancelled) == ["a", "b"]


# --- all_of -----------------------------------------------------------------------------


async def test_all_of_waits_for_every_one() -> None:
    finished: list[str] = []

    async def after(name: str, ticks: int) -> None:
        for _ in range(ticks):
            await asyncio.sleep(0)
        finished.append(name)

    await all_of(after("a", 3), after("b", 1), after("c", 5))
    assert sorted(finished) == ["a", "b", "c"]


async def test_a_failure_cancels_the_siblings_before_it_is_raised() -> None:
    """A worker's consumer that fails must not leave the others running beside the
    restarted worker (asyncio.gather would)."""
    cancelled: list[str] = []
    running = asyncio.Event()

    async def fails() -> None:
        await running.wait()
        raise ConnectionResetError("the broker went away")

    with pytest.raises(ConnectionResetError):
        await all_of(_forever(cancelled, "a", running), fails(), _forever(cancelled, "b"))
    assert sorted(cancelled) == ["a", "b"]
