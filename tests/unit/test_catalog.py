"""The event catalog: round trips, strict and tolerant decoding, upcasting, streams."""

from __future__ import annotations

import datetime
import json
import uuid

import pytest

from events import catalog as c
from events.envelopes import (
    claim_stream,
    class_stream,
    device_stream,
    new_envelope,
    node_stream,
    slice_stream,
    stream_of,
)
from events.errors import CatalogError
from events.eventcodec import (
    UPCASTERS,
    decode_command_envelope,
    decode_envelope,
    decode_event,
    decode_stored,
    encode_event,
    encode_payload,
)
from events.model import (
    AllocationResult,
    CapacityRequestPolicy,
    CapacityRequestPolicyRange,
    CapacityRequirements,
    Device,
    DeviceAllocationResult,
    DeviceCapacity,
    DeviceClaim,
    DeviceClass,
    DeviceClassSpec,
    DeviceRequest,
    DeviceRequestAllocationResult,
    ExactDeviceRequest,
    ObjectMeta,
    ResourceClaim,
    ResourceClaimSpec,
    ResourcePool,
    ResourceSlice,
    ResourceSliceSpec,
)
from events.quantities import Quantity

Q = Quantity.parse
T0 = datetime.datetime(2025, 6, 1, 12, 0, tzinfo=datetime.UTC)


def _policy() -> CapacityRequestPolicy:
    return CapacityRequestPolicy(
        default=Q("1Gi"),
        valid_range=CapacityRequestPolicyRange(min=Q("1Gi"), max=Q("40Gi"), step=Q("1Gi")),
    )


def _slice() -> ResourceSlice:
    return ResourceSlice(
        metadata=ObjectMeta(name="node-a-gpus"),
        spec=ResourceSliceSpec(
            driver="gpu.example.com",
            pool=ResourcePool(name="node-a", generation=1, resource_slice_count=1),
            node_name="node-a",
            devices=[
                Device(
                    name="gpu-0",
                    allow_multiple_allocations=True,
                    capacity={"memory": DeviceCapacity(value=Q("80Gi"), request_policy=_policy())},
                )
            ],
        ),
    )


def _claim() -> ResourceClaim:
    return ResourceClaim(
        metadata=ObjectMeta(name="train", namespace="team-a"),
        spec=ResourceClaimSpec(
            devices=DeviceClaim(
                requests=[
                    DeviceRequest(
                        name="gpu",
                        exactly=ExactDeviceRequest(
                            device_class_name="gpu.example.com",
                            capacity=CapacityRequirements(requests={"memory": Q("4Gi")}),
                        ),
                    )
                ]
            )
        ),
    )


def _allocation() -> AllocationResult:
    return AllocationResult(
        devices=DeviceAllocationResult(
            results=[
                DeviceRequestAllocationResult(
                    request="gpu",
                    driver="gpu.example.com",
                    pool="node-a",
                    device="gpu-0",
                    share_id="s-1",
                    consumed_capacity={"memory": Q("4Gi")},
                )
            ]
        )
    )


def _reserved(**overrides: object) -> c.CapacityReserved:
    fields: dict[str, object] = {
        "namespace": "team-a",
        "name": "train",
        "allocation_version": 1,
        "request": "gpu",
        "driver": "gpu.example.com",
        "pool": "node-a",
        "device": "gpu-0",
        "node": "node-a",
        "share_id": "s-1",
        "shared": True,
        "admin_access": False,
        "consumed": {"memory": Q("4Gi")},
        "policy_version": 1,
    }
    fields.update(overrides)
    return c.CapacityReserved(**fields)  # type: ignore[arg-type]


