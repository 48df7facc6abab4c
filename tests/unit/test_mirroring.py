"""Kubernetes mode as tables: mirroring allocations, preparing claims, the claim's status.

Each row tells the log's story with :class:`~tests.unit.decision_fixtures.Log` and checks
what :func:`services.claims.mirroring.decide_claim` (the bridge),
:func:`services.enforcement.preparing.judge_prepare` (the kubelet plugin) and
:func:`services.claims.kubeobjects.device_statuses` (the status the bridge writes) say.
"""

from __future__ import annotations

import datetime
from typing import Any

import kubernetes_validate
import msgspec
import pytest

from events import catalog as c
from events import model
from events.quantities import Quantity
from events.state import ClusterState
from services.claims.kubeobjects import device_statuses, resource_claim_object
from services.claims.mirroring import decide_claim, decide_deleted, share_id_of
from services.enforcement.decisions import decide_work, enforce_claim, released
from services.enforcement.enforcing import Enforcing
from services.enforcement.preparing import judge_prepare
from services.reclamation.decisions import decide_not_started, not_started
from tests.unit.allocator_fixtures import DRIVER, device_class
from tests.unit.decision_fixtures import NAMESPACE, NODE, POOL, Log, gpu, inventory, memory_claim

UID = "0b6c3c0e-8f1e-4a57-9f1e-2b1d7a4c9e01"
NOW = datetime.datetime(2026, 12, 2, 1, 0, tzinfo=datetime.UTC)


def allocated(
    name: str = "train",
    memory: str = "10Gi",
    *,
    uid: str = UID,
    share: str = "7d0c2c1e-0000-4000-8000-000000000001",
    device: str = "gpu-0",
    reserved_for: list[str] | None = None,
) -> model.ResourceClaim:
    """A ResourceClaim as kube-scheduler leaves it: allocated, shareID and consumed set."""
    rc = memory_claim(name, memory)
    data: dict[str, Any] = model.to_builtins(rc)
    data["metadata"]["uid"] = uid
    data["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": DRIVER,
                        "pool": POOL,
                        "device": device,
                        "shareID": share,
                        "consumedCapacity": {"memory": memory},
                    }
                ]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
                ]
            },
        },
        "reservedFor": [
            {"resource": "pods", "name": pod, "uid": f"uid-{pod}"} for pod in reserved_for or []
        ],
    }
    return model.convert(data, model.ResourceClaim)


def deallocated(rc: model.ResourceClaim) -> model.ResourceClaim:
    return msgspec.structs.replace(rc, status=model.ResourceClaimStatus())


def kinds(events: tuple[tuple[str, c.Event], ...]) -> list[str]:
    return [type(event).__name__ for _, event in events]


def mirrored(log: Log, rc: model.ResourceClaim) -> ClusterState:
    """Append what the bridge decides for ``rc``; the state after it."""
    decision = decide_claim(log.state(), rc, {DRIVER})
    log.extend(event for _, event in decision.events)
    return log.state()


def test_an_allocation_is_mirrored_once_with_its_share_id_and_amounts() -> None:
    log = Log(*inventory())
    rc = allocated()
    decision = decide_claim(log.state(), rc, {DRIVER})
    assert decision.outcome == "mirrored"
    assert kinds(decision.events) == [
        "CapacityReserved",
        "ClaimSubmitted",
        "ClaimAdmitted",
        "AllocationBound",
    ]
    reserved = decision.events[0][1]
    assert isinstance(reserved, c.CapacityReserved)
    assert reserved.share_id == "7d0c2c1e-0000-4000-8000-000000000001" and reserved.shared
    assert reserved.consumed["memory"].canonical() == "10Gi" and reserved.node == NODE
    state = mirrored(log, rc)
    claim = state.claims[(NAMESPACE, "train")]
    assert (claim.phase, claim.source, claim.uid) == ("allocated", "kubernetes", UID)
    assert state.devices[(DRIVER, POOL, "gpu-0")].consumed_nanos["memory"] == 10 * 2**30 * 10**9
    # the same claim again (a watch restart, a relist after 410 Gone): nothing to record
    again = decide_claim(state, rc, {DRIVER})
    assert again.events == () and again.outcome == "unchanged"


def test_another_drivers_claim_is_not_mirrored() -> None:
    log = Log(*inventory())
    assert decide_claim(log.state(), allocated(), {"other.example.com"}).events == ()


