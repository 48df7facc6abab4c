"""Node-level decisions on the fold: expiry, taint, fence, a class's minimum enforcement."""

from __future__ import annotations

import pytest

from events import catalog as c
from events.actors import Actor, ActorError, parse_actor
from events.inventory import NODE_LOST_TAINT, build_inventory, lost_nodes
from services.claims.adminwrites import MAX_FENCE_REASON, NodeFence, decide_fence, decide_mode
from services.reclamation.decisions import decide_expiry, fence_by_hook
from services.reservation.rounds import decide_round
from tests.unit.decision_fixtures import (
    NODE,
    Log,
    allocator_of,
    backlog_of,
    gpu,
    inventory,
    memory_claim,
    share_ids,
)


def _held(*amounts: str) -> Log:
    """One 40Gi GPU on ``NODE`` with a lease of epoch 1 and a claim per amount reserved."""
    log = Log(*inventory(gpu()))
    log.add(c.NodeLeaseAcquired(node=NODE, epoch=1, boot_id="boot-1", ttl_ms=10_000))
    log.reserve(*(memory_claim(f"c{i}", amount) for i, amount in enumerate(amounts)))
    return log


def test_an_expiry_names_every_live_share_of_the_node() -> None:
    log = _held("10Gi", "20Gi")
    state = log.state()
    events = decide_expiry(state, NODE, 1)
    assert events[0] == c.NodeLeaseExpired(node=NODE, epoch=1)
    unknown = sorted(state.nodes[NODE].live_shares)
    assert events[1:] == [c.ShareMarkedUnknown(share_id=s, node=NODE) for s in unknown]
    assert len(unknown) == 2
    log.add(*events)
    after = log.state()
    assert {after.shares[s].state for s in unknown} == {"unknown"}
    assert after.devices[next(iter(after.devices))].consumed()["memory"].canonical() == "30Gi"


def test_a_lost_nodes_devices_take_no_new_share_and_the_reason_says_why() -> None:
    log = _held("10Gi", "20Gi")
    log.add(*decide_expiry(log.state(), NODE, 1))
    log.add(*c_admitted("late", "5Gi"))
    state = log.state()
    assert NODE in lost_nodes(state) and NODE_LOST_TAINT in lost_nodes(state)[NODE]
    ids = share_ids()
    decided = decide_round(state, allocator_of(state, new_share_id=ids), backlog_of(state), ids)
    [(_, events, _)] = list(decided.by_stream())
    [unschedulable] = events
    assert isinstance(unschedulable, c.ClaimUnschedulable)
    assert NODE_LOST_TAINT in unschedulable.reason and "unknown shares" in unschedulable.reason
    # the agent takes a new lease: the devices are schedulable again
    log.add(c.NodeLeaseAcquired(node=NODE, epoch=2, boot_id="boot-1", ttl_ms=10_000))
    assert lost_nodes(log.state()) == {}
    assert build_inventory(log.state()).lost_nodes == {}


def c_admitted(name: str, amount: str) -> list[c.Event]:
    rc = memory_claim(name, amount)
    return [c.ClaimSubmitted(claim=rc), c.ClaimAdmitted(namespace="tenant-a", name=name)]


def test_a_fence_is_recorded_at_the_nodes_newest_epoch() -> None:
    log = _held("10Gi")
    log.add(*decide_expiry(log.state(), NODE, 1))
    write = decide_fence(log.state(), NodeFence(node=NODE, reason="BMC: powered off"))
    assert write.events == (c.NodeFenced(node=NODE, epoch=1, reason="BMC: powered off"),)
    log.add(*write.events)
    state = log.state()
    assert state.nodes[NODE].lease == "fenced" and not state.nodes[NODE].live_shares
    again = decide_fence(state, NodeFence(node=NODE, reason="again"))
    assert again.events == () and again.unchanged == (NODE,)


@pytest.mark.parametrize(
    ("node", "reason", "field"),
    [("node-x", "gone", "node"), (NODE, "  ", "reason"), (NODE, "x" * 501, "reason")],
)
def test_a_fence_names_the_field_it_refuses(node: str, reason: str, field: str) -> None:
    assert MAX_FENCE_REASON == 500
    write = decide_fence(_held("10Gi").state(), NodeFence(node=node, reason=reason))
    assert write.refusal is not None and write.refusal.field == field and not write.events


def test_the_hooks_fence_names_the_command() -> None:
    fence = fence_by_hook(NODE, 3, "ipmitool power off")
    assert fence.epoch == 3 and "ipmitool power off" in fence.reason


def test_an_agents_actor_carries_its_epoch() -> None:
    assert str(Actor.agent("node-a", 7)) == "agent:node-a#7"
    assert parse_actor("agent:node-a#7") == Actor.agent("node-a", 7)
    assert parse_actor("agent:node-a").epoch is None
    for bad in ("agent:node-a#x", "agent:node-a#0", "system:x#1"):
        with pytest.raises(ActorError):
            parse_actor(bad)


def test_a_class_that_requires_hard_enforcement_skips_nodes_that_offer_less() -> None:
    log = Log(*inventory(gpu()))
    log.add(c.NodeLeaseAcquired(node=NODE, epoch=1, boot_id="b", ttl_ms=10_000))
    state = log.state()
    write = decide_mode(state, "gpu.test.io", "consumable", "hard")
    assert write.events == (
        c.ClassModeSet(name="gpu.test.io", mode="consumable", min_enforcement="hard"),
    )
    log.add(*write.events, *c_admitted("strict", "5Gi"))
    state = log.state()
    ids = share_ids()
    decided = decide_round(state, allocator_of(state, new_share_id=ids), backlog_of(state), ids)
    [(_, [unschedulable], _)] = list(decided.by_stream())
    assert isinstance(unschedulable, c.ClaimUnschedulable)
    assert f"node {NODE} enforces none, class gpu.test.io needs hard" in unschedulable.reason
    # an agent whose enforcer is hard takes the node over: the claim fits
    log.add(c.NodeLeaseAcquired(node=NODE, epoch=2, boot_id="b", ttl_ms=10_000, enforcement="hard"))
    state = log.state()
    decided = decide_round(state, allocator_of(state, new_share_id=ids), backlog_of(state), ids)
    kinds = {type(e) for _, events, _ in decided.by_stream() for e in events}
    assert c.CapacityReserved in kinds and c.ClaimUnschedulable not in kinds
    # re-applying the class keeps its minimum; "keep" leaves it, a bad level is refused
    assert decide_mode(state, "gpu.test.io", "consumable").unchanged == ("gpu.test.io",)
    refused = decide_mode(state, "gpu.test.io", "consumable", "firm").refusal
    assert refused is not None and refused.field == "min_enforcement"