def every_event() -> list[c.Event]:
    """One instance of every event type of the catalog."""
    dc = DeviceClass(metadata=ObjectMeta(name="gpu.example.com"), spec=DeviceClassSpec())
    return [
        c.DeviceClassApplied(device_class=dc, rollout="new-claims-only"),
        c.DeviceClassRemoved(name="gpu.example.com"),
        c.ClassModeSet(name="gpu.example.com", mode="whole-device"),
        c.ResourceSlicePublished(slice=_slice()),
        c.ResourceSliceWithdrawn(name="node-a-gpus"),
        c.RequestPolicyChanged(
            driver="gpu.example.com",
            pool="node-a",
            device="gpu-0",
            capacity="memory",
            policy=_policy(),
            policy_version=2,
        ),
        c.ClaimSubmitted(claim=_claim()),
        c.ClaimAdmitted(namespace="team-a", name="train"),
        c.ClaimRejected(
            namespace="team-a", name="train", field="spec", rule="class", reason="denied"
        ),
        _reserved(),
        c.ClaimUnschedulable(namespace="team-a", name="train", reason="no capacity"),
        c.AllocationBound(
            namespace="team-a",
            name="train",
            allocation_version=1,
            node="node-a",
            allocation=_allocation(),
            share_ids=["s-1"],
        ),
        c.LimitApplied(share_id="s-1", node="node-a", level="hard", actual={"memory": Q("4Gi")}),
        c.LimitFailed(share_id="s-1", node="node-a", retryable=True, reason="mps busy"),
        c.LimitRemoved(share_id="s-1", node="node-a"),
        c.EnforcementReconciled(
            node="node-a", reapplied=["s-1"], removed_orphans=["s-9"], kept=["s-2"], failed=[]
        ),
        c.EnforcementCheckpointSetAside(
            node="node-a",
            path="/var/lib/dracap/agent/checkpoint.json",
            reason="checksum-mismatch",
            detail="the checksum does not match the body",
            moved_to="/var/lib/dracap/agent/checkpoint.json.corrupt-20250101T000000.000000Z",
        ),
        c.ReleaseRequested(namespace="team-a", name="train", allocation_version=1),
        c.CapacityReleased(
            share_id="s-1",
            driver="gpu.example.com",
            pool="node-a",
            device="gpu-0",
            allocation_version=1,
            consumed={"memory": Q("4Gi")},
            admin_access=False,
        ),
        c.NodeLeaseAcquired(node="node-a", epoch=3, boot_id="b-1", ttl_ms=10_000),
        c.NodeLeaseExpired(node="node-a", epoch=3),
        c.ShareMarkedUnknown(share_id="s-1", node="node-a"),
        c.NodeFenced(node="node-a", epoch=3),
        c.ShareConfirmed(share_id="s-1", node="node-a"),
        c.AppendRefused(
            node="node-a", epoch=2, current_epoch=3, types=["enforcement.limit_applied"]
        ),
        c.DeviceHealthChanged(
            node="node-a", driver="d", pool="p", device="x", healthy=False, reason="gone"
        ),
        c.ShareUsed(share_id="s-1", node="node-a", evidence="10 bytes"),
        c.ClaimStalled(namespace="ns", name="c", allocation_version=1, reason="unused"),
        c.ClaimReserved(namespace="ns", name="c", consumer="pod/ns/p"),
        c.ClaimUnreserved(namespace="ns", name="c", consumer="pod/ns/p"),
        c.NamespaceAccessSet(namespace="team-a", classes=["gpu.example.com"], admin_access=True),
        c.ClaimWithdrawn(namespace="team-a", name="train"),
        c.MessageDeadLettered(
            consumer="reservation", event_id="e-1", position=7, deliveries=5, reason="boom"
        ),
    ]


EVENTS = every_event()
IDS = [c.tag_of(e) for e in EVENTS]


def test_every_tag_is_covered() -> None:
    assert sorted(IDS) == sorted(c.EVENT_TYPES)
    assert len(set(IDS)) == len(IDS) == 33


@pytest.mark.parametrize("event", EVENTS, ids=IDS)
def test_payload_round_trip(event: c.Event) -> None:
    payload = encode_payload(event)
    assert json.loads(payload)["type"] == c.tag_of(event)
    assert decode_event(payload) == event
    stored = decode_stored(payload, c.tag_of(event), c.schema_version_of(event))
    assert stored == event
    assert decode_stored(payload.decode(), c.tag_of(event), c.schema_version_of(event)) == event


@pytest.mark.parametrize("event", EVENTS, ids=IDS)
def test_envelope_round_trip(event: c.Event) -> None:
    env = new_envelope(event, stream_version=1, actor="test", recorded_at=T0, position=7)
    data = encode_event(env)
    assert decode_envelope(data) == env
    assert decode_command_envelope(data) == env
    assert env.schema_version == c.SCHEMA_VERSIONS[c.tag_of(event)]
    assert env.stream == stream_of(event)


def test_quantities_are_canonical_on_the_wire() -> None:
    payload = json.loads(encode_payload(_reserved(consumed={"memory": Q("4096Mi")})))
    assert payload["consumed"] == {"memory": "4Gi"}
    decoded = decode_event(json.dumps(payload))
    assert isinstance(decoded, c.CapacityReserved)
    assert isinstance(decoded.consumed["memory"], Quantity)


def test_unknown_tag_is_rejected_everywhere() -> None:
    with pytest.raises(CatalogError, match=r"claims\.exploded"):
        decode_event(b'{"type": "claims.exploded"}')
    with pytest.raises(CatalogError, match=r"claims\.exploded"):
        decode_stored(b"{}", "claims.exploded", 1)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda p: p.update(allocation_version="1"), "allocation_version"),
        (lambda p: p.pop("share_id"), "share_id"),
        (lambda p: p.update(consumed={"memory": "lots"}), "consumed"),
        (lambda p: p.update(shared=None), "shared"),
    ],
)
def test_bad_payload_names_tag_and_field(mutate: object, field: str) -> None:
    payload = json.loads(encode_payload(_reserved()))
    mutate(payload)  # type: ignore[operator]
    data = json.dumps(payload)
    for decode in (decode_event, lambda d: decode_stored(d, payload["type"], 2)):
        with pytest.raises(CatalogError) as err:
            decode(data)
        assert "reservation.capacity_reserved" in str(err.value)
        assert field in str(err.value)


