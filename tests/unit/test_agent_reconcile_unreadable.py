"""A reconcile that cannot read the kernel still tries the node's ``bound`` shares.

A share's ``AllocationBound`` can be taken with nothing done (while the share was
``unknown``); the reconcile's last step applies every ``bound`` share of the node, since
nothing else will. When the enforcer cannot even list the limits in force, the reconcile
stops early; that step used to be skipped with it, and such a claim stayed
``allocated`` with no failure recorded and nothing to retry it. Now its apply is tried
and, failing on the same kernel, recorded as a ``LimitFailed`` the agent retries.
"""

from __future__ import annotations

from collections.abc import Sequence

from events import catalog as c
from events.state import ClusterState
from events.subjects import BusNames
from services.enforcement.agent import Agent, Outgoing
from services.enforcement.enforcers import (
    AppliedLimit,
    NoneEnforcer,
    RetryableEnforcementError,
    ShareLimit,
)
from services.enforcement.protocol import ViewAsk
from services.enforcement.views import NodeView, Scope, scope
from tests.fixtures.clock import FakeClock
from tests.fixtures.contexts import NO_NATS, handed
from tests.unit.allocator_fixtures import claim, request
from tests.unit.decision_fixtures import NAMESPACE, NODE, Log, gpu, inventory


class Unreadable(NoneEnforcer):
    """A kernel whose limits can be neither listed nor set."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    async def observe(self) -> dict[str, AppliedLimit]:
        raise RetryableEnforcementError("netlink: cannot list the classes")

    async def apply(self, limit: ShareLimit) -> AppliedLimit:
        self.asked.append(limit.share_id)
        raise RetryableEnforcementError("netlink: cannot list the classes")


class Reconciling(Agent):
    """An agent whose views are cut from ``state`` and whose reports are kept."""

    def __init__(self, state: ClusterState, enforcer: Unreadable) -> None:
        super().__init__(
            handed(None, BusNames("t"), NO_NATS, clock=FakeClock(start=0.0)),
            node=NODE,
            enforcer=enforcer,
            plane=None,  # type: ignore[arg-type]  # never asked: view and report are overridden
        )
        self.now = state
        self.reported: list[c.Event] = []
        self.lease.held.set()

    async def view(self, ask: ViewAsk) -> NodeView:
        return scope(self.now, NODE, Scope(node=True))

    async def report(self, batches: Sequence[Outgoing], processed: Sequence[str] = ()) -> None:
        self.reported += [e for b in batches for e in b.events]


async def test_a_bound_share_is_tried_and_its_failure_recorded_when_the_kernel_cannot_be_read() -> (
    None
):
    log = Log(*inventory(gpu("gpu-0")))
    log.reserve(claim(request("gpu", {"memory": "10Gi"}), name="late", namespace=NAMESPACE))
    state = log.state()
    [share] = state.claims[(NAMESPACE, "late")].share_ids
    assert state.shares[share].state == "bound"
    enforcer = Unreadable()
    agent = Reconciling(state, enforcer)

    assert await agent.reconcile() is None  # not reconciled: the kernel could not be read
    assert enforcer.asked == [share]
    [failed] = [e for e in agent.reported if isinstance(e, c.LimitFailed)]
    assert failed.share_id == share and failed.retryable
    assert failed.retry_at is not None  # the agent's retries take it from here
