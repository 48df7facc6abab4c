"""The allocator's rules, one named table row each (upstream semantics, 1.35 behaviour).

Every row builds an inventory, optionally allocates earlier claims (``before``), then
decides one claim and checks the outcome: ``allocated`` with the exact
(request, device, consumedCapacity) list, or ``unschedulable`` / ``invalid`` with a
fragment of the reason.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from events.claimspecs import claim_spec
from events.features import FeatureGates
from events.model import DeviceClaimConfiguration, ResourceClaim, ResourceSlice, convert
from services.reservation.allocating import grants_from_claim, with_claim_configs
from services.reservation.outcomes import Allocated, Invalid, Unschedulable
from tests.unit.allocator_fixtures import (
    allocator,
    claim,
    decide,
    device,
    device_class,
    first_available,
    picked,
    request,
    slice_,
)

GPU_POLICY = {"default": "5Gi", "validRange": {"min": "5Gi", "step": "5Gi", "max": "40Gi"}}
RANGE_2_4 = {"default": "2Gi", "validRange": {"min": "2Gi", "step": "2Gi", "max": "4Gi"}}
VALUES_1_3 = {"default": "1Gi", "validValues": ["1Gi", "3Gi"]}


def gpu(name: str = "gpu-0", total: str = "40Gi", policy: Any = GPU_POLICY, **kw: Any) -> Any:
    return device(name, {"memory": (total, policy) if policy else total}, **kw)


SHARING = "dracap.io/shared-across-namespaces"
DENY = device_class(annotations={SHARING: "deny"})
PRIVATE = device_class("private", annotations={SHARING: "deny"})


def _allocated_status(device_name: str, memory: str) -> dict[str, Any]:
    """``status`` of a claim allocated elsewhere: one share of ``device_name``."""
    result = {
        "request": "r",
        "driver": "gpu.test.io",
        "pool": "node-a-pool",
        "device": device_name,
        "shareID": "6d1f7a52-4d0b-4d6e-9a51-2c3b8e0f7d14",
        "consumedCapacity": {"memory": memory},
    }
    return {"allocation": {"devices": {"results": [result]}}}


@dataclass
class Case:
    id: str
    slices: list[ResourceSlice]
    claim: ResourceClaim
    expect: str  # allocated | unschedulable | invalid
    picks: list[tuple[str, str, dict[str, str] | None]] | None = None
    reason: str = ""
    before: list[ResourceClaim] = field(default_factory=list)
    gates: FeatureGates = field(default_factory=FeatureGates)
    classes: list[Any] | None = None
    admin_ok: bool = False
    node: str | None = None
    modes: dict[str, str] | None = None  # class modes (ClassModeSet)


WHOLE = {"gpu.test.io": "whole-device"}

CASES = [
    # --- class modes (ClassModeSet): whole-device is the gate off for one class ----------
    Case(
        "whole-device-takes-a-shareable-device-whole",
        [slice_([gpu()])],
        claim(request("r")),
        "allocated",
        [("r", "gpu-0", {"memory": "40Gi"})],
        modes=WHOLE,
    ),
    Case(
        "whole-device-skips-a-device-live-shares-hold-existing-shares-untouched",
        [slice_([gpu(), gpu("gpu-1")])],
        claim(request("r")),
        "allocated",
        [("r", "gpu-1", {"memory": "40Gi"})],
        before=[claim(request("r", {"memory": "5Gi"}), status=_allocated_status("gpu-0", "5Gi"))],
        modes=WHOLE,
    ),
    Case(
        "whole-device-takes-a-dedicated-device-as-always",
        [slice_([gpu(policy=None, shared=False)])],
        claim(request("r")),
        "allocated",
        [("r", "gpu-0", None)],
        modes=WHOLE,
    ),
    Case(
        "whole-device-refuses-a-capacity-request-as-with-the-gate-off",
        [slice_([gpu()])],
        claim(request("r", {"memory": "10Gi"})),
        "invalid",
        reason="capacity requests need the DRAConsumableCapacity feature gate, which is off "
        "for device class gpu.test.io (whole-device)",
        modes=WHOLE,
    ),
    Case(
        "whole-device-cannot-take-a-device-whose-policy-caps-a-share-below-its-total",
        [slice_([gpu(total="80Gi")])],
        claim(request("r")),
        "unschedulable",
        reason="not allowed by the request policy",
        modes=WHOLE,
    ),
    Case(
        "a-disabled-class-is-invalid",
        [slice_([gpu()])],
        claim(request("r")),
        "invalid",
        reason="device class gpu.test.io is disabled",
        modes={"gpu.test.io": "disabled"},
    ),
    Case(
        "a-consumable-class-beside-a-whole-device-one-shares-as-before",
        [slice_([gpu()])],
        claim(request("r", {"memory": "10Gi"}, cls="other.test.io")),
        "allocated",
        [("r", "gpu-0", {"memory": "10Gi"})],
        classes=[device_class(), device_class("other.test.io")],
        modes=WHOLE,
    ),
    # --- request policy ----------
    Case(
        "absent-request-takes-policy-default",
        [slice_([gpu()])],
        claim(request("r")),
        "allocated",
        [("r", "gpu-0", {"memory": "5Gi"})],
    ),
    Case(
        "absent-request-without-policy-takes-full-capacity",
        [slice_([gpu(policy=None)])],
        claim(request("r")),
        "allocated",
        [("r", "gpu-0", {"memory": "40Gi"})],
    ),
    Case(
        "request-without-policy-consumes-exactly",
        [slice_([gpu(policy=None)])],
        claim(request("r", {"memory": "3000Mi"})),
        "allocated",
        [("r", "gpu-0", {"memory": "3000Mi"})],
    ),
    Case(
        "below-min-is-raised-to-min",
        [slice_([gpu()])],
        claim(request("r", {"memory": "1Gi"})),
        "allocated",
        [("r", "gpu-0", {"memory": "5Gi"})],
    ),
    Case(
        "step-rounds-up-from-min",
        [slice_([gpu(total="4Gi", policy=RANGE_2_4)])],
        claim(request("r", {"memory": "3Gi"})),
        "allocated",
        [("r", "gpu-0", {"memory": "4Gi"})],
    ),
    Case(
        "step-rounding-counts-from-min-not-zero",
        [
            slice_(
                [
                    gpu(
                        total="10Gi",
                        policy={"default": "1Gi", "validRange": {"min": "1Gi", "step": "2Gi"}},
                    )
                ]
            )
        ],
        claim(request("r", {"memory": "2Gi"})),
        "allocated",
        [("r", "gpu-0", {"memory": "3Gi"})],
    ),
    Case(
        "step-rounding-that-crosses-max-is-ineligible",
        [slice_([gpu(total="10Gi", policy=RANGE_2_4)])],
        claim(request("r", {"memory": "5Gi"})),
        "unschedulable",
        reason="not allowed by the request policy",
    ),
    Case(
        "above-max-ineligible-even-when-free",
        [slice_([gpu(total="10Gi", policy=RANGE_2_4)])],
        claim(request("r", {"memory": "6Gi"})),
        "unschedulable",
        reason="max 4Gi",
    ),
    Case(
        "valid-values-round-up-to-next-value",
        [slice_([gpu(total="4Gi", policy=VALUES_1_3)])],
        claim(request("r", {"memory": "2Gi"})),
        "allocated",
        [("r", "gpu-0", {"memory": "3Gi"})],
    ),
    Case(
        "above-all-valid-values-is-ineligible",
        [slice_([gpu(total="4Gi", policy=VALUES_1_3)])],
        claim(request("r", {"memory": "3584Mi"})),
        "unschedulable",
        reason="not allowed",
    ),
    Case(
        "decimal-and-binary-compare-by-value",
        [slice_([gpu(total="4Gi", policy=VALUES_1_3)])],
        claim(request("r", {"memory": "1G"})),
        "allocated",
        [("r", "gpu-0", {"memory": "1Gi"})],
    ),
    Case(
        "fractional-step-collapses-to-whole-units",
        [
            slice_(
                [
                    device(
                        "d",
                        {"c": ("10", {"default": "1", "validRange": {"min": "1", "step": "500m"}})},
                    )
                ]
            )
        ],
        claim(request("r", {"c": "1500m"})),
        "allocated",
        [("r", "d", {"c": "2"})],
    ),
    # --- capacity fit ----------
    Case(
        "exact-fit-uses-the-last-unit",
        [slice_([gpu()])],
        claim(request("r", {"memory": "10Gi"})),
        "allocated",
        [("r", "gpu-0", {"memory": "10Gi"})],
        before=[claim(request("r", {"memory": "30Gi"}))],
    ),
    Case(
        "one-unit-over-is-unschedulable",
        [slice_([gpu(policy=None)])],
        claim(request("r", {"memory": "10737418241"})),
        "unschedulable",
        reason="largest free is 10Gi",
        before=[claim(request("r", {"memory": "30Gi"}))],
    ),
    Case(
        "request-for-missing-capacity-is-ineligible",
        [slice_([gpu()])],
        claim(request("r", {"compute": "1"})),
        "unschedulable",
        reason="lack the capacity",
    ),
    Case(
        "capacity-names-match-literally",
        [slice_([gpu()])],
        claim(request("r", {"gpu.test.io/memory": "5Gi"})),
        "unschedulable",
        reason="lack the capacity",
    ),
    Case(
        "unrequested-capacity-takes-default-or-everything",
        [slice_([device("g", {"memory": ("40Gi", GPU_POLICY), "compute": "100"})])],
        claim(request("r", {"memory": "5Gi"})),
        "allocated",
        [("r", "g", {"memory": "5Gi", "compute": "100"})],
    ),
    Case(
        "zero-request-without-policy-fits-a-full-device",
        [slice_([device("d", {"c": "10"})])],
        claim(request("r", {"c": "0"})),
        "allocated",
        [("r", "d", {"c": "0"})],
        before=[claim(request("r", {"c": "10"}))],
    ),
    Case(
        "first-fit-skips-full-devices",
        [slice_([gpu("gpu-0"), gpu("gpu-1")])],
        claim(request("r", {"memory": "20Gi"})),
        "allocated",
        [("r", "gpu-1", {"memory": "20Gi"})],
        before=[claim(request("r", {"memory": "25Gi"}))],
    ),
    Case(
        "shared-device-without-capacities-shares-without-limit",
        [slice_([device("d")])],
        claim(request("r")),
        "allocated",
        [("r", "d", None)],
        before=[claim(request("r")), claim(request("r"))],
    ),
    # --- dedicated vs multi-allocatable -----------------------------------------------------
    Case(
        "dedicated-device-is-never-shared",
        [slice_([gpu(policy=None, shared=False)])],
        claim(request("r", {"memory": "1Gi"})),
        "unschedulable",
        reason="exclusive use",
        before=[claim(request("r", {"memory": "1Gi"}))],
    ),
    Case(
        "dedicated-result-has-no-share-id-or-consumed-capacity",
        [slice_([gpu(policy=None, shared=False)])],
        claim(request("r", {"memory": "1Gi"})),
        "allocated",
        [("r", "gpu-0", None)],
    ),
    Case(
        "dedicated-device-too-small-is-filtered",
        [slice_([gpu(total="1Gi", policy=None, shared=False)])],
        claim(request("r", {"memory": "2Gi"})),
        "unschedulable",
    ),
    Case(
        # upstream 1.34-1.36 says "too little free" here; 1.37 and dracap: in use
        "exclusive-device-after-a-share-exists-is-in-use-while-the-share-lives",
        [slice_([gpu(policy=None, shared=False)])],
        claim(request("r")),
        "unschedulable",
        reason="1 still shared",
        before=[
            claim(
                request("r"),
                status={
                    "allocation": {
                        "devices": {
                            "results": [
                                {
                                    "request": "r",
                                    "driver": "gpu.test.io",
                                    "pool": "node-a-pool",
                                    "device": "gpu-0",
                                    "shareID": "0b6c1a53-4a4f-4b7e-9a4e-2a1d6f4c9e10",
                                    "consumedCapacity": {"memory": "10Gi"},
                                }
                            ]
                        }
                    }
                },
            )
        ],
    ),
    Case(
        "shared-device-blocked-by-an-exclusive-result",
        [slice_([gpu()])],
        claim(request("r", {"memory": "5Gi"})),
        "unschedulable",
        reason="exclusive use",
        before=[
            claim(
                request("r"),
                status={
                    "allocation": {
                        "devices": {
                            "results": [
                                {
                                    "request": "r",
                                    "driver": "gpu.test.io",
                                    "pool": "node-a-pool",
                                    "device": "gpu-0",
                                }
                            ]
                        }
                    }
                },
            )
        ],
    ),
    Case(
        "two-requests-of-one-claim-share-one-device",
        [slice_([gpu()])],
        claim(request("a", {"memory": "20Gi"}), request("b", {"memory": "20Gi"})),
        "allocated",
        [("a", "gpu-0", {"memory": "20Gi"}), ("b", "gpu-0", {"memory": "20Gi"})],
    ),
    Case(
        "in-call-consumption-counts",
        [slice_([gpu("gpu-0"), gpu("gpu-1")])],
        claim(request("a", {"memory": "25Gi"}), request("b", {"memory": "25Gi"})),
        "allocated",
        [("a", "gpu-0", {"memory": "25Gi"}), ("b", "gpu-1", {"memory": "25Gi"})],
    ),
    Case(
        "exact-count-picks-a-shared-device-twice",
        [slice_([gpu()])],
        claim(request("r", {"memory": "10Gi"}, count=2)),
        "allocated",
        [("r", "gpu-0", {"memory": "10Gi"}), ("r", "gpu-0", {"memory": "10Gi"})],
    ),
    Case(
        "exact-count-dedicated-needs-distinct-devices",
        [slice_([gpu("g0", policy=None, shared=False), gpu("g1", policy=None, shared=False)])],
        claim(request("r", count=2)),
        "allocated",
        [("r", "g0", None), ("r", "g1", None)],
    ),
    Case(
        "exact-count-more-than-available",
        [slice_([gpu("g0", policy=None, shared=False)])],
        claim(request("r", count=2)),
        "unschedulable",
    ),
    # --- All ----------
    Case(
        "all-takes-every-matching-device",
        [slice_([gpu("gpu-0"), gpu("gpu-1")])],
        claim(request("r", {"memory": "5Gi"}, mode="All")),
        "allocated",
        [("r", "gpu-0", {"memory": "5Gi"}), ("r", "gpu-1", {"memory": "5Gi"})],
    ),
    Case(
        "all-silently-drops-devices-that-do-not-fit",
        [slice_([gpu("gpu-0"), gpu("gpu-1")])],
        claim(request("r", {"memory": "20Gi"}, mode="All")),
        "allocated",
        [("r", "gpu-1", {"memory": "20Gi"})],
        before=[claim(request("r", {"memory": "25Gi"}))],
    ),
    Case(
        "all-over-an-incomplete-pool-is-an-error",
        [slice_([gpu()], count=2)],
        claim(request("r", mode="All")),
        "invalid",
        reason="incomplete",
    ),
    Case(
        "all-fails-when-a-device-is-held",
        [slice_([gpu("g0", policy=None, shared=False), gpu("g1", policy=None, shared=False)])],
        claim(request("r", mode="All")),
        "unschedulable",
        before=[claim(request("r"))],
    ),
    Case(
        "exact-count-skips-incomplete-pools",
        [slice_([gpu("gpu-0")], pool="p1", count=2), slice_([gpu("gpu-9")], pool="p2")],
        claim(request("r", {"memory": "5Gi"})),
        "allocated",
        [("r", "gpu-9", {"memory": "5Gi"})],
    ),
    Case(
        "invalid-pool-is-an-error-only-without-solution",
        [slice_([gpu("gpu-0"), gpu("gpu-0")], pool="p1")],
        claim(request("r", {"memory": "5Gi"})),
        "invalid",
        reason="not unique",
    ),
    # --- constraints ----------
    Case(
        "distinct-attribute-forces-two-devices",
        [
            slice_(
                [gpu("gpu-0", attributes={"uuid": "u0"}), gpu("gpu-1", attributes={"uuid": "u1"})]
            )
        ],
        claim(
            request("a", {"memory": "5Gi"}),
            request("b", {"memory": "5Gi"}),
            constraints=[{"distinctAttribute": "gpu.test.io/uuid"}],
        ),
        "allocated",
        [("a", "gpu-0", {"memory": "5Gi"}), ("b", "gpu-1", {"memory": "5Gi"})],
    ),
    Case(
        "distinct-attribute-compares-values-not-devices",
        [
            slice_(
                [gpu("gpu-0", attributes={"model": "x"}), gpu("gpu-1", attributes={"model": "x"})]
            )
        ],
        claim(
            request("a", {"memory": "5Gi"}),
            request("b", {"memory": "5Gi"}),
            constraints=[{"distinctAttribute": "gpu.test.io/model"}],
        ),
        "unschedulable",
    ),
    Case(
        "distinct-attribute-holds-across-all-devices-of-a-request",
        [slice_([gpu(f"gpu-{i}", attributes={"uuid": f"u{i}"}) for i in range(3)])],
        claim(
            request("r", {"memory": "5Gi"}, count=3),
            constraints=[{"distinctAttribute": "gpu.test.io/uuid"}],
        ),
        "allocated",
        [
            ("r", "gpu-0", {"memory": "5Gi"}),
            ("r", "gpu-1", {"memory": "5Gi"}),
            ("r", "gpu-2", {"memory": "5Gi"}),
        ],
    ),
    Case(
        "distinct-attribute-device-without-attribute-rejected",
        [slice_([gpu("gpu-0")])],
        claim(
            request("r", {"memory": "5Gi"}), constraints=[{"distinctAttribute": "gpu.test.io/uuid"}]
        ),
        "unschedulable",
    ),
    Case(
        "match-attribute-backtracks-to-a-matching-pair",
        [
            slice_(
                [
                    gpu("gpu-0", attributes={"numa": 0}),
                    gpu("gpu-1", attributes={"numa": 1}),
                    device("nic-0", {"bw": "10G"}, attributes={"numa": 1}),
                ]
            )
        ],
        claim(
            request("g", {"memory": "5Gi"}),
            request("n", {"bw": "1G"}),
            constraints=[{"matchAttribute": "gpu.test.io/numa"}],
        ),
        "allocated",
        [("g", "gpu-1", {"memory": "5Gi"}), ("n", "nic-0", {"bw": "1G"})],
    ),
    Case(
        "constraint-limited-to-listed-requests",
        [slice_([gpu("gpu-0", attributes={"uuid": "u0"})])],
        claim(
            request("a", {"memory": "5Gi"}),
            request("b", {"memory": "5Gi"}),
            request("c", {"memory": "5Gi"}),
            constraints=[{"requests": ["a", "b"], "matchAttribute": "gpu.test.io/uuid"}],
        ),
        "allocated",
        [
            ("a", "gpu-0", {"memory": "5Gi"}),
            ("b", "gpu-0", {"memory": "5Gi"}),
            ("c", "gpu-0", {"memory": "5Gi"}),
        ],
    ),
    # --- firstAvailable ----------
    Case(
        "first-available-takes-the-first-that-fits",
        [slice_([gpu()])],
        claim(
            first_available(
                "r", request("big", {"memory": "30Gi"}), request("small", {"memory": "5Gi"})
            )
        ),
        "allocated",
        [("r/small", "gpu-0", {"memory": "5Gi"})],
        before=[claim(request("r", {"memory": "20Gi"}))],
    ),
    Case(
        "first-available-prefers-earlier-subrequest",
        [slice_([gpu()])],
        claim(
            first_available(
                "r", request("big", {"memory": "30Gi"}), request("small", {"memory": "5Gi"})
            )
        ),
        "allocated",
        [("r/big", "gpu-0", {"memory": "30Gi"})],
    ),
    Case(
        "first-available-needs-its-gate",
        [slice_([gpu()])],
        claim(first_available("r", request("small", {"memory": "5Gi"}))),
        "invalid",
        reason="DRAPrioritizedList",
        gates=FeatureGates(prioritized_list=False),
    ),
    # --- adminAccess ----------
    Case(
        "admin-access-ignores-exclusive-holds",
        [slice_([gpu(policy=None, shared=False)])],
        claim(request("r", admin=True), namespace="ops"),
        "allocated",
        [("r", "gpu-0", None)],
        before=[claim(request("r"))],
        admin_ok=True,
    ),
    Case(
        "admin-access-still-checks-capacity-on-shared-devices",
        [slice_([gpu()])],
        claim(request("r", {"memory": "15Gi"}, admin=True), namespace="ops"),
        "unschedulable",
        before=[claim(request("r", {"memory": "30Gi"}))],
        admin_ok=True,
    ),
    Case(
        "admin-access-needs-a-labelled-namespace",
        [slice_([gpu()])],
        claim(request("r", admin=True)),
        "invalid",
        reason="admin-access",
    ),
    Case(
        "admin-access-needs-its-gate",
        [slice_([gpu()])],
        claim(request("r", admin=True), namespace="ops"),
        "invalid",
        reason="DRAAdminAccess",
        gates=FeatureGates(admin_access=False),
        admin_ok=True,
    ),
    # --- nodes ----------
    Case(
        "devices-come-from-one-node",
        [slice_([gpu("gpu-0")], node="node-a"), slice_([gpu("gpu-1")], node="node-b")],
        claim(request("a", {"memory": "30Gi"}), request("b", {"memory": "30Gi"})),
        "unschedulable",
    ),
    Case(
        "node-restricts-the-devices",
        [slice_([gpu("gpu-0")], node="node-a"), slice_([gpu("gpu-1")], node="node-b")],
        claim(request("a", {"memory": "5Gi"})),
        "allocated",
        [("a", "gpu-1", {"memory": "5Gi"})],
        node="node-b",
    ),
    Case(
        "all-nodes-slices-are-reachable-from-every-node",
        [slice_([gpu("gpu-9")], node=None)],
        claim(request("a", {"memory": "5Gi"})),
        "allocated",
        [("a", "gpu-9", {"memory": "5Gi"})],
        node="node-z",
    ),
    # --- classes, selectors, gates ----------
    Case(
        "missing-class-is-invalid",
        [slice_([gpu()])],
        claim(request("r", cls="nope.test.io")),
        "invalid",
        reason="does not exist",
    ),
    Case(
        "request-selectors-filter-devices",
        [
            slice_(
                [gpu("gpu-0", attributes={"model": "a"}), gpu("gpu-1", attributes={"model": "b"})]
            )
        ],
        claim(
            request(
                "r", {"memory": "5Gi"}, selectors=['device.attributes["gpu.test.io"].model == "b"']
            )
        ),
        "allocated",
        [("r", "gpu-1", {"memory": "5Gi"})],
    ),
    Case(
        "cel-runtime-error-is-invalid",
        [slice_([gpu("gpu-0")])],
        claim(request("r", selectors=['device.attributes["gpu.test.io"].missing == "x"'])),
        "invalid",
        reason="missing",
    ),
    Case(
        "cel-capacity-is-the-total",
        [slice_([gpu("gpu-0")])],
        claim(
            request(
                "r",
                {"memory": "5Gi"},
                selectors=[
                    'device.capacity["gpu.test.io"].memory.compareTo(quantity("40Gi")) == 0'
                ],
            )
        ),
        "allocated",
        [("r", "gpu-0", {"memory": "5Gi"})],
        before=[claim(request("r", {"memory": "30Gi"}))],
    ),
    Case(
        "gate-off-capacity-request-is-invalid",
        [slice_([gpu()])],
        claim(request("r", {"memory": "5Gi"})),
        "invalid",
        reason="DRAConsumableCapacity",
        gates=FeatureGates(consumable_capacity=False),
    ),
    Case(
        "gate-off-distinct-attribute-is-invalid",
        [slice_([gpu()])],
        claim(request("r"), constraints=[{"distinctAttribute": "gpu.test.io/uuid"}]),
        "invalid",
        reason="DRAConsumableCapacity",
        gates=FeatureGates(consumable_capacity=False),
    ),
    Case(
        "gate-off-devices-are-dedicated",
        [slice_([gpu()])],
        claim(request("r")),
        "unschedulable",
        gates=FeatureGates(consumable_capacity=False),
        before=[claim(request("r"))],
    ),
    Case(
        "gate-off-results-carry-no-share-id",
        [slice_([gpu()])],
        claim(request("r")),
        "allocated",
        [("r", "gpu-0", None)],
        gates=FeatureGates(consumable_capacity=False),
    ),
    Case(
        "more-than-32-devices-is-invalid",
        [slice_([gpu()])],
        claim(request("r", count=33)),
        "invalid",
        reason="32",
    ),
    # --- a device republished as dedicated while shares hold it (upstream 1.37) ----------
    Case(
        "dedicated-device-with-a-live-share-is-in-use-even-when-the-request-fits-beside-it",
        [slice_([gpu(policy=None, shared=False)])],
        claim(request("r", {"memory": "5Gi"})),
        "unschedulable",
        reason="still shared",
        before=[claim(request("r"), status=_allocated_status("gpu-0", "5Gi"))],
    ),
    Case(
        "dedicated-device-with-a-live-share-is-in-use-once-its-capacities-are-gone",
        [slice_([device("gpu-0", shared=False)])],
        claim(request("r")),
        "unschedulable",
        reason="still shared",
        before=[claim(request("r"), status=_allocated_status("gpu-0", "5Gi"))],
    ),
    Case(
        "dedicated-device-with-a-live-share-sends-the-claim-to-another-device",
        [
            slice_(
                [gpu("gpu-0", policy=None, shared=False), gpu("gpu-1", policy=None, shared=False)]
            )
        ],
        claim(request("r")),
        "allocated",
        [("r", "gpu-1", None)],
        before=[claim(request("r"), status=_allocated_status("gpu-0", "5Gi"))],
    ),
    Case(
        "shared-device-is-not-in-use-because-of-its-own-shares",
        [slice_([gpu()])],
        claim(request("r", {"memory": "5Gi"})),
        "allocated",
        [("r", "gpu-0", {"memory": "5Gi"})],
        before=[claim(request("r"), status=_allocated_status("gpu-0", "5Gi"))],
    ),
    Case(
        "dedicated-device-with-a-live-share-admin-access-ignores-it-as-it-ignores-holds",
        [slice_([gpu(policy=None, shared=False)])],
        claim(request("r", {"memory": "5Gi"}, admin=True), namespace="ops"),
        "allocated",
        [("r", "gpu-0", None)],
        before=[claim(request("r"), status=_allocated_status("gpu-0", "5Gi"))],
        admin_ok=True,
    ),
    # --- dracap tenancy: dracap.io/shared-across-namespaces (docs/tenancy.md) ----------
    Case(
        "deny-keeps-a-shared-device-to-the-namespace-holding-it",
        [slice_([gpu()])],
        claim(request("r", {"memory": "5Gi"}), namespace="tenant-b"),
        "unschedulable",
        reason="1 held by another namespace",
        before=[claim(request("r", {"memory": "10Gi"}), namespace="tenant-a")],
        classes=[DENY],
    ),
    Case(
        "deny-lets-the-same-namespace-share-the-device",
        [slice_([gpu()])],
        claim(request("r", {"memory": "5Gi"}), namespace="tenant-a"),
        "allocated",
        [("r", "gpu-0", {"memory": "5Gi"})],
        before=[claim(request("r", {"memory": "10Gi"}), namespace="tenant-a")],
        classes=[DENY],
    ),
    Case(
        "deny-sends-another-namespace-to-a-device-nobody-else-holds",
        [slice_([gpu("gpu-0"), gpu("gpu-1")])],
        claim(request("r", {"memory": "5Gi"}), namespace="tenant-b"),
        "allocated",
        [("r", "gpu-1", {"memory": "5Gi"})],
        before=[claim(request("r", {"memory": "10Gi"}), namespace="tenant-a")],
        classes=[DENY],
    ),
    Case(
        "deny-counts-holds-recorded-in-a-claims-status",
        [slice_([gpu()])],
        claim(request("r", {"memory": "5Gi"}), namespace="tenant-b"),
        "unschedulable",
        reason="held by another namespace",
        before=[
            claim(
                request("r", {"memory": "10Gi"}),
                namespace="tenant-a",
                status=_allocated_status("gpu-0", "10Gi"),
            )
        ],
        classes=[DENY],
    ),
    Case(
        "deny-keeps-a-dedicated-device-to-one-namespace-too",
        [slice_([gpu("gpu-0", policy=None, shared=False)])],
        claim(request("r"), namespace="tenant-b"),
        "unschedulable",
        reason="1 in exclusive use",
        before=[claim(request("r"), namespace="tenant-a")],
        classes=[DENY],
    ),
    Case(
        "deny-wins-when-the-holder-came-through-a-class-that-allows",
        [slice_([gpu()])],
        claim(request("r", {"memory": "5Gi"}, cls="private"), namespace="tenant-b"),
        "unschedulable",
        reason="held by another namespace",
        before=[claim(request("r", {"memory": "10Gi"}), namespace="tenant-a")],
        classes=[device_class(), PRIVATE],
    ),
    Case(
        "deny-wins-when-the-newcomer-comes-through-a-class-that-allows",
        [slice_([gpu()])],
        claim(request("r", {"memory": "5Gi"}), namespace="tenant-b"),
        "unschedulable",
        reason="held by another namespace",
        before=[claim(request("r", {"memory": "10Gi"}, cls="private"), namespace="tenant-a")],
        classes=[device_class(), PRIVATE],
    ),
    Case(
        "deny-of-a-class-that-selects-other-devices-changes-nothing-here",
        [slice_([gpu("gpu-0", attributes={"model": "a"})])],
        claim(request("r", {"memory": "5Gi"}), namespace="tenant-b"),
        "allocated",
        [("r", "gpu-0", {"memory": "5Gi"})],
        before=[claim(request("r", {"memory": "10Gi"}), namespace="tenant-a")],
        classes=[
            device_class(),
            device_class(
                "private",
                ['device.attributes["gpu.test.io"].model == "b"'],
                annotations={SHARING: "deny"},
            ),
        ],
    ),
    Case(
        "allow-shares-a-device-across-namespaces",
        [slice_([gpu()])],
        claim(request("r", {"memory": "5Gi"}), namespace="tenant-b"),
        "allocated",
        [("r", "gpu-0", {"memory": "5Gi"})],
        before=[claim(request("r", {"memory": "10Gi"}), namespace="tenant-a")],
        classes=[device_class(annotations={SHARING: "allow"})],
    ),
    Case(
        "deny-admin-access-ignores-it-as-it-ignores-holds",
        [slice_([gpu()])],
        claim(request("r", {"memory": "5Gi"}, admin=True), namespace="ops"),
        "allocated",
        [("r", "gpu-0", {"memory": "5Gi"})],
        before=[claim(request("r", {"memory": "10Gi"}), namespace="tenant-a")],
        classes=[DENY],
        admin_ok=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule(case: Case) -> None:
    alloc = allocator(case.slices, case.classes, gates=case.gates, class_modes=case.modes)
    for earlier in case.before:
        if earlier.status is not None:
            alloc.add_grants(
                grants_from_claim(earlier, consumable_capacity=case.gates.consumable_capacity)
            )
            continue
        out = decide(alloc, earlier, node=case.node, admin_ok=case.admin_ok)
        assert isinstance(out, Allocated), out
    out = decide(alloc, case.claim, node=case.node, admin_ok=case.admin_ok, commit=False)
    if case.expect == "allocated":
        assert isinstance(out, Allocated), out
        assert picked(out) == case.picks
    elif case.expect == "unschedulable":
        assert isinstance(out, Unschedulable), out
        assert case.reason in out.reason
    else:
        assert isinstance(out, Invalid), out
        assert case.reason in out.reason


#: opaque configuration of the claim, as a tenant allowed to configure writes it
_TUNING = {"opaque": {"driver": "gpu.test.io", "parameters": {"mps": {"threads": 50}}}}


def _configured(whole: ResourceClaim) -> ResourceClaim:
    """``whole`` with a configuration and the metadata no decision reads."""
    devices = whole.spec.devices
    assert devices is not None
    config = [convert(_TUNING, DeviceClaimConfiguration)]
    meta = msgspec.structs.replace(whole.metadata, annotations={"note": "x" * 1024})
    return msgspec.structs.replace(
        whole,
        metadata=meta,
        spec=msgspec.structs.replace(
            whole.spec, devices=msgspec.structs.replace(devices, config=config)
        ),
    )


def _decided(case: Case, decided: ResourceClaim, whole: ResourceClaim) -> Any:
    """``case`` decided on ``decided``, the configuration of ``whole`` added after (as the
    reservation service does), with share ids numbered from 1."""
    alloc = allocator(case.slices, case.classes, gates=case.gates, class_modes=case.modes)
    ids = itertools.count(1)
    alloc.new_share_id = lambda: f"share-{next(ids)}"
    for earlier in case.before:
        if earlier.status is not None:
            alloc.add_grants(
                grants_from_claim(earlier, consumable_capacity=case.gates.consumable_capacity)
            )
        else:
            decide(alloc, earlier, node=case.node, admin_ok=case.admin_ok)
    out = decide(alloc, decided, node=case.node, admin_ok=case.admin_ok, commit=False)
    if isinstance(out, Allocated) and decided is not whole:
        devices = whole.spec.devices
        config = devices.config if devices is not None else None
        out = msgspec.structs.replace(out, allocation=with_claim_configs(out.allocation, config))
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("configured", [False, True], ids=["plain", "configured"])
def test_rule_decided_on_the_compact_claim(case: Case, configured: bool) -> None:
    """Every row gives the same outcome, to the byte, when decided as the reservation
    service decides it: on what the fold keeps of the claim (``ClaimSpec.as_claim``), its
    configuration copied in from the manifest afterwards."""
    whole = _configured(case.claim) if configured else case.claim
    meta = whole.metadata
    compact = claim_spec(whole).as_claim(meta.namespace or "", meta.name)
    assert _decided(case, compact, whole) == _decided(case, whole, whole)


def test_class_and_claim_configs_keep_their_order_on_the_compact_claim() -> None:
    cls = device_class(config=[{"opaque": {"driver": "gpu.test.io", "parameters": {"mps": True}}}])
    case = Case(
        "configured-class",
        [slice_([gpu("gpu-0"), gpu("gpu-1")])],
        claim(request("a", {"memory": "5Gi"}), request("b", {"memory": "5Gi"})),
        "allocated",
        classes=[cls],
    )
    whole = _configured(case.claim)
    compact = claim_spec(whole).as_claim(whole.metadata.namespace or "", whole.metadata.name)
    out = _decided(case, compact, whole)
    assert out == _decided(case, whole, whole)
    configs = out.allocation.devices.config
    assert [c.source for c in configs] == ["FromClass", "FromClaim"]


def test_nothing_fits_beside_a_whole_device_share_once_the_class_is_consumable_again() -> None:
    whole = allocator([slice_([gpu()])], class_modes=WHOLE)
    first = decide(whole, claim(request("r")))
    assert picked(first) == [("r", "gpu-0", {"memory": "40Gi"})]
    assert isinstance(first, Allocated)
    consumable = allocator([slice_([gpu()])])
    consumable.add_grants(first.grants)
    out = decide(consumable, claim(request("r", {"memory": "5Gi"})))
    assert isinstance(out, Unschedulable), out


UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def test_every_share_gets_a_fresh_v4_share_id() -> None:
    alloc = allocator([slice_([gpu()])])
    ids = set()
    for _ in range(4):
        out = decide(alloc, claim(request("r", {"memory": "5Gi"}, count=2)))
        assert isinstance(out, Allocated)
        for r in out.allocation.devices.results or []:  # type: ignore[union-attr]
            assert r.share_id is not None and UUID.match(r.share_id)
            ids.add(r.share_id)
    assert len(ids) == 8


def test_admin_access_consumption_is_never_counted_afterwards() -> None:
    alloc = allocator([slice_([gpu()])])
    admin = decide(
        alloc, claim(request("r", {"memory": "40Gi"}, admin=True), namespace="ops"), admin_ok=True
    )
    assert isinstance(admin, Allocated)
    assert admin.allocation.devices.results[0].admin_access is True  # type: ignore[union-attr,index]
    out = decide(alloc, claim(request("r", {"memory": "40Gi"})))
    assert picked(out) == [("r", "gpu-0", {"memory": "40Gi"})]


def test_admin_access_counts_within_its_own_call() -> None:
    alloc = allocator([slice_([gpu()])])
    out = decide(
        alloc,
        claim(
            request("a", {"memory": "30Gi"}, admin=True),
            request("b", {"memory": "20Gi"}),
            namespace="ops",
        ),
        admin_ok=True,
    )
    assert isinstance(out, Unschedulable)


def test_release_gives_capacity_back() -> None:
    alloc = allocator([slice_([gpu()])])
    first = decide(alloc, claim(request("r", {"memory": "40Gi"})))
    assert isinstance(first, Allocated)
    assert isinstance(decide(alloc, claim(request("r", {"memory": "5Gi"}))), Unschedulable)
    alloc.release(first)
    assert isinstance(decide(alloc, claim(request("r", {"memory": "40Gi"}))), Allocated)


def test_node_selector_names_the_node_of_a_node_slice() -> None:
    alloc = allocator([slice_([gpu()], node="node-a")])
    out = decide(alloc, claim(request("r", {"memory": "5Gi"})))
    assert isinstance(out, Allocated) and out.allocation.node_selector is not None
    term = out.allocation.node_selector.node_selector_terms[0]
    assert term.match_fields is not None
    assert (term.match_fields[0].key, term.match_fields[0].values) == ("metadata.name", ["node-a"])


def test_all_nodes_allocation_has_no_node_selector() -> None:
    alloc = allocator([slice_([gpu()], node=None)])
    out = decide(alloc, claim(request("r", {"memory": "5Gi"})))
    assert isinstance(out, Allocated) and out.allocation.node_selector is None


def test_deny_gives_the_device_back_to_everybody_once_released() -> None:
    alloc = allocator([slice_([gpu()])], [DENY])
    first = decide(alloc, claim(request("r", {"memory": "10Gi"}), namespace="tenant-a"))
    assert isinstance(first, Allocated)
    other = claim(request("r", {"memory": "5Gi"}), namespace="tenant-b")
    assert isinstance(decide(alloc, other, commit=False), Unschedulable)
    alloc.release(first)
    assert picked(decide(alloc, other)) == [("r", "gpu-0", {"memory": "5Gi"})]


def test_grants_name_their_claims_namespace() -> None:
    alloc = allocator([slice_([gpu()])])
    out = decide(alloc, claim(request("r", {"memory": "5Gi"}), namespace="tenant-b"))
    assert isinstance(out, Allocated)
    assert [g.namespace for g in out.grants] == ["tenant-b"]
    assert alloc.allocated.holders == {("gpu.test.io", "node-a-pool", "gpu-0"): {"tenant-b": 1}}


def test_class_config_is_copied_once_listing_its_requests() -> None:
    cls = device_class(config=[{"opaque": {"driver": "gpu.test.io", "parameters": {"mps": True}}}])
    alloc = allocator([slice_([gpu()])], [cls])
    out = decide(alloc, claim(request("a", {"memory": "5Gi"}), request("b", {"memory": "5Gi"})))
    assert isinstance(out, Allocated)
    configs = out.allocation.devices.config  # type: ignore[union-attr]
    assert configs is not None and len(configs) == 1
    assert (configs[0].source, configs[0].requests) == ("FromClass", ["a", "b"])


def test_a_dedicated_device_is_free_again_once_its_last_share_is_released() -> None:
    shared = [slice_([gpu()])]
    alloc = allocator(shared)
    shares = [decide(alloc, claim(request("r", {"memory": "5Gi"}))) for _ in range(2)]
    assert all(isinstance(out, Allocated) for out in shares)
    flipped = allocator([slice_([gpu(policy=None, shared=False)])])
    for out in shares:
        assert isinstance(out, Allocated)
        flipped.add_grants(out.grants)
    whole = claim(request("r"))
    for out in shares:
        waiting = decide(flipped, whole, commit=False)
        assert isinstance(waiting, Unschedulable) and "still shared" in waiting.reason
        assert isinstance(out, Allocated)
        flipped.release(out)
    assert picked(decide(flipped, whole)) == [("r", "gpu-0", None)]
    assert flipped.allocated.shared == {}
