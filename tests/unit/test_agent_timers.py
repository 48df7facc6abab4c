"""The node agent's timers run on its clock: a test advances time instead of sleeping.

Two timers of :class:`~services.enforcement.agent.Agent` are shown here on a
:class:`~tests.fixtures.clock.FakeClock`: the retry of failed limits, due at the wall
time the enforcement service last answered (``next_retry_at``), and the tick of the
device health and use checks (``health_interval``). The agent is the real one; what it
would do when a timer fires (ask for a view and report) is only recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from events.state import ClusterState
from events.subjects import BusNames
from services.enforcement.agent import Agent
from services.enforcement.decisions import Task, Written
from services.enforcement.enforcers import NoneEnforcer
from services.enforcement.protocol import ViewAsk
from tests.fixtures.clock import FakeClock
from tests.fixtures.contexts import NO_NATS, handed

NODE = "node-a"


class Plane:
    """The enforcement service: never asked in these tests."""

    async def consumer(self) -> bool:
        return True


class Recording(Agent):
    """An agent whose retries and checks record when they ran instead of reporting."""

    def __init__(self, clock: FakeClock, health_interval: float = 0.0) -> None:
        super().__init__(
            handed(None, BusNames("t"), NO_NATS, clock=clock),  # nothing here talks to the bus
            node=NODE,
            enforcer=NoneEnforcer(),
            plane=Plane(),  # type: ignore[arg-type]
            health_interval=health_interval,
        )
        self.fake = clock
        self.retried: list[float] = []
        self.checked: list[float] = []
        self.decided_at: list[datetime.datetime] = []

    async def retry_due(self) -> Written | None:
        self.retried.append(self.fake.monotonic())
        self._note_retry(None)  # as the service answers once nothing else is due
        return None

    async def carry_out(
        self,
        ask: ViewAsk,
        decide: Callable[[ClusterState], Sequence[Task]],
        now: datetime.datetime | None = None,
    ) -> Written | None:
        assert now is not None
        self.decided_at.append(now)
        return None

    async def check_health(self) -> list:  # type: ignore[type-arg]
        self.checked.append(self.fake.monotonic())
        return []

    async def check_use(self) -> list:  # type: ignore[type-arg]
        return []


@contextlib.asynccontextmanager
async def running(
    work: Callable[[asyncio.Event], Coroutine[Any, Any, None]],
) -> AsyncIterator[asyncio.Event]:
    """Run ``work(stop)`` as a task; on the way out stop it and see it end by itself."""
    stop = asyncio.Event()
    task = asyncio.ensure_future(work(stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)  # a hang fails, not a hold-up


async def test_a_retry_runs_when_the_clock_reaches_its_due_time_not_before() -> None:
    clock = FakeClock(start=0.0)
    agent = Recording(clock)
    async with running(agent._retry):
        await clock.advance(0)
        agent._note_retry(clock.utcnow() + datetime.timedelta(seconds=2))
        await clock.advance(1.9)
        assert agent.retried == []
        await clock.advance(0.1)
        assert agent.retried == [2.0]
        await clock.advance(60, steps=4)  # nothing more is due
        assert agent.retried == [2.0]
        # a due time already past when the service answers it is tried at once
        agent._note_retry(clock.utcnow() - datetime.timedelta(seconds=5))
        await clock.advance(0)
        assert agent.retried == [2.0, 62.0]


async def test_a_retry_decides_on_the_wall_time_of_the_agents_clock() -> None:
    clock = FakeClock(start=0.0, wall=datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC))
    agent = Recording(clock)
    await clock.advance(90)
    await Agent.retry_due(agent)
    assert agent.decided_at == [datetime.datetime(2030, 1, 1, 0, 1, 30, tzinfo=datetime.UTC)]


async def test_device_health_is_checked_once_per_interval_of_the_clock() -> None:
    clock = FakeClock(start=0.0)
    agent = Recording(clock, health_interval=10.0)
    async with running(agent._watch):
        await clock.advance(9.9)
        assert agent.checked == []
        await clock.advance(0.1)
        assert agent.checked == [10.0]
        await clock.advance(30, steps=3)
        assert agent.checked == [10.0, 20.0, 30.0, 40.0]
