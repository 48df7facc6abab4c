"""The agent's device health check asks for a view of the whole node only when it has a
finding to hold against the log.

A view of the whole node costs the enforcement service and the agent in proportion to
the node's live shares (every claim and share of it, encoded and decoded). An agent
with no device scan whose enforcer reports no problem has nothing to compare: its first
check (and the first under each new lease) used to ask for one anyway — in ``dracap up``
four agents at once, ten seconds after the start, a stall of a few hundred
milliseconds for every claim in flight at a few thousand live claims (issue 25).
"""

from __future__ import annotations

from events.subjects import BusNames
from services.enforcement.agent import Agent
from services.enforcement.enforcers import NoneEnforcer
from services.enforcement.protocol import ViewAsk
from services.enforcement.views import NodeView
from tests.fixtures.clock import FakeClock
from tests.fixtures.contexts import NO_NATS, handed

NODE = "node-a"
DEVICE = ("net.example.com", "pool", "eth0")


class Troubled(NoneEnforcer):
    """An enforcer that finds one device broken."""

    async def health(self) -> dict[tuple[str, str, str], str | None]:
        return {DEVICE: "link down"}


class Viewing(Agent):
    """An agent whose views are recorded and answered with an empty node."""

    def __init__(self, enforcer: NoneEnforcer) -> None:
        super().__init__(
            handed(None, BusNames("t"), NO_NATS, clock=FakeClock(start=0.0)),
            node=NODE,
            enforcer=enforcer,
            plane=None,  # type: ignore[arg-type]  # never asked: view is overridden
        )
        self.asked: list[ViewAsk] = []
        self.lease.held.set()

    async def view(self, ask: ViewAsk) -> NodeView:
        self.asked.append(ask)
        return NodeView(node=NODE, position=0)


async def test_an_agent_with_nothing_to_report_asks_no_view_of_its_node() -> None:
    agent = Viewing(NoneEnforcer())
    assert await agent.check_health() == []
    assert await agent.check_health() == []
    assert agent.asked == []


async def test_a_problem_the_enforcer_finds_is_held_against_a_view_of_the_node() -> None:
    agent = Viewing(Troubled())
    assert await agent.check_health() == []  # the empty view holds no such device
    assert agent.asked == [ViewAsk(node=True)]
    await agent.check_health()  # the same finding: not asked again
    assert agent.asked == [ViewAsk(node=True)]
