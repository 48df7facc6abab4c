"""Admission rules: one named table row per rule, plus what gets recorded."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from events import catalog as c
from events.envelopes import new_envelope
from events.fold import fold
from events.inventory import build_inventory
from events.manifests import load_documents
from events.model import DeviceClass, ResourceClaim, ResourceSlice
from events.state import ClusterState
from services.claims.admission import (
    MAX_MANIFEST_BYTES,
    DeviceLimits,
    admit,
    decide_apply,
    read_claim,
)

CLASS = "gpu-memory.dracap.io"
INVENTORY = f"""
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {{name: {CLASS}}}
spec:
  selectors:
    - cel: {{expression: device.driver == "gpu.dracap.io"}}
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {{name: other.dracap.io}}
spec: {{}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {{name: node-a-gpu}}
spec:
  driver: gpu.dracap.io
  nodeName: node-a
  pool: {{name: node-a, generation: 1, resourceSliceCount: 1}}
  devices:
    - name: gpu-0
      allowMultipleAllocations: true
      capacity:
        memory:
          value: 40Gi
          requestPolicy: {{default: 5Gi, validRange: {{min: 5Gi, step: 5Gi, max: 40Gi}}}}
    - name: gpu-1
      allowMultipleAllocations: true
      capacity:
        memory:
          value: 80Gi
          requestPolicy: {{default: 5Gi, validRange: {{min: 5Gi, step: 5Gi, max: 60Gi}}}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {{name: node-a-nic}}
spec:
  driver: nic.dracap.io
  nodeName: node-a
  pool: {{name: node-a-nic, generation: 1, resourceSliceCount: 1}}
  devices:
    - name: nic-0
      allowMultipleAllocations: true
      capacity:
        memory: {{value: 500Gi}}
"""


def _state() -> ClusterState:
    events: list[c.Event] = []
    for obj in load_documents(INVENTORY, "inventory"):
        if isinstance(obj, DeviceClass):
            events.append(c.DeviceClassApplied(device_class=obj, rollout="immediate"))
        elif isinstance(obj, ResourceSlice):
            events.append(c.ResourceSlicePublished(slice=obj))
    events.append(c.NamespaceAccessSet(namespace="tenant-a", classes=[CLASS]))
    events.append(
        c.NamespaceAccessSet(
            namespace="ops", classes=["*"], admin_access=True, opaque_config_classes=["*"]
        )
    )
    events.append(
        c.NamespaceAccessSet(
            namespace="tenant-q",
            classes=["*"],
            opaque_config_classes=[CLASS],
            max_claims=1,
            max_requests_per_claim=2,
        )
    )
    events.append(c.NamespaceAccessSet(namespace="tenant-full", classes=["*"], max_claims=0))
    envelopes = [
        new_envelope(e, stream_version=1, actor="test", position=i + 1)
        for i, e in enumerate(events)
    ]
    return fold(envelopes)


STATE = _state()


def manifest(
    *,
    name: str = "train",
    namespace: str | None = "tenant-a",
    class_name: str = CLASS,
    memory: str | None = "10Gi",
    admin: bool | None = None,
    selectors: tuple[str, ...] = (),
) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": class_name}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    if admin is not None:
        exactly["adminAccess"] = admin
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": meta,
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def with_requests(
    doc: dict[str, Any], *classes: str, config: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """``doc`` with one request per class (``r0``, ``r1``, …) and ``spec.devices.config``."""
    requests = [
        {"name": f"r{i}", "exactly": {"deviceClassName": cls}} for i, cls in enumerate(classes)
    ]
    devices: dict[str, Any] = {"requests": requests or doc["spec"]["devices"]["requests"]}
    if config is not None:
        devices["config"] = config
    return {**doc, "spec": {"devices": devices}}


def opaque(*requests: str) -> dict[str, Any]:
    """One opaque driver configuration for ``requests`` (none: every request)."""
    entry: dict[str, Any] = {"opaque": {"driver": "gpu.dracap.io", "parameters": {"mps": True}}}
    if requests:
        entry["requests"] = list(requests)
    return entry


def as_yaml(doc: dict[str, Any]) -> bytes:
    return yaml.safe_dump(doc).encode()


REQ = "spec.devices.requests[0].exactly"
_ITEMS = "[" + ",".join(str(i) for i in range(1, 401)) + "]"
NESTED_400 = f"{_ITEMS}.all(x, {_ITEMS}.all(y, x*y >= 0))"

# (id, namespace, body, code, kind, field, substring of the rule, recorded?)
CASES: list[tuple[str, str, bytes, str, str, str | None, str, bool]] = [
    (
        "malformed-yaml",
        "tenant-a",
        b"apiVersion: [unclosed\n",
        "invalid",
        "parse",
        "line 2 column 1",
        "invalid YAML",
        False,
    ),
    (
        "not-json-object",
        "tenant-a",
        b'["a"]',
        "invalid",
        "parse",
        "<root>",
        "must be an object",
        False,
    ),
    (
        "two-documents",
        "tenant-a",
        as_yaml(manifest()) + b"---\n" + as_yaml(manifest(name="x")),
        "invalid",
        "parse",
        None,
        "exactly one ResourceClaim",
        False,
    ),
    (
        "wrong-kind",
        "tenant-a",
        INVENTORY.split("---")[1].encode(),
        "invalid",
        "parse",
        "kind",
        "must be ResourceClaim",
        False,
    ),
    (
        "quantity-does-not-parse",
        "tenant-a",
        as_yaml(manifest(memory="10 GiB")),
        "invalid",
        "parse",
        f"{REQ}.capacity.requests[memory]",
        "quantity",
        False,
    ),
    (
        "namespace-mismatch",
        "tenant-a",
        as_yaml(manifest(namespace="tenant-b")),
        "invalid",
        "namespace",
        "metadata.namespace",
        "namespace of the request subject",
        False,
    ),
    (
        "bad-name",
        "tenant-a",
        as_yaml(manifest(name="Not_A_Name")),
        "invalid",
        "name",
        "metadata.name",
        "DNS subdomain",
        False,
    ),
    (
        "too-large",
        "tenant-a",
        b"#" * (MAX_MANIFEST_BYTES + 1),
        "invalid",
        "size",
        None,
        "at most",
        False,
    ),
    (
        "api-validation",
        "tenant-a",
        as_yaml(manifest(memory="-1Gi")),
        "invalid",
        "validation",
        f"{REQ}.capacity.requests[memory]",
        "must not be negative",
        True,
    ),
    (
        "selector-does-not-compile",
        "tenant-a",
        as_yaml(manifest(selectors=("device.driver ==",))),
        "invalid",
        "validation",
        f"{REQ}.selectors[0].cel.expression",
        "compilation failed: syntax error at line 1, column 15: unexpected end of expression",
        True,
    ),
    (
        "selector-names-an-unknown-field",
        "tenant-a",
        as_yaml(manifest(selectors=('device.driver == "x"', "device.nodeName == 1"))),
        "invalid",
        "validation",
        f"{REQ}.selectors[1].cel.expression",
        "undefined field 'nodeName' of device",
        True,
    ),
    (
        "selector-above-the-cost-limit",
        "tenant-a",
        as_yaml(manifest(selectors=(NESTED_400,))),
        "invalid",
        "validation",
        f"{REQ}.selectors[0].cel.expression",
        "estimated cost 1125611 exceeds the limit of 1000000",
        True,
    ),
    (
        "unknown-class",
        "tenant-a",
        as_yaml(manifest(class_name="nope.dracap.io")),
        "rejected",
        "unknown-class",
        f"{REQ}.deviceClassName",
        "does not exist",
        True,
    ),
    (
        "class-not-allowed",
        "tenant-a",
        as_yaml(manifest(class_name="other.dracap.io", memory=None)),
        "rejected",
        "class-access",
        f"{REQ}.deviceClassName",
        "may not use DeviceClass 'other.dracap.io'",
        True,
    ),
    (
        "namespace-without-access-record",
        "tenant-z",
        as_yaml(manifest(namespace=None)),
        "rejected",
        "class-access",
        f"{REQ}.deviceClassName",
        "has no access to any DeviceClass",
        True,
    ),
    (
        "admin-access-not-allowed",
        "tenant-a",
        as_yaml(manifest(admin=True, memory=None)),
        "rejected",
        "admin-access",
        f"{REQ}.adminAccess",
        "adminAccess is not allowed",
        True,
    ),
    (
        "above-every-device-maximum",
        "tenant-a",
        as_yaml(manifest(memory="64Gi")),
        "rejected",
        "above-maximum",
        f"{REQ}.capacity.requests[memory]",
        "must be at most 60Gi",
        True,
    ),
    (
        "opaque-config-without-permission",
        "tenant-a",
        as_yaml(with_requests(manifest(), config=[opaque()])),
        "rejected",
        "opaque-config",
        "spec.devices.config[0].opaque",
        "opaque driver configuration is not allowed for DeviceClass 'gpu-memory.dracap.io' "
        "in namespace 'tenant-a'",
        True,
    ),
    (
        "opaque-config-for-a-class-the-namespace-may-not-configure",
        "tenant-q",
        as_yaml(
            with_requests(
                manifest(namespace="tenant-q"),
                CLASS,
                "other.dracap.io",
                config=[opaque("r0"), opaque("r1")],
            )
        ),
        "rejected",
        "opaque-config",
        "spec.devices.config[1].opaque",
        "not allowed for DeviceClass 'other.dracap.io' in namespace 'tenant-q'",
        True,
    ),
    (
        "opaque-config-for-every-request-names-the-class-not-allowed",
        "tenant-q",
        as_yaml(
            with_requests(
                manifest(namespace="tenant-q"), CLASS, "other.dracap.io", config=[opaque()]
            )
        ),
        "rejected",
        "opaque-config",
        "spec.devices.config[0].opaque",
        "not allowed for DeviceClass 'other.dracap.io'",
        True,
    ),
    (
        "more-requests-than-the-namespace-allows",
        "tenant-q",
        as_yaml(with_requests(manifest(namespace="tenant-q"), CLASS, CLASS, CLASS)),
        "rejected",
        "too-many-requests",
        "spec.devices.requests",
        "must have at most 2 requests in namespace 'tenant-q'",
        True,
    ),
    (
        "more-requests-than-the-api-allows",
        "tenant-a",
        as_yaml(with_requests(manifest(), *[CLASS] * 33)),
        "invalid",
        "validation",
        "spec.devices.requests",
        "must have at most 32 entries, got 33",
        True,
    ),
    (
        "namespace-at-its-quota",
        "tenant-full",
        as_yaml(manifest(namespace=None)),
        "rejected",
        "quota",
        "metadata.namespace",
        "namespace 'tenant-full' may hold at most 0 live claims (quota dracap.io/max-claims)",
        False,
    ),
    (
        "status-set-by-tenant",
        "tenant-a",
        as_yaml({**manifest(), "status": {"reservedFor": []}}),
        "invalid",
        "status",
        "status",
        "dracap writes it",
        True,
    ),
]


@pytest.mark.parametrize(
    ("namespace", "body", "code", "kind", "field", "rule", "recorded"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_refusals(
    namespace: str,
    body: bytes,
    code: str,
    kind: str,
    field: str | None,
    rule: str,
    recorded: bool,
) -> None:
    decision = decide_apply(STATE, namespace, body)
    refusal = decision.refusal
    assert refusal is not None
    assert (refusal.code, refusal.kind, refusal.field) == (code, kind, field)
    assert rule in (refusal.rule or "")
    assert (refusal.field or "") in refusal.message
    if recorded:
        submitted, rejected = decision.events
        assert isinstance(submitted, c.ClaimSubmitted)
        assert isinstance(rejected, c.ClaimRejected)
        assert submitted.claim.metadata.namespace == namespace
        assert rejected.field == field
        assert rule in rejected.rule
    else:
        assert decision.events == ()


@pytest.mark.parametrize(
    ("namespace", "doc"),
    [
        ("tenant-a", manifest()),
        ("tenant-a", manifest(namespace=None)),  # namespace taken from the subject
        ("tenant-a", manifest(memory="1Gi")),  # below min: rounded up, not an error
        ("tenant-a", manifest(memory="60Gi")),  # exactly the largest maximum
        ("tenant-a", manifest(memory=None)),  # no capacity request: the policy default
        ("ops", manifest(namespace="ops", admin=True, memory=None)),
        ("ops", manifest(namespace="ops", class_name="other.dracap.io", memory=None)),
        ("ops", with_requests(manifest(namespace="ops"), "other.dracap.io", config=[opaque()])),
        (
            "tenant-q",
            with_requests(manifest(namespace="tenant-q"), CLASS, config=[opaque("r0")]),
        ),
        (
            "tenant-q",
            with_requests(
                manifest(namespace="tenant-q"), CLASS, "other.dracap.io", config=[opaque("r0")]
            ),
        ),
        ("tenant-q", with_requests(manifest(namespace="tenant-q"), CLASS, CLASS)),
        ("tenant-a", with_requests(manifest(), *[CLASS] * 32)),
    ],
    ids=[
        "plain",
        "namespace-from-subject",
        "below-min",
        "at-max",
        "default",
        "admin",
        "star",
        "opaque-config-where-every-class-may-be-configured",
        "opaque-config-for-a-listed-class",
        "opaque-config-naming-only-the-listed-class",
        "requests-up-to-the-namespace-limit",
        "requests-up-to-the-api-limit",
    ],
)
def test_admitted(namespace: str, doc: dict[str, Any]) -> None:
    decision = decide_apply(STATE, namespace, json.dumps(doc).encode())
    assert decision.refusal is None
    submitted, admitted = decision.events
    assert isinstance(submitted, c.ClaimSubmitted)
    assert submitted.claim.metadata.namespace == namespace
    assert admitted == c.ClaimAdmitted(namespace=namespace, name=doc["metadata"]["name"])


def _with_claim(phase_events: list[c.Event]) -> ClusterState:
    state = _state()
    claim = read_claim(as_yaml(manifest()), "tenant-a")
    assert isinstance(claim, ResourceClaim)
    events: list[c.Event] = [c.ClaimSubmitted(claim=claim), *phase_events]
    for i, event in enumerate(events):
        fold([new_envelope(event, stream_version=1, actor="t", position=100 + i)], state)
    return state


def test_live_claim_name_conflicts_unless_identical() -> None:
    state = _with_claim([c.ClaimAdmitted(namespace="tenant-a", name="train")])
    same = decide_apply(state, "tenant-a", as_yaml(manifest()))
    assert same.unchanged and same.refusal is None and same.events == ()
    other = decide_apply(state, "tenant-a", as_yaml(manifest(memory="20Gi")))
    assert other.refusal is not None and other.refusal.code == "conflict"
    assert other.refusal.field == "metadata.name" and other.events == ()


def _tuned(parameters: dict[str, Any], memory: str = "10Gi", **meta: Any) -> dict[str, Any]:
    doc = manifest(namespace="tenant-q", memory=memory)
    doc["metadata"].update(meta)
    entry = {"opaque": {"driver": "gpu.dracap.io", "parameters": parameters}}
    doc["spec"]["devices"]["config"] = [entry]
    return doc


PARAMETERS = {"mps": {"threads": 40, "limits": [1, 2]}, "mode": "shared"}

# (id, the manifest applied again; whether it is the recorded spec)
REAPPLIES: list[tuple[str, dict[str, Any], bool]] = [
    ("the-same-manifest", _tuned(PARAMETERS), True),
    ("other-labels-and-annotations", _tuned(PARAMETERS, labels={"a": "b"}), True),
    ("the-config-keys-in-another-order", _tuned({"mode": "shared", **PARAMETERS}), True),
    ("the-same-amount-written-otherwise", _tuned(PARAMETERS, memory="10240Mi"), True),
    ("another-config-value", _tuned({**PARAMETERS, "mode": "exclusive"}), False),
    ("a-config-list-in-another-order", _tuned({**PARAMETERS, "mps": {"limits": [2, 1]}}), False),
    ("another-amount", _tuned(PARAMETERS, memory="20Gi"), False),
]


@pytest.mark.parametrize(
    ("body", "same"), [r[1:] for r in REAPPLIES], ids=[r[0] for r in REAPPLIES]
)
def test_a_live_claim_applied_again_with_configuration(body: dict[str, Any], same: bool) -> None:
    """The fold keeps a digest of the configuration, not the configuration: re-applying
    the recorded spec is still a no-op, and a changed one still a conflict."""
    state = _state()
    claim = read_claim(as_yaml(_tuned(PARAMETERS)), "tenant-q")
    assert isinstance(claim, ResourceClaim)
    events: list[c.Event] = [
        c.ClaimSubmitted(claim=claim),
        c.ClaimAdmitted(namespace="tenant-q", name="train"),
    ]
    for i, event in enumerate(events):
        fold([new_envelope(event, stream_version=1, actor="t", position=100 + i)], state)
    decision = decide_apply(state, "tenant-q", as_yaml(body))
    if same:
        assert decision.unchanged and decision.refusal is None and decision.events == ()
    else:
        assert decision.refusal is not None and decision.refusal.code == "conflict"


@pytest.mark.parametrize("terminal", ["rejected", "withdrawn"])
def test_terminal_claim_name_can_be_reused(terminal: str) -> None:
    ending: c.Event = (
        c.ClaimRejected(namespace="tenant-a", name="train", field="f", rule="r", reason="x")
        if terminal == "rejected"
        else c.ClaimWithdrawn(namespace="tenant-a", name="train")
    )
    state = _with_claim([ending])
    decision = decide_apply(state, "tenant-a", as_yaml(manifest(memory="20Gi")))
    assert decision.refusal is None
    assert isinstance(decision.events[1], c.ClaimAdmitted)


def test_first_available_rejected_only_when_every_alternative_is_above_maximum() -> None:
    doc = manifest()
    alternatives = [
        {"name": "big", "deviceClassName": CLASS, "capacity": {"requests": {"memory": "70Gi"}}},
        {"name": "small", "deviceClassName": CLASS, "capacity": {"requests": {"memory": "5Gi"}}},
    ]
    doc["spec"]["devices"]["requests"] = [{"name": "gpu", "firstAvailable": alternatives}]
    assert decide_apply(STATE, "tenant-a", as_yaml(doc)).refusal is None
    alternatives[1]["capacity"] = {"requests": {"memory": "65Gi"}}
    refusal = decide_apply(STATE, "tenant-a", as_yaml(doc)).refusal
    assert refusal is not None and refusal.kind == "above-maximum"
    assert refusal.field == "spec.devices.requests[0].firstAvailable[0].capacity.requests[memory]"


def test_device_limits_follow_the_class_selector() -> None:
    limits = DeviceLimits(build_inventory(STATE))
    largest = limits.largest(CLASS, "memory")
    assert largest is not None
    assert str(largest[0]) == "60Gi" and largest[1] == "gpu.dracap.io/node-a/gpu-1"
    assert limits.largest(CLASS, "bandwidth") is None


def test_admit_returns_the_event() -> None:
    claim = read_claim(as_yaml(manifest(memory="64Gi")), "tenant-a")
    assert isinstance(claim, ResourceClaim)
    verdict = admit(STATE, "tenant-a", claim)
    assert isinstance(verdict, c.ClaimRejected)
    assert "60Gi" in verdict.reason and verdict.field.endswith("requests[memory]")


@pytest.mark.parametrize(
    ("memory", "detail"),
    [("64Gi", "requested 64Gi; 60Gi on gpu.dracap.io/node-a/gpu-1"), ("-1Gi", None)],
)
def test_a_rejected_claim_names_its_field_and_rule_once(memory: str, detail: str | None) -> None:
    state = _state()
    decision = decide_apply(state, "tenant-a", as_yaml(manifest(memory=memory)))
    assert decision.refusal is not None
    events = list(decision.events)
    for i, event in enumerate(events):
        fold([new_envelope(event, stream_version=i + 1, actor="t", position=100 + i)], state)
    claim = state.claim("tenant-a", "train")
    assert claim is not None and claim.phase == "rejected" and claim.reason is not None
    field, rule = decision.refusal.field, decision.refusal.rule
    assert field is not None and rule is not None
    expected = f"{field}: {rule}" + (f": {detail}" if detail else "")
    assert claim.reason == expected
    assert claim.reason.count(field) == 1


@pytest.mark.parametrize(
    ("namespace", "body", "field", "rule"),
    [pytest.param(case[1], case[2], case[5], case[6], id=case[0]) for case in CASES],
)
def test_a_refusal_message_says_field_and_rule_once(
    namespace: str, body: bytes, field: str | None, rule: str
) -> None:
    refusal = decide_apply(STATE, namespace, body).refusal
    assert refusal is not None and refusal.rule is not None
    assert refusal.message.count(refusal.rule) == 1
    if field is not None:
        assert refusal.message.startswith(f"{field}: ")


# --- the quota (dracap.io/max-claims) ---------------------------------------------------------


def _fold_into(state: ClusterState, *events: c.Event) -> None:
    for event in events:
        envelope = new_envelope(event, stream_version=1, actor="t", position=state.position + 1)
        fold([envelope], state)


def _apply(state: ClusterState, name: str, **kw: Any) -> Any:
    body = as_yaml(manifest(name=name, namespace="tenant-q", **kw))
    decision = decide_apply(state, "tenant-q", body)
    _fold_into(state, *decision.events)
    return decision


def test_the_quota_counts_live_claims_only() -> None:
    state = _state()
    assert _apply(state, "first").refusal is None  # tenant-q may hold one live claim
    second = _apply(state, "second")
    assert second.refusal is not None and second.refusal.kind == "quota"
    assert second.refusal.message == (
        "metadata.namespace: namespace 'tenant-q' may hold at most 1 live claims "
        "(quota dracap.io/max-claims) (it holds 1; delete one first)"
    )
    assert second.events == ()  # nothing recorded: a tenant at its quota cannot grow the log
    assert _apply(state, "first").unchanged  # re-applying the live claim is still a no-op
    _fold_into(state, c.ClaimWithdrawn(namespace="tenant-q", name="first"))
    assert state.live_claim_count("tenant-q") == 0
    assert _apply(state, "second").refusal is None


def test_rejected_claims_do_not_count() -> None:
    state = _state()
    rejected = _apply(state, "too-big", memory="500Gi")
    assert rejected.refusal is not None and rejected.refusal.kind == "above-maximum"
    assert state.live_claim_count("tenant-q") == 0
    assert _apply(state, "fits").refusal is None


def test_claims_being_admitted_count_until_the_state_shows_them() -> None:
    state = _state()
    body = as_yaml(manifest(name="second", namespace="tenant-q"))
    in_flight = decide_apply(state, "tenant-q", body, admitting={"first"})
    assert in_flight.refusal is not None and in_flight.refusal.kind == "quota"
    assert decide_apply(state, "tenant-q", body, admitting={"second"}).refusal is None
    _apply(state, "first")  # folded now: counted once, not twice
    again = decide_apply(state, "tenant-q", body, admitting={"first"})
    assert again.refusal is not None and "it holds 1" in again.refusal.message


def test_opaque_config_names_the_subrequest_it_configures() -> None:
    doc = manifest(namespace="tenant-q")
    alternatives = [
        {"name": "big", "deviceClassName": CLASS},
        {"name": "other", "deviceClassName": "other.dracap.io"},
    ]
    doc["spec"]["devices"] = {
        "requests": [{"name": "gpu", "firstAvailable": alternatives}],
        "config": [opaque("gpu/big")],
    }
    assert decide_apply(STATE, "tenant-q", as_yaml(doc)).refusal is None
    doc["spec"]["devices"]["config"] = [opaque("gpu")]  # the parent: every alternative
    refusal = decide_apply(STATE, "tenant-q", as_yaml(doc)).refusal
    assert refusal is not None and refusal.kind == "opaque-config"
    assert "'other.dracap.io'" in refusal.rule and "request gpu" in refusal.detail


# --- class modes (ClassModeSet) and removal ----------------------------------------------


def _after(*events: c.Event) -> ClusterState:
    state = _state()
    for i, event in enumerate(events):
        fold([new_envelope(event, stream_version=1, actor="t", position=200 + i)], state)
    return state


WHOLE = c.ClassModeSet(name=CLASS, mode="whole-device")
DISABLED = c.ClassModeSet(name=CLASS, mode="disabled")
CONSUMABLE = c.ClassModeSet(name=CLASS, mode="consumable")
REMOVED = c.DeviceClassRemoved(name=CLASS)
REAPPLIED = c.DeviceClassApplied(
    device_class=STATE.classes[CLASS].device_class, rollout="immediate"
)

# (id, events after the inventory, memory asked, kind refused or None, field, rule)
MODE_CASES: list[tuple[str, list[c.Event], str | None, str | None, str | None, str]] = [
    ("consumable-by-default-takes-a-share", [], "10Gi", None, None, ""),
    ("whole-device-takes-a-claim-without-capacity-requests", [WHOLE], None, None, None, ""),
    (
        "whole-device-refuses-a-capacity-request-as-with-the-gate-off",
        [WHOLE],
        "10Gi",
        "whole-device",
        f"{REQ}.capacity.requests",
        "need the DRAConsumableCapacity feature gate, which is off for this class",
    ),
    ("switched-back-to-consumable-takes-a-share", [WHOLE, CONSUMABLE], "10Gi", None, None, ""),
    (
        "disabled-refuses-every-new-claim",
        [DISABLED],
        None,
        "class-disabled",
        f"{REQ}.deviceClassName",
        "is disabled: it takes no new claims",
    ),
    (
        "a-removed-class-refuses-new-claims",
        [REMOVED],
        "10Gi",
        "unknown-class",
        f"{REQ}.deviceClassName",
        "does not exist",
    ),
    (
        "a-class-re-applied-after-removal-is-consumable",
        [DISABLED, REMOVED, REAPPLIED],
        "10Gi",
        None,
        None,
        "",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("events", "memory", "kind", "field", "rule"),
    [case[1:] for case in MODE_CASES],
    ids=[case[0] for case in MODE_CASES],
)
def test_class_modes(
    events: list[c.Event], memory: str | None, kind: str | None, field: str | None, rule: str
) -> None:
    decision = decide_apply(_after(*events), "tenant-a", as_yaml(manifest(memory=memory)))
    if kind is None:
        assert decision.refusal is None
        assert isinstance(decision.events[-1], c.ClaimAdmitted)
        return
    refusal = decision.refusal
    assert refusal is not None
    assert (refusal.code, refusal.kind, refusal.field) == ("rejected", kind, field)
    assert rule in (refusal.rule or "")
    assert (refusal.field or "") in refusal.message
    submitted, rejected = decision.events  # recorded, so the tenant can read why
    assert isinstance(submitted, c.ClaimSubmitted)
    assert isinstance(rejected, c.ClaimRejected) and rejected.field == field


def test_a_mode_applies_to_every_first_available_alternative() -> None:
    doc = manifest(memory=None)
    exactly = doc["spec"]["devices"]["requests"][0].pop("exactly")
    doc["spec"]["devices"]["requests"][0]["firstAvailable"] = [{"name": "a", **exactly}]
    refusal = decide_apply(_after(DISABLED), "tenant-a", as_yaml(doc)).refusal
    assert refusal is not None and refusal.kind == "class-disabled"
    assert refusal.field == "spec.devices.requests[0].firstAvailable[0].deviceClassName"


def test_the_rules_that_read_the_fold_are_rejection_reasons() -> None:
    """A refusal by one of them is decided again on the whole log (apiwrites._recheck);
    the rest read only the request."""
    from services.claims.admission import FOLD_RULES, REJECTION_REASONS

    assert set(REJECTION_REASONS) > FOLD_RULES
    assert set(REJECTION_REASONS) - FOLD_RULES == {
        "name", "namespace", "parse", "size", "status", "validation",
    }  # fmt: skip
