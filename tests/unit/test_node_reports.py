"""What a node agent may report, and what it may see: one named row each.

:func:`services.enforcement.reports.refusal` is the enforcement service's check of every
event an agent reports (before the database's own); :func:`services.enforcement.views.
scope` is what the service shows an agent of the fold. Both are pure and read a small
two-node cluster: claim ``a1`` holds share ``held-1`` on node-a, ``b1`` holds ``held-2``
on node-b.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from events import catalog as c
from events.envelopes import claim_stream, lease_stream, node_stream, stream_of
from events.state import ClusterState
from services.enforcement.decisions import released
from services.enforcement.leasing import NodeLease
from services.enforcement.protocol import consumer_name
from services.enforcement.renewing import Renewals
from services.enforcement.reports import refusal, version_check_refusal
from services.enforcement.views import Scope, decode_view, encode_view, scope
from services.runtime.ground.errors import RetryableError
from tests.fixtures.clock import FakeClock
from tests.unit.allocator_fixtures import DRIVER, slice_
from tests.unit.decision_fixtures import NAMESPACE, Log, gpu, inventory, memory_claim

A, B = "node-a", "node-b"


def _cluster() -> ClusterState:
    log = Log(*inventory(gpu("gpu-0"), node=A))
    log.reserve(memory_claim("a1", "40Gi"))  # fills node-a: the next claim goes to node-b
    log.add(c.ResourceSlicePublished(slice=slice_([gpu("gpu-0")], node=B, name="node-b-slice")))
    log.reserve(memory_claim("b1", "40Gi"))
    state = log.state()
    assert state.shares["held-1"].node == A and state.shares["held-2"].node == B
    return state


STATE = _cluster()


def _applied(share: str, node: str = A) -> c.Event:
    return c.LimitApplied(share_id=share, node=node, level="none", actual={})


def _released(share: str) -> c.Event:
    return released(STATE.shares[share])


@dataclass
class Row:
    id: str
    event: c.Event
    refused: tuple[str, str] | None  # (code, a part of the reason)
    stream: str | None = None  # default: the event's own


ROWS = [
    Row("its-own-shares-limit", _applied("held-1"), None),
    Row("another-nodes-share", _applied("held-2"), ("forbidden", "is on node 'node-b'")),
    Row("a-report-in-another-nodes-name", _applied("held-2", B), ("forbidden", "for node")),
    Row("a-share-the-log-never-had", _applied("held-9"), ("forbidden", "not in the log")),
    Row("its-own-capacity-released", _released("held-1"), None),
    Row("another-nodes-capacity-released", _released("held-2"), ("forbidden", "node-b")),
    Row(
        "not-an-agents-event",
        c.ClaimAdmitted(namespace=NAMESPACE, name="x"),
        ("invalid", "not a node agent's report"),
    ),
    Row(
        "a-lease-is-taken-not-reported",
        c.NodeLeaseAcquired(node=A, epoch=9, boot_id="b", ttl_ms=1000),
        ("invalid", "not a node agent's report"),
    ),
    Row(
        "an-event-on-another-stream",
        _applied("held-1"),
        ("invalid", "belongs to stream"),
        stream="node:node-b",
    ),
    Row("its-reconcile-report", c.EnforcementReconciled(node=A), None),
    Row(
        "a-reconcile-report-for-another-node",
        c.EnforcementReconciled(node=B),
        ("forbidden", "for node"),
    ),
    Row(
        "its-devices-health",
        c.DeviceHealthChanged(
            node=A, driver=DRIVER, pool="node-a-pool", device="gpu-0", healthy=False
        ),
        None,
    ),
    Row(
        "another-nodes-device-health",
        c.DeviceHealthChanged(
            node=A, driver=DRIVER, pool="node-b-pool", device="gpu-0", healthy=False
        ),
        ("forbidden", "not a device of node 'node-a'"),
    ),
    Row(
        "its-own-slice",
        c.ResourceSlicePublished(slice=slice_([gpu("gpu-1")], node=A, name="node-a-slice")),
        None,
    ),
    Row(
        "a-slice-naming-another-node",
        c.ResourceSlicePublished(slice=slice_([gpu()], node=B, name="node-a-slice-2")),
        ("forbidden", "names node 'node-b'"),
    ),
    Row(
        "another-nodes-slice-name",
        c.ResourceSlicePublished(slice=slice_([gpu()], node=A, name="node-b-slice")),
        ("forbidden", "is node 'node-b'"),
    ),
    Row(
        "a-slice-in-another-nodes-pool",
        c.ResourceSlicePublished(slice=slice_([gpu()], node=A, pool="node-b-pool", name="sneaky")),
        ("forbidden", "holds node 'node-b'"),
    ),
    Row(
        "withdrawing-another-nodes-slice",
        c.ResourceSliceWithdrawn(name="node-b-slice"),
        ("forbidden", "not a slice"),
    ),
    Row(
        "its-own-dead-letter",
        c.MessageDeadLettered(
            consumer=consumer_name(A), event_id="e1", position=1, deliveries=5, reason="r"
        ),
        None,
    ),
    Row(
        "another-consumers-dead-letter",
        c.MessageDeadLettered(
            consumer="reservation-admissions", event_id="e1", position=1, deliveries=5, reason="r"
        ),
        ("forbidden", "is not node 'node-a'"),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_what_an_agent_may_report(row: Row) -> None:
    stream = row.stream or stream_of(row.event)
    found = refusal(STATE, A, stream, row.event)
    if row.refused is None:
        assert found is None
    else:
        assert found is not None and found[0] == row.refused[0], found
        assert row.refused[1] in found[1], found


def test_a_version_check_is_allowed_on_its_own_streams_only() -> None:
    assert version_check_refusal(STATE, A, node_stream(A)) is None
    assert version_check_refusal(STATE, A, claim_stream(NAMESPACE, "a1")) is None
    assert version_check_refusal(STATE, A, claim_stream(NAMESPACE, "b1")) is not None
    assert version_check_refusal(STATE, A, lease_stream(B)) is not None


# --- views ------------------------------------------------------------------------------------


def test_a_view_holds_its_nodes_claim_and_nothing_of_another_node() -> None:
    view = scope(STATE, A, Scope(claims=((NAMESPACE, "a1"), (NAMESPACE, "b1")), shares=("held-2",)))
    again = decode_view(encode_view(view)).state()  # as the agent gets it
    mine = again.claims[(NAMESPACE, "a1")]
    assert mine.share_ids == ["held-1"]
    # the compact spec crosses the wire whole (the agent's retry window reads its class)
    assert mine.spec is not None and mine.spec == STATE.claims[(NAMESPACE, "a1")].spec
    assert mine.class_of("gpu") == STATE.claims[(NAMESPACE, "a1")].class_of("gpu")
    assert set(again.shares) == {"held-1"}, "node-b's share is not shown"
    other = again.claims[(NAMESPACE, "b1")]
    assert other.spec is None and other.allocation is None  # where, not what
    assert other.share_ids == [] and other.node == B
    assert set(again.devices) == {(DRIVER, "node-a-pool", "gpu-0")}
    assert set(again.nodes) <= {A} and set(again.classes) == set(STATE.classes)


def test_the_whole_node_view_holds_its_devices_and_slices() -> None:
    devices = [(DRIVER, "node-a-pool", "gpu-0"), (DRIVER, "node-b-pool", "gpu-0")]
    view = scope(
        STATE, A, Scope(node=True), devices=devices, slices=["node-a-slice", "node-b-slice"]
    )
    assert [key for key, _ in view.devices] == [devices[0]]  # the index's stale entry: dropped
    assert set(view.slices) == {"node-a-slice"}


# --- heartbeats -------------------------------------------------------------------------------


async def test_the_heartbeats_of_a_tick_renew_in_one_statement_whatever_their_number() -> None:
    asked: list[dict[str, int]] = []

    async def renew(due: dict[str, int]) -> set[str]:
        asked.append(dict(due))
        return {node for node, epoch in due.items() if epoch == 1}

    renewals = Renewals(renew)  # type: ignore[arg-type]
    beats = [asyncio.ensure_future(renewals.beat(f"node-{i}", 1)) for i in range(1000)]
    late = asyncio.ensure_future(renewals.beat("node-x", 2))
    older = asyncio.ensure_future(renewals.beat("node-0", 0))  # an older epoch: lost at once
    await asyncio.sleep(0)
    await renewals.tick()
    assert len(asked) == 1 and len(asked[0]) == 1001 and renewals.statements == 1
    assert all(await asyncio.gather(*beats)) and not await late and not await older
    await renewals.tick()
    assert renewals.statements == 1, "no beat, no statement"


async def test_the_beats_of_a_tick_are_renewed_when_the_tick_ends_on_the_clock() -> None:
    asked: list[dict[str, int]] = []

    async def renew(due: dict[str, int]) -> set[str]:
        asked.append(dict(due))
        return set(due)

    clock = FakeClock(start=0.0)
    renewals = Renewals(renew, tick_s=0.25, clock=clock)  # type: ignore[arg-type]
    stop = asyncio.Event()
    running = asyncio.ensure_future(renewals.run(stop))
    first = asyncio.ensure_future(renewals.beat("node-a", 1))
    await clock.advance(0.2)
    second = asyncio.ensure_future(renewals.beat("node-b", 1))  # the same tick
    await clock.advance(0.04)
    assert asked == [] and not first.done()  # the tick has not ended yet
    await clock.advance(0.01)
    assert asked == [{"node-a": 1, "node-b": 1}]
    assert await first and await second
    await clock.advance(10, steps=4)
    assert renewals.statements == 1, "no beat, no statement"
    stop.set()
    await asyncio.wait_for(running, 10)


# --- the agent's lease without answers --------------------------------------------------------


class _Unanswered:
    """A control plane whose heartbeats never get an answer (NATS away)."""

    def __init__(self) -> None:
        self.beats = 0

    async def heartbeat(self, epoch: int, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        self.beats += 1
        raise RetryableError("transient bus failure: no answer")


async def test_a_lease_without_a_held_answer_for_a_whole_ttl_is_lost() -> None:
    plane = _Unanswered()
    lease = NodeLease(plane, A, boot_id="b", ttl_s=0.3)  # type: ignore[arg-type]
    lease.epoch = 1
    lost = asyncio.Event()

    async def retake() -> None:
        lost.set()

    stop = asyncio.Event()
    keeping = asyncio.ensure_future(lease.keep(stop, retake))
    async with asyncio.timeout(30):  # a bound, not a speed: it happens after ~0.4 s
        await lost.wait()
    stop.set()
    await keeping
    assert plane.beats >= 2, "an outage shorter than the ttl is only retried"