def test_an_oversubscribing_allocation_is_refused_naming_the_result_and_rule() -> None:
    log = Log(*inventory(gpu(total="40Gi")))
    mirrored(log, allocated("a", "30Gi", uid="uid-a", share="s-a"))
    decision = decide_claim(log.state(), allocated("b", "20Gi", uid="uid-b", share="s-b"), {DRIVER})
    assert decision.outcome == "refused"
    assert kinds(decision.events) == ["ClaimSubmitted", "ClaimRejected"]
    rejected = decision.events[1][1]
    assert isinstance(rejected, c.ClaimRejected)
    assert rejected.field == "status.allocation.devices.results[0]"
    assert "capacity" in rejected.rule and "30Gi consumed + 20Gi > total 40Gi" in rejected.reason
    state = mirrored(log, allocated("b", "20Gi", uid="uid-b", share="s-b"))
    # refused once for that allocation: seen again, nothing more is recorded
    assert (
        decide_claim(state, allocated("b", "20Gi", uid="uid-b", share="s-b"), {DRIVER}).events == ()
    )
    verdict = judge_prepare(state, NODE, NAMESPACE, "b", "uid-b")
    assert verdict.verdict == "refused" and "20Gi > total 40Gi" in verdict.reason
    [entry] = device_statuses(state, state.claims[(NAMESPACE, "b")], NOW)
    [condition] = entry["conditions"]
    assert (condition["status"], condition["reason"]) == ("False", "AllocationRefused")
    assert "20Gi > total 40Gi" in condition["message"] and entry["shareID"] == "s-b"


def test_a_policy_violation_is_refused_too() -> None:
    log = Log(*inventory())
    decision = decide_claim(log.state(), allocated(memory="7Gi"), {DRIVER})  # step is 5Gi
    assert decision.outcome == "refused"
    rejected = decision.events[1][1]
    assert isinstance(rejected, c.ClaimRejected) and "(policy)" in rejected.rule


def test_deallocation_and_deletion_release_a_mirrored_claim() -> None:
    log = Log(*inventory())
    rc = allocated()
    state = mirrored(log, rc)
    decision = decide_claim(state, deallocated(rc), {DRIVER})
    assert kinds(decision.events) == ["ReleaseRequested"]
    request = decision.events[0][1]
    assert isinstance(request, c.ReleaseRequested)
    assert request.allocation_version == 1 and request.node == NODE
    assert "deallocated" in request.reason
    deleted = decide_deleted(state, NAMESPACE, "train", UID)
    assert kinds(deleted.events) == ["ReleaseRequested"]
    assert decide_deleted(state, NAMESPACE, "train", "another-uid").events == ()
    assert decide_deleted(state, NAMESPACE, "nobody", None).events == ()


def test_a_recreated_claim_releases_the_old_one_first() -> None:
    log = Log(*inventory())
    state = mirrored(log, allocated())
    decision = decide_claim(state, allocated(uid="new-uid", share="s-new"), {DRIVER})
    assert (
        kinds(decision.events) == ["ReleaseRequested"]
        and "recreated" in decision.events[0][1].reason
    )  # type: ignore[union-attr]


def test_reserved_for_is_mirrored_as_consumers() -> None:
    log = Log(*inventory())
    state = mirrored(log, allocated(reserved_for=["pod-a"]))
    assert state.claims[(NAMESPACE, "train")].reserved_for == [f"pod/{NAMESPACE}/pod-a"]
    decision = decide_claim(state, allocated(reserved_for=["pod-b"]), {DRIVER})
    assert [(type(e).__name__, e.consumer) for _, e in decision.events] == [  # type: ignore[union-attr]
        ("ClaimUnreserved", f"pod/{NAMESPACE}/pod-a"),
        ("ClaimReserved", f"pod/{NAMESPACE}/pod-b"),
    ]


def test_a_dedicated_device_gets_a_share_id_derived_from_the_claim() -> None:
    log = Log(*inventory(gpu(shared=False)))
    rc = allocated(share="")
    data = model.to_builtins(rc)
    for result in data["status"]["allocation"]["devices"]["results"]:
        del result["shareID"], result["consumedCapacity"]
    rc = model.convert(data, model.ResourceClaim)
    decision = decide_claim(log.state(), rc, {DRIVER})
    reserved = decision.events[0][1]
    assert isinstance(reserved, c.CapacityReserved) and not reserved.shared
    result = rc.status.allocation.devices.results[0]  # type: ignore[union-attr]
    assert reserved.share_id == share_id_of(UID, 1, result)
    assert decide_claim(log.state(), rc, {DRIVER}).events == decision.events  # deterministic
    state = mirrored(log, rc)
    state = mirrored(log, deallocated(rc))  # released (the agent gives the capacity back) ...
    log.add(released(state.shares[reserved.share_id]))
    withdrawn = decide_claim(log.state(), deallocated(rc), {DRIVER})  # the bridge sees it
    assert [type(e).__name__ for _, e in withdrawn.events] == ["ClaimWithdrawn"]
    log.extend(e for _, e in withdrawn.events)
    state = mirrored(log, rc)  # ... and allocated again to the same device: new shares
    claim = state.claims[(NAMESPACE, "train")]
    assert (claim.phase, claim.allocation_version) == ("allocated", 2)
    assert claim.share_ids == [share_id_of(UID, 2, result)] != [reserved.share_id]


