"""The reservation service's grants follow the live state at the cost of what changes.

The service keeps the allocator's grants from the events it sees (a reservation adds,
a release or a fence takes away). A fence used to walk every grant of the cluster to
find the released ones; it walks its node's now, with the same grants left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from events import catalog as c
from events.envelopes import Envelope
from events.fold import apply
from events.state import ClusterState
from events.subjects import BusNames
from services.reservation.deriving import live_grants
from services.reservation.service import REPLAN_RETRY_S, ReservationService
from services.runtime.ground.metrics import REGISTRY
from services.runtime.store.logandfold import LogAndFold
from tests.fixtures.clock import FakeClock
from tests.fixtures.contexts import NO_NATS, handed
from tests.unit.decision_fixtures import Log, gpu, inventory, memory_claim


class _Live:
    """What the service reads of a LiveState here: the state, its listeners."""

    def __init__(self) -> None:
        self.state = ClusterState()
        self.listeners: list[Callable[[Envelope], None]] = []

    def subscribe(self, listener: Callable[[Envelope], None]) -> Callable[[], None]:
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)

    def on_replaced(self, _listener: Callable[[ClusterState], None]) -> None:
        """Never replaced here (a snapshot check's mismatch replaces a real view)."""

    def add(self, env: Envelope) -> None:
        apply(self.state, env)
        for listener in self.listeners:
            listener(env)


class _Walked(dict[str, Any]):
    walks = 0

    def __iter__(self) -> Any:
        type(self).walks += 1
        return super().__iter__()


def test_a_fence_forgets_its_nodes_grants_without_walking_the_others() -> None:
    log = Log(*inventory(gpu("gpu-0", "30Gi"), node="node-a"))
    log.add(*inventory(gpu("gpu-0", "30Gi"), node="node-b")[1:2])
    for node in ("node-a", "node-b"):
        log.add(c.NodeLeaseAcquired(node=node, epoch=1, boot_id="b", ttl_ms=10_000))
    log.reserve(*(memory_claim(f"c{i}", "5Gi") for i in range(12)))
    nodes = {s.node for s in log.state().shares.values()}
    assert nodes == {"node-a", "node-b"}, nodes
    live = _Live()
    context = handed(LogAndFold(None, live), BusNames(prefix="t"), NO_NATS, NO_NATS)  # type: ignore[arg-type]
    service = ReservationService(context)
    for env in log.envelopes:
        live.add(env)
    service._counted = _Walked(service._counted)
    for env in log.add(
        c.NodeLeaseExpired(node="node-a", epoch=1), c.NodeFenced(node="node-a", epoch=1)
    ):
        live.add(env)
    assert _Walked.walks == 0  # (before the checks below walk it themselves)
    assert set(service._counted) == {sid for sid, _ in live_grants(live.state)}
    assert {live.state.shares[s].node for s in service._counted} == {"node-b"}


class _FailingReplans(ReservationService):
    """A service whose first replan finds the database away; the clock of each is kept."""

    def __init__(self, clock: FakeClock) -> None:
        stores = LogAndFold(None, _Live())  # type: ignore[arg-type]
        context = handed(stores, BusNames(prefix="t"), NO_NATS, NO_NATS, clock=clock)
        super().__init__(context)
        self.fake = clock
        self.replans: list[float] = []

    async def replan(self) -> None:
        self.replans.append(self.fake.monotonic())
        if len(self.replans) == 1:
            raise OSError("the database is away")


async def test_a_failed_replan_is_tried_again_once_its_pause_passed_on_the_clock() -> None:
    clock = FakeClock(start=0.0)
    service = _FailingReplans(clock)
    stop = asyncio.Event()
    running = asyncio.ensure_future(service._replanner(stop))
    failed = REGISTRY.get_sample_value("dracap_reservation_replan_failures_total") or 0.0
    service._replan.set()
    await clock.advance(0)
    assert service.replans == [0.0]
    assert REGISTRY.get_sample_value("dracap_reservation_replan_failures_total") == failed + 1
    await clock.advance(REPLAN_RETRY_S - 0.1)
    assert service.replans == [0.0]  # still pausing
    await clock.advance(0.1)
    assert service.replans == [0.0, REPLAN_RETRY_S]
    await clock.advance(30, steps=3)
    assert len(service.replans) == 2  # it succeeded: no more
    assert REGISTRY.get_sample_value("dracap_reservation_replan_failures_total") == failed + 1
    stop.set()
    await asyncio.wait_for(running, 10)
