"""The kubelet plugin's rounds as pure decisions, and the agent's apply-then-record undo.

* the fold: ``LimitRemoved`` of a ``ready`` share (a kubelet unprepare) makes it ``bound``
  again with its capacity held, and the claim ``allocated``; the next ``LimitApplied``
  makes both ready again;
* :func:`~services.enforcement.decisions.kubelet_round`: one draft for the whole round,
  so two prepares of one round cannot overcommit a device together, and an unprepare's
  limit no longer counts for a prepare of the same round;
* :meth:`~services.enforcement.agent.Agent.carry_round`: a fault injected at the report
  (refused, or its answer lost after or before it landed) leaves the kernel (the
  enforcer's limits in force) saying what the log says.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from events import catalog as c
from events.state import ClusterState
from events.subjects import BusNames
from services.enforcement.agent import Agent
from services.enforcement.decisions import Enforce, Unprepare, kubelet_round, limit_of
from services.enforcement.enforcers import NoneEnforcer
from services.enforcement.enforcing import Enforcing
from services.enforcement.protocol import Report, Reported, ViewAsk, Viewed
from services.enforcement.views import NodeView
from services.runtime.ground.errors import ConflictError, RetryableError
from tests.fixtures.contexts import NO_NATS, handed
from tests.unit.allocator_fixtures import claim, request
from tests.unit.decision_fixtures import NAMESPACE, NODE, Log, gpu, inventory


def _log(*names: str, memory: str = "10Gi") -> Log:
    log = Log(*inventory(gpu("gpu-0", "40Gi")))
    for name in names:
        log.reserve(claim(request("gpu", {"memory": memory}), name=name, namespace=NAMESPACE))
    return log


def _share(state: ClusterState, name: str) -> str:
    [share_id] = state.claims[(NAMESPACE, name)].share_ids
    return share_id


def _ready(log: Log, name: str) -> str:
    share_id = _share(log.state(), name)
    consumed = log.state().shares[share_id].consumed
    log.add(c.LimitApplied(share_id=share_id, node=NODE, level="hard", actual=consumed))
    return share_id


def test_an_unprepared_share_is_bound_again_with_its_capacity_held() -> None:
    log = _log("web")
    share_id = _ready(log, "web")
    state = log.state()
    held = state.devices[state.shares[share_id].device_key].consumed_nanos["memory"]
    log.add(c.LimitRemoved(share_id=share_id, node=NODE))
    state = log.state()
    assert state.shares[share_id].state == "bound"
    assert state.claims[(NAMESPACE, "web")].phase == "allocated"
    assert state.devices[state.shares[share_id].device_key].consumed_nanos["memory"] == held
    _ready(log, "web")  # prepared again
    assert log.state().claims[(NAMESPACE, "web")].phase == "ready"


def test_a_removed_limit_of_a_releasing_share_changes_nothing_else() -> None:
    log = _log("web")
    share_id = _ready(log, "web")
    version = log.state().claims[(NAMESPACE, "web")].allocation_version
    log.add(
        c.ReleaseRequested(namespace=NAMESPACE, name="web", allocation_version=version, node=NODE)
    )
    log.add(c.LimitRemoved(share_id=share_id, node=NODE))
    state = log.state()
    assert state.shares[share_id].state == "releasing"
    assert state.claims[(NAMESPACE, "web")].phase == "releasing"


def test_one_round_cannot_overcommit_a_device_with_two_prepares() -> None:
    # 30Gi each on a 40Gi device: the planner never grants this; a forged log might
    log = Log(*inventory(gpu("gpu-0", "80Gi")))
    for name in ("a", "b"):
        log.reserve(claim(request("gpu", {"memory": "30Gi"}), name=name, namespace=NAMESPACE))
    state = log.state()
    limits = {name: limit_of(state.shares[_share(state, name)]) for name in ("a", "b")}
    # the device as the agent knows it is smaller now: what is enforced counts
    small = Enforcing(
        [
            msgspec.structs.replace(
                limits["a"], share_id="other", consumed={"memory": limits["a"].consumed["memory"]}
            )
        ]
    )
    tasks = kubelet_round(state, NODE, [(NAMESPACE, "a"), (NAMESPACE, "b")], [], small)
    [a, b] = tasks
    assert isinstance(a, Enforce) and isinstance(b, Enforce)
    assert [x.share_id for x in a.limits] == [_share(state, "a")]
    assert [x.share_id for x in b.refused] == [_share(state, "b")]  # 30 + 30 + 30 > 80


def test_an_unprepare_of_the_round_makes_room_for_its_prepares() -> None:
    log = _log("old", "new", memory="20Gi")  # 40Gi device, both reserved
    old = _ready(log, "old")
    state = log.state()
    enforcing = Enforcing([limit_of(state.shares[old])])
    # as if the device had shrunk to the old share alone: the prepare fits only once the
    # unprepare of the same round took the old limit off
    tasks = kubelet_round(state, NODE, [(NAMESPACE, "new")], [(NAMESPACE, "old")], enforcing)
    assert isinstance(tasks[0], Unprepare) and tasks[0].share_ids == (old,)
    assert isinstance(tasks[1], Enforce) and not tasks[1].refused


# -- the agent: apply, then record; undo when the record does not land ---------------------


class Plane:
    """The enforcement service's answers for one agent, with a fault at the report."""

    def __init__(self, log: Log, fault: type[Exception] | None, *, lands: bool = False) -> None:
        self.log = log
        self.fault = fault
        self.lands = lands  #: the report is appended although its answer is lost
        self.reports: list[Report] = []

    async def view(self, ask: ViewAsk) -> tuple[NodeView, Viewed]:
        state = self.log.state()
        view = NodeView(
            node=NODE,
            position=state.position,
            claims=list(state.claims.items()),
            shares=state.shares,
            devices=list(state.devices.items()),
            classes=state.classes,
            nodes=state.nodes,
            versions=dict(self.log._versions),
        )
        return view, Viewed(view=msgspec.Raw(b"{}"))

    async def report(self, report: Report) -> Reported:
        self.reports.append(report)
        if self.lands or self.fault is None:
            for batch in report.batches:
                for raw in batch.events:
                    self.log.add(msgspec.json.decode(raw, type=c.Event))
        if self.fault is not None:
            raise self.fault("injected")
        return Reported()

    async def consumer(self) -> bool:
        return True