def test_the_agent_applies_a_mirrored_claim_only_at_prepare() -> None:
    log = Log(*inventory())
    rc = allocated()
    decision = decide_claim(log.state(), rc, {DRIVER})
    envelopes = log.extend(event for _, event in decision.events)
    state = log.state()
    bound = [env for env in envelopes if isinstance(env.event, c.AllocationBound)]
    assert decide_work(state, NODE, bound, Enforcing()) == []  # no limit on the scheduling decision
    assert judge_prepare(state, NODE, NAMESPACE, "train", UID).verdict == "enforce"
    assert judge_prepare(state, NODE, NAMESPACE, "train", "stale-uid").verdict == "wait"
    assert judge_prepare(state, "node-b", NAMESPACE, "train", UID).verdict == "refused"
    task = enforce_claim(state, NODE, (NAMESPACE, "train"), Enforcing())
    assert task is not None and [limit.share_id for limit in task.limits] == [  # type: ignore[union-attr]
        "7d0c2c1e-0000-4000-8000-000000000001"
    ]
    [pending] = device_statuses(state, state.claims[(NAMESPACE, "train")], NOW)
    assert pending["conditions"][0]["reason"] == "LimitPending"
    log.add(
        c.LimitApplied(
            share_id="7d0c2c1e-0000-4000-8000-000000000001",
            node=NODE,
            level="hard",
            actual={"memory": Quantity.parse("10Gi")},
        )
    )
    state = log.state()
    verdict = judge_prepare(state, NODE, NAMESPACE, "train", UID)
    assert verdict.verdict == "prepared"
    assert verdict.share_ids == ("7d0c2c1e-0000-4000-8000-000000000001",)
    claim = state.claims[(NAMESPACE, "train")]
    [ready] = device_statuses(state, claim, NOW, previous=[pending])
    assert ready["conditions"][0]["status"] == "True"
    assert ready["data"]["enforcement"] == {"level": "hard", "actual": {"memory": "10Gi"}}
    later = NOW + datetime.timedelta(minutes=5)
    [same] = device_statuses(state, claim, later, previous=[ready])
    assert same == ready  # an unchanged condition keeps its lastTransitionTime


def test_the_resource_claim_object_validates_against_the_1_34_schema() -> None:
    log = Log(*inventory())
    submitted = allocated(reserved_for=["pod-a"])
    state = mirrored(log, submitted)
    claim = state.claims[(NAMESPACE, "train")]
    # the manifest as the claims API reads it from the log (the fold keeps it compact)
    obj = resource_claim_object(state, claim, {"phase": claim.phase}, NOW, recorded=submitted)
    assert obj.pop("dracap") == {"phase": "allocated"}
    assert obj["metadata"]["uid"] == UID and obj["status"]["reservedFor"][0]["uid"] == "uid-pod-a"
    kubernetes_validate.validate(obj, "1.34.0", strict=True)


@pytest.mark.parametrize("phase_events", ["released"])
def test_prepare_after_release_is_refused_with_the_reason(phase_events: str) -> None:
    log = Log(*inventory())
    rc = allocated()
    state = mirrored(log, rc)
    decision = decide_claim(state, deallocated(rc), {DRIVER})
    log.extend(event for _, event in decision.events)
    state = log.state()
    verdict = judge_prepare(state, NODE, NAMESPACE, "train", UID)
    assert verdict.verdict == "refused" and "released" in verdict.reason


def test_a_mirrored_claim_no_kubelet_prepares_follows_the_not_started_rule() -> None:
    annotations = {"dracap.io/not-started-timeout": "5m", "dracap.io/not-started-action": "stall"}
    log = Log(
        c.DeviceClassApplied(
            device_class=device_class(annotations=annotations), rollout="immediate"
        )
    )
    log.extend(inventory()[1:])
    state = mirrored(log, allocated(reserved_for=[]))  # allocated, never prepared
    [candidate] = not_started(state)
    assert candidate.key == (NAMESPACE, "train") and not candidate.prepared
    assert candidate.since_position == state.claims[(NAMESPACE, "train")].bound_position
    assert decide_not_started(candidate, 299.0, NODE) is None
    event = decide_not_started(candidate, 301.0, NODE)
    # it never ran, so it cannot stall: it is released, saying why
    assert isinstance(event, c.ReleaseRequested) and "no kubelet prepared it" in event.reason
    reserved = mirrored(log, allocated(reserved_for=["pod-a"]))
    assert not_started(reserved) == []  # a consumer reserved it: its pod is on the way


def test_an_allocation_released_in_dracap_stays_released_until_kubernetes_allocates_anew() -> None:
    log = Log(*inventory())
    rc = allocated()
    state = mirrored(log, rc)
    share = state.shares["7d0c2c1e-0000-4000-8000-000000000001"]
    log.add(released(share))  # the kubelet unprepared it: the agent gave the capacity back
    state = log.state()
    assert state.claims[(NAMESPACE, "train")].phase == "released"
    # Kubernetes still holds the allocation (the Pod's removal updates reservedFor first)
    assert decide_claim(state, allocated(reserved_for=[]), {DRIVER}).events == ()
    assert judge_prepare(state, NODE, NAMESPACE, "train", UID).verdict == "refused"
    assert decide_deleted(state, NAMESPACE, "train", UID).outcome == "withdrawn"
    anew = allocated(share="7d0c2c1e-0000-4000-8000-000000000002")  # allocated anew
    decision = decide_claim(state, anew, {DRIVER})
    assert decision.outcome == "mirrored"
    bound = decision.events[-1][1]
    assert isinstance(bound, c.AllocationBound) and bound.allocation_version == 2
