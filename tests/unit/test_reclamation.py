"""Node-level decisions on the fold: expiry, taint, fence, a class's minimum enforcement."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
import pytest

from events import catalog as c
from events.actors import Actor, ActorError, parse_actor
from events.inventory import NODE_LOST_TAINT, build_inventory, lost_nodes
from events.tenancy import parse_duration
from services.claims.adminwrites import (
    MAX_FENCE_REASON,
    MAX_RESERVED_FOR,
    NodeFence,
    Reservation,
    consumer_ref,
    consumer_uid,
    decide_fence,
    decide_mode,
    decide_reservation,
)
from services.enforcement.decisions import health_changes, uses, vanished
from services.reclamation.decisions import (
    decide_expiry,
    decide_not_started,
    fence_by_hook,
    not_started,
)
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


# --- device health, use, not started, reservations -----------------------------------------


def _ready_log(*names: str, device_class: str = "gpu.test.io") -> Log:
    """One GPU on ``NODE`` (its agent leased), a Ready claim per name."""
    log = _held()
    log.reserve(*(memory_claim(n, "5Gi") for n in names))
    state = log.state()
    for name in names:
        claim = state.claim("tenant-a", name)
        assert claim is not None
        log.add(
            *(
                c.LimitApplied(share_id=s, node=NODE, level="none", actual={})
                for s in claim.share_ids
            )
        )
    return log


def test_health_is_recorded_on_transitions_only() -> None:
    log = _held()
    state = log.state()
    [key] = list(state.devices)
    assert health_changes(state, NODE, {key: None}) == []  # healthy, as recorded
    [sick] = health_changes(state, NODE, {key: "interface eth1 is gone"})
    assert (sick.healthy, sick.reason) == (False, "interface eth1 is gone")
    log.add(sick)
    state = log.state()
    assert health_changes(state, NODE, {key: "interface eth1 is gone"}) == []
    assert health_changes(state, "node-b", {key: None}) == [], "another node's device"
    [well] = health_changes(state, NODE, {key: None})
    assert well.healthy and well.reason == ""
    found = vanished(state, NODE, {key[0]}, found=set())
    assert found == {key: "vanished from discovery"}
    assert vanished(state, NODE, {key[0]}, found={key}) == {key: None}


def test_use_is_recorded_once_per_share_with_traffic() -> None:
    log = _ready_log("busy", "quiet")
    state = log.state()
    busy = state.claim("tenant-a", "busy").share_ids[0]  # type: ignore[union-attr]
    quiet = state.claim("tenant-a", "quiet").share_ids[0]  # type: ignore[union-attr]
    [used] = uses(state, NODE, {busy: 1500, quiet: 0, "not-a-share": 9})
    assert used.share_id == busy and "1500 bytes" in used.evidence
    log.add(used)
    assert uses(log.state(), NODE, {busy: 3000}) == []


def _annotated(timeout: str, action: str) -> c.DeviceClassApplied:
    from tests.unit.allocator_fixtures import device_class

    dclass = device_class()
    meta = msgspec.structs.replace(
        dclass.metadata,
        annotations={
            "dracap.io/not-started-timeout": timeout,
            "dracap.io/not-started-action": action,
        },
    )
    return c.DeviceClassApplied(
        device_class=msgspec.structs.replace(dclass, metadata=meta), rollout="immediate"
    )


def test_a_ready_unused_claim_is_released_or_stalled_once_its_timeout_passed() -> None:
    log = _ready_log("idle", "held", "busy")
    state = log.state()
    assert not_started(state) == [], "no class sets a timeout"
    log.add(_annotated("90s", "stall"))
    log.add(c.ClaimReserved(namespace="tenant-a", name="held", consumer="pod/tenant-a/p"))
    busy = state.claim("tenant-a", "busy").share_ids[0]  # type: ignore[union-attr]
    log.add(c.ShareUsed(share_id=busy, node=NODE, evidence="1 byte"))
    [candidate] = not_started(log.state())
    assert candidate.key == ("tenant-a", "idle") and candidate.timeout_s == 90
    assert decide_not_started(candidate, 89.0, NODE) is None
    stalled = decide_not_started(candidate, 90.0, NODE)
    assert isinstance(stalled, c.ClaimStalled) and "within 90s" in stalled.reason
    log.add(stalled)
    idle = log.state().claim("tenant-a", "idle")
    assert idle is not None and idle.phase == "stalled" and idle.reason == stalled.reason
    assert not_started(log.state()) == [], "stalled once"
    log.add(c.ClaimReserved(namespace="tenant-a", name="idle", consumer="pod/tenant-a/q"))
    idle = log.state().claim("tenant-a", "idle")
    assert idle is not None and idle.phase == "ready" and idle.reason is None

    release = msgspec.structs.replace(candidate, action="release")
    event = decide_not_started(release, 120.0, NODE)
    assert isinstance(event, c.ReleaseRequested) and event.node == NODE and event.reason


@pytest.mark.parametrize(
    ("consumer", "reserve", "outcome"),
    [
        ("pod/tenant-a/p", True, "applied"),
        ("pods/tenant-a/p", True, "applied"),
        ("pod/tenant-b/p", True, "for"),
        ("job/tenant-a/p", True, "for"),
        ("pod/tenant-a/Bad_Name", True, "for"),
        ("pod/tenant-a/p", False, "unchanged"),
    ],
)
def test_a_reservation_names_a_pod_of_the_claims_namespace(
    consumer: str, reserve: bool, outcome: str
) -> None:
    state = _ready_log("train").state()
    write = decide_reservation(
        state, "tenant-a", Reservation(name="train", consumer=consumer), reserve=reserve
    )
    if outcome == "for":
        assert write.refusal is not None and write.refusal.field == "for"
    elif outcome == "applied":
        assert write.events == (
            c.ClaimReserved(namespace="tenant-a", name="train", consumer="pod/tenant-a/p"),
        )
    else:
        assert write.unchanged == ("pod/tenant-a/p",) and not write.events


def test_a_reservation_needs_an_allocated_claim_and_has_a_limit() -> None:
    log = _ready_log("train")
    log.add(*c_admitted("waiting", "50Gi"))
    state = log.state()
    missing = decide_reservation(
        state, "tenant-a", Reservation(name="x", consumer="pod/tenant-a/p"), reserve=True
    )
    assert missing.refusal is not None and missing.refusal.code == "not_found"
    early = decide_reservation(
        state, "tenant-a", Reservation(name="waiting", consumer="pod/tenant-a/p"), reserve=True
    )
    assert early.refusal is not None and early.refusal.kind == "not-allocated"
    for i in range(MAX_RESERVED_FOR):
        log.add(c.ClaimReserved(namespace="tenant-a", name="train", consumer=f"pod/tenant-a/p{i}"))
    full = decide_reservation(
        log.state(), "tenant-a", Reservation(name="train", consumer="pod/tenant-a/z"), reserve=True
    )
    assert full.refusal is not None and full.refusal.kind == "reserved-for-full"


UID = "0b5c3f4e-2d1a-4c8b-9e7f-6a5b4c3d2e1f"


def test_a_consumer_is_one_reservation_whatever_its_uid_and_its_uid_is_never_empty() -> None:
    log = _ready_log("train")

    def reserve(uid: str | None, *, pod: str = "p", reserving: bool = True) -> Any:
        request = Reservation(name="train", consumer=f"pod/tenant-a/{pod}", uid=uid)
        write = decide_reservation(log.state(), "tenant-a", request, reserve=reserving)
        log.add(*write.events)
        return write

    assert reserve(UID).events == (
        c.ClaimReserved(namespace="tenant-a", name="train", consumer=f"pod/tenant-a/p/{UID}"),
    )
    assert reserve(UID).unchanged == ("pod/tenant-a/p",)
    assert reserve(None).unchanged == ("pod/tenant-a/p",)  # the name alone: the same pod
    other = reserve("1b5c3f4e-2d1a-4c8b-9e7f-6a5b4c3d2e1f")
    assert other.refusal is not None and other.refusal.kind == "reserved-by-another"
    bad = reserve("not-a-uid", pod="q")
    assert bad.refusal is not None and bad.refusal.field == "uid"
    gone = reserve(None, reserving=False)  # by name, whatever uid it was reserved with
    assert gone.events == (
        c.ClaimUnreserved(namespace="tenant-a", name="train", consumer=f"pod/tenant-a/p/{UID}"),
    )
    assert log.state().claims[("tenant-a", "train")].reserved_for == []

    ref = consumer_ref("pod/tenant-a/q")
    derived = consumer_uid("tenant-a", "train", ref)
    assert str(uuid.UUID(derived)) == derived == consumer_uid("tenant-a", "train", ref)
    assert consumer_uid("tenant-a", "other", ref) != derived
    assert consumer_uid("tenant-a", "train", consumer_ref(f"pod/tenant-a/p/{UID}")) == UID


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90.0), ("5m", 300.0), ("2h", 7200.0), ("45", 45.0), ("0s", None), ("1d", None),
     ("-5m", None), ("721h", None), ("", None)],
)  # fmt: skip
def test_durations(text: str, seconds: float | None) -> None:
    assert parse_duration(text) == seconds


def test_the_not_started_queue_answers_as_a_walk_over_every_claim() -> None:
    """The reclamation service's queue gives the candidates :func:`not_started` finds
    walking every claim, after every event, and only a class change walks the claims."""
    from events.fold import apply
    from events.state import ClusterState
    from services.reclamation.service import NotStartedQueue

    log = _ready_log("a", "b", "c", "d")
    state = log.state()
    log.add(_annotated("90s", "stall"))
    log.add(c.ClaimReserved(namespace="tenant-a", name="b", consumer="pod/tenant-a/p"))
    busy = state.claim("tenant-a", "c").share_ids[0]  # type: ignore[union-attr]
    log.add(c.ShareUsed(share_id=busy, node=NODE, evidence="1 byte"))
    log.add(c.ClaimStalled(namespace="tenant-a", name="d", allocation_version=1, reason="x"))
    log.add(c.ClaimUnreserved(namespace="tenant-a", name="b", consumer="pod/tenant-a/p"))
    log.reserve(memory_claim("late", "5Gi"))
    late = log.state().claim("tenant-a", "late")
    assert late is not None
    log.add(
        *(c.LimitApplied(share_id=s, node=NODE, level="none", actual={}) for s in late.share_ids)
    )

    state = ClusterState()
    queue = NotStartedQueue(state)
    for env in log.envelopes:
        apply(state, env)
        queue.observe(state, env)
        assert sorted(queue.oldest(state), key=lambda x: x.key) == sorted(
            not_started(state), key=lambda x: x.key
        ), (c.tag_of(env.event), env.position)
    assert {x.key[1] for x in queue.oldest(state)} == {"a", "b", "late"}
    assert len(queue) == 3
    assert [x.key[1] for x in queue.oldest(state, most=1)] == ["a"]  # the oldest clock first
