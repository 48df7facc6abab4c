"""The claims API's admin writes and delete, one named table row each.

(services.claims.adminwrites.) Each row tells what the log holds, makes one request
and expects the events recorded (as one line each) and the answer: the names applied
and unchanged, a refusal, or a delete's phase.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from events import catalog as c
from events import model
from events.state import ClusterState
from services.claims.adminwrites import (
    LEDGER_REFUSED,
    AdminWrite,
    PolicyChange,
    PolicyPatch,
    decide_access,
    decide_classes,
    decide_delete,
    decide_mode,
    decide_policy,
    decide_remove,
    decide_slices,
    ledger_refusal,
)
from tests.unit.allocator_fixtures import device_class, slice_
from tests.unit.decision_fixtures import (
    NAMESPACE,
    NODE,
    Log,
    admitted,
    described,
    gpu,
    inventory,
    memory_claim,
)

GPU_SLICE = f"{NODE}-slice"  # the slice inventory() publishes


def _slice(total: str = "40Gi", name: str = GPU_SLICE) -> Any:
    return slice_([gpu("gpu-0", total)], node=NODE, name=name)


@dataclass
class Case:
    id: str
    request: Callable[[ClusterState], AdminWrite]
    expect: list[str]
    applied: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    refused: str | None = None  # a fragment of the refusal's message
    code: str = "rejected"  # the refusal's code, kind and field
    kind: str = "below-allocated"
    refused_field: str | None = None
    story: list[str] = field(default_factory=list)  # "reserve <claim> <memory>"


def _min(minimum: str, **more: str) -> model.CapacityRequestPolicy:
    """A validRange policy with ``minimum`` as min and default, 5Gi steps."""
    doc: dict[str, Any] = {"validRange": {"min": minimum, "step": "5Gi", **more}}
    doc["default"] = minimum
    return model.convert(doc, model.CapacityRequestPolicy)


def _set(
    policy: model.CapacityRequestPolicy | None, device: str = "gpu-0", capacity: str = "memory"
) -> Callable[[ClusterState], AdminWrite]:
    change = PolicyChange(
        driver="gpu.test.io", pool="node-a-pool", device=device, capacity=capacity, policy=policy
    )
    return lambda s: decide_policy(s, change)


def _patch(**fields: Any) -> Callable[[ClusterState], AdminWrite]:
    """``policies.set`` with only the fields given (quantities as text)."""
    patch = model.convert(fields, PolicyPatch)
    change = PolicyChange(
        driver="gpu.test.io", pool="node-a-pool", device="gpu-0", capacity="memory", patch=patch
    )
    return lambda s: decide_policy(s, change)


NO_DEFAULT = model.convert({"validRange": {"min": "5Gi"}}, model.CapacityRequestPolicy)
IN_FORCE = model.convert(
    {"default": "5Gi", "validRange": {"min": "5Gi", "step": "5Gi", "max": "40Gi"}},
    model.CapacityRequestPolicy,
)
DEVICE = "gpu.test.io/node-a-pool/gpu-0"

CASES = [
    Case(
        "a-new-class-is-recorded",
        lambda s: decide_classes(s, [device_class("other.test.io")]),
        ["DeviceClassApplied other.test.io"],
        applied=["other.test.io"],
    ),
    Case(
        "a-class-equal-to-the-logs-is-unchanged",
        lambda s: decide_classes(s, [device_class()]),
        [],
        unchanged=["gpu.test.io"],
    ),
    Case(
        "a-changed-class-is-recorded-the-last-of-one-name-wins",
        lambda s: decide_classes(s, [device_class(), device_class(selectors=["true"])]),
        ["DeviceClassApplied gpu.test.io"],
        applied=["gpu.test.io"],
    ),
    Case(
        "a-class-switched-to-whole-device-is-recorded",
        lambda s: decide_mode(s, "gpu.test.io", "whole-device"),
        ["ClassModeSet gpu.test.io whole-device"],
        applied=["gpu.test.io"],
    ),
    Case(
        "a-class-switched-back-to-consumable-is-recorded-live-shares-untouched",
        lambda s: decide_mode(s, "gpu.test.io", "consumable"),
        ["ClassModeSet gpu.test.io consumable"],
        applied=["gpu.test.io"],
        story=["reserve c1 10Gi", "mode whole-device"],
    ),
    Case(
        "a-class-disabled-is-recorded",
        lambda s: decide_mode(s, "gpu.test.io", "disabled"),
        ["ClassModeSet gpu.test.io disabled"],
        applied=["gpu.test.io"],
    ),
    Case(
        "a-mode-equal-to-the-one-in-force-is-unchanged",
        lambda s: decide_mode(s, "gpu.test.io", "consumable"),
        [],
        unchanged=["gpu.test.io"],
    ),
    Case(
        "a-mode-survives-re-applying-the-class",
        lambda s: decide_mode(s, "gpu.test.io", "disabled"),
        [],
        unchanged=["gpu.test.io"],
        story=["mode disabled", "reapply"],
    ),
    Case(
        "a-mode-of-an-unknown-class-is-refused-naming-the-field",
        lambda s: decide_mode(s, "other.test.io", "disabled"),
        [],
        refused="DeviceClass 'other.test.io' does not exist",
        code="not_found",
        kind="unknown-class",
        refused_field="name",
    ),
    Case(
        "a-mode-of-a-removed-class-is-refused",
        lambda s: decide_mode(s, "gpu.test.io", "disabled"),
        [],
        refused="DeviceClass 'gpu.test.io' does not exist",
        code="not_found",
        kind="unknown-class",
        refused_field="name",
        story=["remove"],
    ),
    Case(
        "an-unknown-mode-is-refused-naming-the-field",
        lambda s: decide_mode(s, "gpu.test.io", "shared"),
        [],
        refused="mode: must be one of: consumable, whole-device, disabled (got 'shared')",
        code="invalid",
        kind="invalid-mode",
        refused_field="mode",
    ),
    Case(
        "a-class-with-live-shares-is-removed",
        lambda s: decide_remove(s, "gpu.test.io"),
        ["DeviceClassRemoved gpu.test.io"],
        applied=["gpu.test.io"],
        story=["reserve c1 10Gi"],
    ),
    Case(
        "removing-an-unknown-class-is-refused-naming-the-field",
        lambda s: decide_remove(s, "other.test.io"),
        [],
        refused="DeviceClass 'other.test.io' does not exist",
        code="not_found",
        kind="unknown-class",
        refused_field="name",
    ),
    Case(
        "a-slice-equal-to-the-logs-is-unchanged",
        lambda s: decide_slices(s, [_slice()]),
        [],
        unchanged=[GPU_SLICE],
    ),
    Case(
        "a-grown-slice-and-a-new-one-are-recorded",
        lambda s: decide_slices(s, [_slice("80Gi"), _slice(name="node-b-slice")]),
        [f"ResourceSlicePublished {GPU_SLICE}", "ResourceSlicePublished node-b-slice"],
        applied=[GPU_SLICE, "node-b-slice"],
    ),
    Case(
        "a-total-down-to-what-is-allocated-is-recorded",
        lambda s: decide_slices(s, [_slice("30Gi")]),
        [f"ResourceSlicePublished {GPU_SLICE}"],
        applied=[GPU_SLICE],
        story=["reserve c1 30Gi"],
    ),
    Case(
        "a-total-below-what-is-allocated-is-rejected",
        lambda s: decide_slices(s, [_slice("20Gi")]),
        [],
        refused="device gpu.test.io/node-a-pool/gpu-0 memory: total 20Gi asked, 30Gi allocated",
        story=["reserve c1 30Gi"],
    ),
    Case(
        "a-namespace-gets-its-classes-sorted-once-each",
        lambda s: decide_access(s, "tenant-b", ["b.io", "a.io", "b.io"], True),
        ["NamespaceAccessSet tenant-b a.io,b.io adminAccess"],
        applied=["tenant-b"],
    ),
    Case(
        "access-equal-to-the-logs-is-unchanged",
        lambda s: decide_access(s, NAMESPACE, ["*", "*"], False),
        [],
        unchanged=[NAMESPACE],
    ),
    Case(
        "taking-adminaccess-away-is-recorded",
        lambda s: decide_access(s, NAMESPACE, ["*"], False),
        ["NamespaceAccessSet tenant-a *"],
        applied=[NAMESPACE],
        story=["admin-access"],
    ),
    Case(
        "a-namespace-gets-its-limits-and-opaque-config-classes",
        lambda s: decide_access(
            s,
            "tenant-b",
            ["*"],
            False,
            opaque_config_classes=["b.io", "a.io", "a.io"],
            max_claims=10,
            max_requests_per_claim=4,
        ),
        ["NamespaceAccessSet tenant-b * opaque=a.io,b.io max-claims=10 max-requests=4"],
        applied=["tenant-b"],
    ),
    Case(
        "changing-only-the-quota-is-recorded",
        lambda s: decide_access(s, NAMESPACE, ["*"], False, max_claims=3),
        ["NamespaceAccessSet tenant-a * max-claims=3"],
        applied=[NAMESPACE],
    ),
    Case(
        "a-record-without-the-limits-clears-them",
        lambda s: decide_access(s, NAMESPACE, ["*"], False),
        ["NamespaceAccessSet tenant-a *"],
        applied=[NAMESPACE],
        story=["quota 3"],
    ),
    Case(
        "limits-equal-to-the-logs-are-unchanged",
        lambda s: decide_access(s, NAMESPACE, ["*"], False, max_claims=3),
        [],
        unchanged=[NAMESPACE],
        story=["quota 3"],
    ),
    Case(
        "a-policy-change-takes-the-devices-next-version",
        _set(_min("10Gi", max="40Gi")),
        ["RequestPolicyChanged gpu-0 memory v2 default 10Gi, min 10Gi, step 5Gi, max 40Gi"],
        applied=[f"{DEVICE}/memory"],
    ),
    Case(
        "a-second-policy-change-takes-the-version-after-it",
        _set(_min("15Gi")),
        ["RequestPolicyChanged gpu-0 memory v3 default 15Gi, min 15Gi, step 5Gi"],
        applied=[f"{DEVICE}/memory"],
        story=["policy 10Gi"],
    ),
    Case(
        "a-policy-change-leaves-live-shares-alone",
        _set(_min("10Gi")),
        ["RequestPolicyChanged gpu-0 memory v2 default 10Gi, min 10Gi, step 5Gi"],
        applied=[f"{DEVICE}/memory"],
        story=["reserve c1 5Gi"],
    ),
    Case(
        "removing-the-policy-is-a-change-too",
        _set(None),
        ["RequestPolicyChanged gpu-0 memory v2 no policy"],
        applied=[f"{DEVICE}/memory"],
    ),
    Case(
        "a-policy-equal-to-the-one-in-force-is-unchanged",
        _set(IN_FORCE),
        [],
        unchanged=[f"{DEVICE}/memory"],
    ),
    # the policy in force: default 5Gi, min 5Gi, step 5Gi, max 40Gi
    Case(
        "a-patch-of-min-keeps-step-and-max-and-raises-the-default-to-it",
        _patch(min="10Gi"),
        ["RequestPolicyChanged gpu-0 memory v2 default 10Gi, min 10Gi, step 5Gi, max 40Gi"],
        applied=[f"{DEVICE}/memory"],
    ),
    Case(
        "a-patch-of-max-keeps-the-rest",
        _patch(max="20Gi"),
        ["RequestPolicyChanged gpu-0 memory v2 default 5Gi, min 5Gi, step 5Gi, max 20Gi"],
        applied=[f"{DEVICE}/memory"],
    ),
    Case(
        "a-patch-of-the-default-keeps-the-range",
        _patch(default="15Gi"),
        ["RequestPolicyChanged gpu-0 memory v2 default 15Gi, min 5Gi, step 5Gi, max 40Gi"],
        applied=[f"{DEVICE}/memory"],
    ),
    Case(
        "a-patch-of-values-replaces-the-range-and-keeps-a-default-among-them",
        _patch(values=["5Gi", "20Gi"]),
        ["RequestPolicyChanged gpu-0 memory v2 default 5Gi, values 5Gi/20Gi"],
        applied=[f"{DEVICE}/memory"],
    ),
    Case(
        "a-patch-equal-to-the-policy-in-force-is-unchanged",
        _patch(step="5Gi"),
        [],
        unchanged=[f"{DEVICE}/memory"],
    ),
    Case(
        "a-patch-of-values-with-a-range-field-is-refused-naming-both",
        _patch(values=["5Gi"], min="5Gi"),
        [],
        refused="validValues and validRange (min, step, max) exclude each other",
        code="invalid",
        kind="invalid-policy",
        refused_field="patch.values",
    ),
    Case(
        "a-patched-policy-that-breaks-a-rule-is-refused-naming-it",
        _patch(max="45Gi"),
        [],
        refused="must be less than or equal to the capacity value 40Gi",
        code="invalid",
        kind="invalid-policy",
        refused_field="policy.validRange.max",
    ),
    Case(
        "an-unknown-device-is-refused-naming-the-field",
        _set(_min("10Gi"), device="gpu-9"),
        [],
        refused="no published device gpu.test.io/node-a-pool/gpu-9",
        code="not_found",
        kind="unknown-device",
        refused_field="device",
    ),
    Case(
        "an-unknown-capacity-is-refused-naming-the-field",
        _set(_min("10Gi"), capacity="compute"),
        [],
        refused="has no capacity 'compute' (it has: memory)",
        code="not_found",
        kind="unknown-device",
        refused_field="capacity",
    ),
    Case(
        "a-range-without-a-default-is-refused-naming-the-rule",
        _set(NO_DEFAULT),
        [],
        refused="policy.default: required when validRange is set",
        code="invalid",
        kind="invalid-policy",
        refused_field="policy.default",
    ),
    Case(
        "a-min-above-the-capacity-is-refused-naming-the-rule",
        _set(_min("45Gi")),
        [],
        refused="must be less than or equal to the capacity value 40Gi",
        code="invalid",
        kind="invalid-policy",
        refused_field="policy.validRange.min",
    ),
    Case(
        "a-policy-on-a-dedicated-device-is-refused-naming-the-rule",
        _set(_min("10Gi")),
        [],
        refused="forbidden: allowMultipleAllocations must be true",
        code="invalid",
        kind="invalid-policy",
        refused_field="policy",
        story=["dedicated"],
    ),
]


def _tell(story: list[str]) -> Log:
    log = Log(*inventory())
    for line in story:
        verb, *args = line.split()
        if verb == "reserve":
            log.reserve(memory_claim(args[0], args[1]))
        elif verb == "admit":
            log.extend(admitted(memory_claim(args[0])))
        elif verb == "ready":
            for share_id in log.state().claims[(NAMESPACE, args[0])].share_ids:
                log.add(c.LimitApplied(share_id=share_id, node=NODE, level="none", actual={}))
        elif verb == "release":
            log.add(c.ReleaseRequested(namespace=NAMESPACE, name=args[0], allocation_version=1))
        elif verb == "withdraw":
            log.add(c.ClaimWithdrawn(namespace=NAMESPACE, name=args[0]))
        elif verb == "quota":
            log.add(
                c.NamespaceAccessSet(namespace=NAMESPACE, classes=["*"], max_claims=int(args[0]))
            )
        elif verb == "policy":
            log.add(
                c.RequestPolicyChanged(
                    driver="gpu.test.io",
                    pool="node-a-pool",
                    device="gpu-0",
                    capacity="memory",
                    policy=_min(args[0]),
                    policy_version=2,
                )
            )
        elif verb == "dedicated":
            log.add(
                c.ResourceSlicePublished(
                    slice=slice_([gpu("gpu-0", shared=False)], node=NODE, name=GPU_SLICE)
                )
            )
        elif verb == "mode":
            log.add(c.ClassModeSet(name="gpu.test.io", mode=args[0]))  # type: ignore[arg-type]
        elif verb == "reapply":
            log.add(c.DeviceClassApplied(device_class=device_class(), rollout="immediate"))
        elif verb == "remove":
            log.add(c.DeviceClassRemoved(name="gpu.test.io"))
        elif verb == "admin-access":
            log.add(c.NamespaceAccessSet(namespace=NAMESPACE, classes=["*"], admin_access=True))
    return log


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_admin_write(case: Case) -> None:
    write = case.request(_tell(case.story).state())
    assert described(write.events) == case.expect
    assert (list(write.applied), list(write.unchanged)) == (case.applied, case.unchanged)
    if case.refused is None:
        assert write.refusal is None
    else:
        assert write.refusal is not None and case.refused in write.refusal.message
        assert (write.refusal.code, write.refusal.kind) == (case.code, case.kind)
        if case.refused_field is not None:
            assert write.refusal.field == case.refused_field


def test_a_removed_class_leaves_its_claims_allocated() -> None:
    log = _tell(["reserve c1 10Gi", "mode whole-device"])
    before = log.state().claims[(NAMESPACE, "c1")]
    shares = {s: log.state().shares[s].live for s in before.share_ids}
    log.add(c.DeviceClassRemoved(name="gpu.test.io"))
    after = log.state()
    assert "gpu.test.io" not in after.classes
    assert after.claims[(NAMESPACE, "c1")].phase == before.phase
    assert {s: after.shares[s].live for s in before.share_ids} == shares
    assert all(shares.values())


def test_a_ledger_refusal_names_the_device_when_the_state_shows_it() -> None:
    write = decide_slices(_tell([]).state(), [_slice("20Gi")])  # decided before the reservation
    assert write.refusal is None
    refusal = ledger_refusal(_tell(["reserve c1 30Gi"]).state(), write)
    assert "total 20Gi asked, 30Gi allocated" in refusal.message
    assert ledger_refusal(_tell([]).state(), write) == LEDGER_REFUSED  # released again since


@pytest.mark.parametrize(
    ("story", "found", "expect", "phase"),
    [
        pytest.param(["reserve c1 10Gi"], True, ["ReleaseRequested c1 v1 node-a"], "releasing",
                     id="an-allocated-claim-is-released-on-its-node"),
        pytest.param(["reserve c1 10Gi", "ready c1"], True, ["ReleaseRequested c1 v1 node-a"],
                     "releasing", id="a-ready-claim-is-released-on-its-node"),
        pytest.param(["admit c1"], True, ["ClaimWithdrawn c1"], "withdrawn",
                     id="a-claim-without-shares-is-withdrawn"),
        pytest.param(["reserve c1 10Gi", "release c1"], True, [], "releasing",
                     id="a-claim-being-released-is-left-alone"),
        pytest.param(["admit c1", "withdraw c1"], True, [], "withdrawn",
                     id="a-withdrawn-claim-is-left-alone"),
        pytest.param([], False, [], None, id="a-claim-that-never-existed-is-not-found"),
    ],
)  # fmt: skip
def test_delete(story: list[str], found: bool, expect: list[str], phase: str | None) -> None:
    deletion = decide_delete(_tell(story).state(), NAMESPACE, "c1")
    assert deletion.found is found
    assert described([deletion.event] if deletion.event is not None else []) == expect
    assert deletion.phase == phase
