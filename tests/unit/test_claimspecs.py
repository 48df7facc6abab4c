"""What the fold keeps of a claim (``events/claimspecs.py``): what decisions read, no more.

The record of a claim in the fold must not grow with what no decision reads — opaque
configuration, labels, annotations — neither from its manifest nor from its allocation
(which copies the configuration); the DeviceClass of each request must stay reachable
(the agent's retry window, not-started timeouts, SLO labels, replay scopes).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from events import catalog as c
from events import model
from events.claimspecs import ClaimSpec, claim_spec
from events.fold import apply_event
from events.quantities import Quantity
from events.state import ClaimState, ClusterState
from events.statecodec import snapshot_decode, snapshot_encode
from tests.unit.oldlog import CONFIG, events

KEY = ("team-a", "tuned")


def fold_to(events_: list[c.Event]) -> ClusterState:
    state = ClusterState()
    for position, event in enumerate(events_, start=1):
        apply_event(state, event, position)
    return state


def record_bytes(claim: ClaimState) -> int:
    """The size of the fold's record of ``claim`` as stored (a snapshot's JSON)."""
    return len(msgspec.json.encode(claim, enc_hook=model.encode_hook))


def _without_config(event: c.Event) -> c.Event:
    """``event`` as if the claim had no configuration and no metadata beyond its name."""
    if isinstance(event, c.ClaimSubmitted) and event.claim.metadata.name == "tuned":
        devices = event.claim.spec.devices
        assert devices is not None
        bare = msgspec.structs.replace(devices, config=None)
        meta = model.ObjectMeta(name="tuned", namespace="team-a")
        claim = msgspec.structs.replace(
            event.claim, metadata=meta, spec=model.ResourceClaimSpec(devices=bare)
        )
        return msgspec.structs.replace(event, claim=claim)
    if isinstance(event, c.AllocationBound) and event.name == "tuned":
        assert event.allocation.devices is not None
        devices = msgspec.structs.replace(event.allocation.devices, config=None)
        allocation = msgspec.structs.replace(event.allocation, devices=devices)
        return msgspec.structs.replace(event, allocation=allocation)
    return event


def test_a_claims_record_does_not_grow_with_configuration_or_metadata() -> None:
    configured = fold_to(events()).claims[KEY]
    plain = fold_to([_without_config(e) for e in events()]).claims[KEY]
    manifest_bytes = len(msgspec.json.encode(CONFIG))
    assert manifest_bytes > 2048  # what the whole manifest and allocation would add twice
    # the configuration's count and digest, the allocation's count: nothing else
    assert record_bytes(configured) - record_bytes(plain) < 160
    assert configured.spec is not None and plain.spec is not None
    assert configured.spec.requests == plain.spec.requests
    assert (configured.spec.configs, configured.allocation_configs) == (2, 2)
    assert (plain.spec.configs, plain.allocation_configs) == (0, 0)


def test_the_allocation_is_kept_whole_but_for_its_configuration() -> None:
    state = fold_to(events())
    [bound] = [e for e in events() if isinstance(e, c.AllocationBound) and e.name == "tuned"]
    kept = state.claims[KEY].allocation
    assert kept is not None and kept.devices is not None and bound.allocation.devices
    assert kept.devices.results == bound.allocation.devices.results
    assert kept.node_selector == bound.allocation.node_selector
    assert kept.devices.config is None


def _spec(requests: list[dict[str, Any]]) -> ClaimSpec:
    doc = {"metadata": {"name": "c"}, "spec": {"devices": {"requests": requests}}}
    return claim_spec(model.convert(doc, model.ResourceClaim))


EXACT = {"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}
ALTERNATIVES = {
    "name": "nic",
    "firstAvailable": [
        {"name": "fast", "deviceClassName": "nic-fast.example.com"},
        {"name": "slow", "deviceClassName": "nic-slow.example.com"},
    ],
}

# (id, result request, the class it names)
CLASS_OF: list[tuple[str, str, str | None]] = [
    ("an-exact-request", "gpu", "gpu.example.com"),
    ("an-alternative", "nic/slow", "nic-slow.example.com"),
    ("an-exact-request-named-with-a-sub", "gpu/x", "gpu.example.com"),
    ("an-unknown-alternative", "nic/other", None),
    ("an-unknown-request", "disk", None),
]


@pytest.mark.parametrize(
    ("request_", "expected"), [r[1:] for r in CLASS_OF], ids=[r[0] for r in CLASS_OF]
)
def test_the_class_of_a_request(request_: str, expected: str | None) -> None:
    spec = _spec([EXACT, ALTERNATIVES])
    assert spec.class_of(request_) == expected
    claim = ClaimState(namespace="n", name="c", phase="allocated", spec=spec)
    assert claim.class_of(request_) == expected
    assert ClaimState(namespace="n", name="c", phase="admitted").class_of(request_) is None


def test_the_classes_of_a_claim_in_request_order() -> None:
    assert _spec([ALTERNATIVES, EXACT]).classes() == [
        "nic-fast.example.com",
        "nic-slow.example.com",
        "gpu.example.com",
    ]
    assert _spec([]).classes() == []


def test_a_mirrored_claims_results_are_kept() -> None:
    state = fold_to(events())
    spec = state.claims[("team-a", "mirrored")].spec
    assert spec is not None and [r.device for r in spec.results] == ["gpu-0"]
    assert spec.results[0].consumed_capacity == {"memory": Quantity.parse("75Gi")}


def test_the_compact_claim_round_trips_through_a_snapshot() -> None:
    state = fold_to(events())
    assert snapshot_decode(snapshot_encode(state)) == state
