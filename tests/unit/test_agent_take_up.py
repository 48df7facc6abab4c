"""An agent that cannot take up its claims from the log after its durable was lost says
so in a metric, not only in its log (the next reconcile does the work)."""

from __future__ import annotations

import logging

import pytest

from events.subjects import BusNames
from services.enforcement.agent import Agent
from services.enforcement.enforcers import NoneEnforcer
from services.enforcement.protocol import Report, Reported, ViewAsk, Viewed
from services.enforcement.views import NodeView
from services.runtime.ground.errors import ConflictError
from services.runtime.ground.metrics import REGISTRY
from tests.fixtures.contexts import NO_NATS, handed

NODE = "node-a"
FAILURES = "dracap_agent_take_up_failures_total"


class Plane:
    """The enforcement service, answering every view with ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.views = 0

    async def view(self, ask: ViewAsk) -> tuple[NodeView, Viewed]:
        self.views += 1
        raise self.error

    async def report(self, report: Report) -> Reported:
        raise AssertionError("nothing is reported")

    async def consumer(self) -> bool:
        return True


def _agent(plane: Plane) -> Agent:
    agent = Agent(
        handed(None, BusNames("t"), NO_NATS), node=NODE, enforcer=NoneEnforcer(), plane=plane
    )  # type: ignore[arg-type]
    agent.lease.epoch = 1
    agent.lease.held.set()
    return agent


@pytest.mark.parametrize(
    ("error", "views", "why"),
    [
        (OSError("the enforcement service is away"), 1, "is away"),
        (ConflictError("a delete got in first"), 3, "(conflicts)"),
    ],
)
async def test_a_take_up_that_fails_is_counted_and_logged(
    error: Exception, views: int, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    plane = Plane(error)
    before = REGISTRY.get_sample_value(FAILURES) or 0.0
    with caplog.at_level(logging.WARNING):
        await _agent(plane).take_up()
    assert plane.views == views
    assert REGISTRY.get_sample_value(FAILURES) == before + 1
    assert f"{NODE}: its shares not taken up" in caplog.text and why in caplog.text