def test_strict_rejects_unknown_fields_tolerant_ignores_them() -> None:
    payload = json.loads(encode_payload(_reserved()))
    payload["added_later"] = True
    data = json.dumps(payload)
    with pytest.raises(CatalogError, match="added_later"):
        decode_event(data)
    assert decode_stored(data, "reservation.capacity_reserved", 2) == _reserved()


def test_not_json_and_not_an_object() -> None:
    with pytest.raises(CatalogError):
        decode_event(b"{nope")
    with pytest.raises(CatalogError):
        decode_event(b"[1, 2]")
    with pytest.raises(CatalogError):
        decode_stored(b"{nope", "claims.admitted", 1)


def test_stored_tag_must_agree_with_column() -> None:
    payload = encode_payload(c.ClaimAdmitted(namespace="a", name="b"))
    with pytest.raises(CatalogError):
        decode_stored(payload, "claims.rejected", 1)


def _v1_payload(share_id: str | None) -> dict[str, object]:
    payload: dict[str, object] = json.loads(encode_payload(_reserved()))
    del payload["shared"], payload["policy_version"]
    payload["share_id"] = share_id
    return payload


def test_upcast_v1_capacity_reserved_shared() -> None:
    event = decode_stored(json.dumps(_v1_payload("s-1")), "reservation.capacity_reserved", 1)
    assert event == _reserved(policy_version=c.POLICY_VERSION_UNRECORDED)


def test_upcast_v1_capacity_reserved_dedicated_gets_deterministic_share_id() -> None:
    data = json.dumps(_v1_payload(None))
    first = decode_stored(data, "reservation.capacity_reserved", 1)
    again = decode_stored(data, "reservation.capacity_reserved", 1)
    assert isinstance(first, c.CapacityReserved)
    assert first == again
    assert first.shared is False
    assert uuid.UUID(first.share_id).version == 5
    assert first.policy_version == c.POLICY_VERSION_UNRECORDED


def test_upcast_applies_to_envelopes_from_the_bus() -> None:
    env = new_envelope(_reserved(), stream_version=3, actor="t", recorded_at=T0)
    raw = json.loads(encode_event(env))
    raw["schema_version"] = 1
    raw["event"] = _v1_payload("s-1")
    decoded = decode_envelope(json.dumps(raw))
    assert decoded.schema_version == 2
    assert decoded.event == _reserved(policy_version=c.POLICY_VERSION_UNRECORDED)
    with pytest.raises(CatalogError, match=r"shared|schema_version"):
        decode_command_envelope(json.dumps(raw))


def test_v1_payload_is_not_valid_as_current() -> None:
    with pytest.raises(CatalogError, match=r"shared|policy_version"):
        decode_stored(json.dumps(_v1_payload("s-1")), "reservation.capacity_reserved", 2)


def test_future_and_invalid_schema_versions_are_errors() -> None:
    payload = encode_payload(_reserved())
    with pytest.raises(CatalogError, match="newer"):
        decode_stored(payload, "reservation.capacity_reserved", 3)
    with pytest.raises(CatalogError, match="invalid schema version"):
        decode_stored(payload, "reservation.capacity_reserved", 0)


def test_schema_versions() -> None:
    assert c.SCHEMA_VERSIONS["reservation.capacity_reserved"] == 2
    assert c.CapacityReserved.SCHEMA_VERSION == 2
    assert all(v >= 1 for v in c.SCHEMA_VERSIONS.values())
    for tag, version in c.SCHEMA_VERSIONS.items():
        for older in range(1, version):
            assert (tag, older) in UPCASTERS


def test_events_are_frozen() -> None:
    event = c.ClaimAdmitted(namespace="a", name="b")
    with pytest.raises(AttributeError):
        event.name = "c"  # type: ignore[misc]


def test_stream_names() -> None:
    assert claim_stream("team-a", "train") == "claim:team-a/train"
    assert device_stream("gpu.example.com", "node-a", "gpu-0") == (
        "device:gpu.example.com/node-a/gpu-0"
    )
    assert class_stream("gpu") == "class:gpu"
    assert slice_stream("s") == "slice:s"
    assert node_stream("n") == "node:n"
    assert stream_of(_reserved()) == "device:gpu.example.com/node-a/gpu-0"
    assert stream_of(c.ClaimSubmitted(claim=_claim())) == "claim:team-a/train"
    assert stream_of(c.NodeFenced(node="n", epoch=1)) == "lease:n"
    assert stream_of(c.ShareConfirmed(share_id="s", node="n")) == "node:n"


def test_new_envelope_defaults() -> None:
    env = new_envelope(_reserved(), stream_version=1, actor="reservation")
    assert env.namespace == "team-a"
    assert env.position == 0
    assert env.correlation_id == env.event_id
    assert env.recorded_at.tzinfo is not None