def _agent(plane: Plane) -> tuple[Agent, NoneEnforcer]:
    kernel = NoneEnforcer()
    context = handed(None, BusNames("t"), NO_NATS)
    agent = Agent(context, node=NODE, enforcer=kernel, plane=plane)  # type: ignore[arg-type]
    agent.lease.epoch = 1
    agent.lease.held.set()
    return agent, kernel


def _prepare(agent: Agent, name: str) -> Any:
    key = (NAMESPACE, name)
    return agent.carry_round(
        ViewAsk(claims=[key]), lambda st: kubelet_round(st, NODE, [key], [], agent.enforcing)
    )


def _unprepare(agent: Agent, name: str) -> Any:
    key = (NAMESPACE, name)
    return agent.carry_round(
        ViewAsk(claims=[key]), lambda st: kubelet_round(st, NODE, [], [key], agent.enforcing)
    )


@pytest.mark.parametrize(
    ("fault", "lands", "in_force"),
    [
        (None, False, True),  # no fault: applied and recorded
        (ConflictError, False, False),  # refused: undone
        (RetryableError, False, False),  # no answer, not appended: undone
        (RetryableError, True, True),  # no answer, appended: kept
    ],
)
def test_a_prepare_whose_report_fails_leaves_kernel_and_log_in_agreement(
    fault: type[Exception] | None, lands: bool, in_force: bool
) -> None:
    log = _log("web")
    share_id = _share(log.state(), "web")
    agent, kernel = _agent(Plane(log, fault, lands=lands))

    async def run() -> None:
        if fault is None:
            await _prepare(agent, "web")
            return
        with pytest.raises(fault):
            await _prepare(agent, "web")

    asyncio.run(run())
    ready = log.state().shares[share_id].state == "ready"
    assert ready == in_force
    assert (share_id in asyncio.run(kernel.observe())) == in_force
    assert (share_id in agent.enforcing) == in_force


@pytest.mark.parametrize(
    ("fault", "lands", "in_force"),
    [
        (None, False, False),
        (ConflictError, False, True),  # refused: the limit is put back
        (RetryableError, False, True),
        (RetryableError, True, False),
    ],
)
def test_an_unprepare_whose_report_fails_leaves_kernel_and_log_in_agreement(
    fault: type[Exception] | None, lands: bool, in_force: bool
) -> None:
    log = _log("web")
    share_id = _share(log.state(), "web")
    agent, kernel = _agent(Plane(log, None))
    asyncio.run(_prepare(agent, "web"))
    assert log.state().shares[share_id].state == "ready"
    agent.plane = Plane(log, fault, lands=lands)  # type: ignore[assignment]

    async def run() -> None:
        if fault is None:
            await _unprepare(agent, "web")
            return
        with pytest.raises(fault):
            await _unprepare(agent, "web")

    asyncio.run(run())
    assert (log.state().shares[share_id].state == "ready") == in_force
    assert (share_id in asyncio.run(kernel.observe())) == in_force
