"""A planning round's rules, one named table row each (services.reservation.rounds).

Every row tells what the log holds (an inventory, claims reserved before, claims
admitted or found unschedulable), what the service remembers (the capacity epoch,
earlier tries, selectors being evaluated), and what one round decides: the events
per stream, and what the service is told to remember.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest

from events import catalog as c
from events import model
from events.envelopes import claim_stream
from events.model import ResourceClaim
from services.reservation.outcomes import Allocated
from services.reservation.rounds import Backlog, Round, decide_round
from tests.unit.allocator_fixtures import claim, device_class, request, slice_
from tests.unit.decision_fixtures import (
    NAMESPACE,
    Log,
    admitted,
    allocator_of,
    describe,
    gpu,
    inventory,
    memory_claim,
    pending,
    share_ids,
)

HEAVY = "[" + ",".join(str(i) for i in range(1, 21)) + "].all(x, x > 0)"
NO_FIT = "no device has room"  # the reason recorded before a row's round


def too_little(needs: str, free: str) -> str:
    return (
        f"request gpu: 1 devices of class gpu.test.io match; 1 have too little free "
        f"(needs {needs} of memory, largest free is {free}) on node node-a"
    )


@dataclass
class Case:
    id: str
    claims: list[ResourceClaim]  # admitted, in this order
    expect: list[str]  # "stream-name: event" per event, in append order
    devices: list[dict[str, object]] = field(default_factory=lambda: [gpu()])
    before: list[ResourceClaim] = field(default_factory=list)  # reserved earlier
    unschedulable: list[str] = field(default_factory=list)  # found so before
    order: list[str] | None = None  # the backlog's order (default: every pending claim)
    epoch: int = 0
    tried: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, str] = field(default_factory=dict)
    evaluating: set[str] = field(default_factory=set)
    budget: int | None = None
    allocated: list[str] = field(default_factory=list)
    tried_now: list[str] = field(default_factory=list)
    deferred: dict[str, str] = field(default_factory=dict)


CASES = [
    Case(
        "an-admitted-claim-that-fits-is-reserved",
        [memory_claim("c1", "10Gi")],
        [
            "device gpu-0: CapacityReserved c1 v1 gpu-0 memory=10Gi shared share-1",
            "claim c1: AllocationBound c1 v1 node-a share-1",
        ],
        allocated=["c1"],
    ),
    Case(
        "claims-are-served-in-admission-order",
        [memory_claim("c1", "30Gi"), memory_claim("c2", "30Gi")],
        [
            "device gpu-0: CapacityReserved c1 v1 gpu-0 memory=30Gi shared share-1",
            "claim c1: AllocationBound c1 v1 node-a share-1",
            f"claim c2: ClaimUnschedulable c2: {too_little('30Gi', '10Gi')}",
        ],
        allocated=["c1"],
        tried_now=["c2"],
    ),
    Case(
        "a-claim-sees-the-reservations-decided-before-it-in-the-round",
        [memory_claim("c1", "20Gi"), memory_claim("c2", "20Gi"), memory_claim("c3", "5Gi")],
        [
            "device gpu-0: CapacityReserved c1 v1 gpu-0 memory=20Gi shared share-1",
            "device gpu-0: CapacityReserved c2 v1 gpu-0 memory=20Gi shared share-2",
            "claim c1: AllocationBound c1 v1 node-a share-1",
            "claim c2: AllocationBound c2 v1 node-a share-2",
            f"claim c3: ClaimUnschedulable c3: {too_little('5Gi', '0')}",
        ],
        allocated=["c1", "c2"],
        tried_now=["c3"],
    ),
    Case(
        "a-claim-that-waits-does-not-block-a-smaller-one-behind-it",
        [memory_claim("c1", "20Gi"), memory_claim("c2", "10Gi")],
        [
            "device gpu-0: CapacityReserved c2 v1 gpu-0 memory=10Gi shared share-1",
            f"claim c1: ClaimUnschedulable c1: {too_little('20Gi', '10Gi')}",
            "claim c2: AllocationBound c2 v1 node-a share-1",
        ],
        before=[memory_claim("c0", "30Gi")],
        allocated=["c2"],
        tried_now=["c1"],
    ),
    Case(
        "an-unschedulable-claim-is-not-tried-again-before-capacity-is-freed",
        [memory_claim("c1", "20Gi")],
        [],
        unschedulable=["c1"],
        tried={"c1": 0},
    ),
    Case(
        "an-unschedulable-claim-is-tried-again-once-capacity-was-freed",
        [memory_claim("c1", "20Gi")],
        [
            "device gpu-0: CapacityReserved c1 v1 gpu-0 memory=20Gi shared share-1",
            "claim c1: AllocationBound c1 v1 node-a share-1",
        ],
        unschedulable=["c1"],
        epoch=1,
        tried={"c1": 0},
        allocated=["c1"],
    ),
    Case(
        "a-retry-that-still-does-not-fit-writes-nothing",
        [memory_claim("c1", "20Gi")],
        [],
        before=[memory_claim("c0", "30Gi")],
        unschedulable=["c1"],
        epoch=1,
        tried={"c1": 0},
        tried_now=["c1"],
    ),
    Case(
        "a-claim-that-cannot-be-allocated-as-written-says-so",
        [claim(request("gpu", {"memory": "5Gi"}, cls="missing"), name="c1", namespace=NAMESPACE)],
        [
            "claim c1: ClaimUnschedulable c1: cannot be allocated as written: "
            "request gpu: device class missing does not exist"
        ],
        tried_now=["c1"],
    ),
    Case(
        "a-dedicated-device-gets-a-share-id-of-its-own",
        [claim(request("gpu"), name="c1", namespace=NAMESPACE)],
        [
            "device gpu-0: CapacityReserved c1 v1 gpu-0 dedicated new-1",
            "claim c1: AllocationBound c1 v1 node-a new-1",
        ],
        devices=[gpu(shared=False)],
        allocated=["c1"],
    ),
    Case(
        "a-claim-whose-selector-is-being-evaluated-is-passed-over",
        [memory_claim("c1", "10Gi")],
        [],
        waiting={"c1": HEAVY},
        evaluating={HEAVY},
    ),
    Case(
        "a-tenant-selector-beyond-the-inline-budget-defers-the-claim",
        [memory_claim("c1", "10Gi", selectors=[HEAVY])],
        [],
        budget=50,
        deferred={"c1": HEAVY},
    ),
    Case(
        "a-deferred-claim-is-decided-once-its-selector-is-in",
        [memory_claim("c1", "10Gi")],
        [
            "device gpu-0: CapacityReserved c1 v1 gpu-0 memory=10Gi shared share-1",
            "claim c1: AllocationBound c1 v1 node-a share-1",
        ],
        waiting={"c1": HEAVY},
        allocated=["c1"],
    ),
    Case(
        "a-claim-no-longer-pending-is-passed-over",
        [],
        [],
        before=[memory_claim("c0", "10Gi")],
        order=["c0"],
    ),
]


def _short(stream: str) -> str:
    kind, _, rest = stream.partition(":")
    return f"{kind} {rest.rsplit('/', 1)[-1]}"


def _decide(case: Case) -> tuple[Round, list[str]]:
    log = Log(*inventory(*case.devices))
    log.reserve(*case.before)
    for rc in case.claims:
        log.extend(admitted(rc))
    for name in case.unschedulable:
        log.add(c.ClaimUnschedulable(namespace=NAMESPACE, name=name, reason=NO_FIT))
    state = log.state()
    key = {rc.metadata.name: (NAMESPACE, rc.metadata.name) for rc in case.claims + case.before}
    backlog = Backlog(
        order=pending(state) if case.order is None else [key[n] for n in case.order],
        epoch=case.epoch,
        tried={key[n]: e for n, e in case.tried.items()},
        waiting={key[n]: s for n, s in case.waiting.items()},
        evaluating=case.evaluating,
    )
    allocator = allocator_of(state, inline_budget=case.budget)
    held = (allocator.allocated.shares, dict(allocator.allocated.exclusive))
    decided = decide_round(state, allocator, backlog, share_ids("new-"))
    lines = [
        f"{_short(stream)}: {describe(event)}"
        for stream, events, _ in decided.by_stream()
        for event in events
    ]
    # the round left the allocator as it found it: the same round decides the same again
    assert (allocator.allocated.shares, allocator.allocated.exclusive) == held
    allocator.new_share_id = share_ids()
    assert decide_round(state, allocator, backlog, share_ids("new-")) == decided
    return decided, lines


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_round(case: Case) -> None:
    decided, lines = _decide(case)
    assert lines == case.expect
    assert [name for _, name in decided.allocated] == case.allocated
    assert [name for _, name in decided.tried] == case.tried_now
    assert {k[1]: s for k, s in decided.deferred.items()} == case.deferred
    unschedulable = [line.split()[-1] for line in case.expect if "ClaimUnschedulable" in line]
    assert len(decided.unschedulable) == len(unschedulable)
    for _, events, claims in decided.by_stream():
        for event, about in zip(events, claims, strict=True):
            assert about == (NAMESPACE, getattr(event, "name", None))  # each event's claim


# --- dracap.io/shared-across-namespaces: deny, with grants derived from the log -------------


def _deny_log() -> Log:
    deny = device_class(annotations={"dracap.io/shared-across-namespaces": "deny"})
    return Log(
        c.DeviceClassApplied(device_class=deny, rollout="immediate"),
        c.ResourceSlicePublished(slice=slice_([gpu()], node="node-a", name="node-a-slice")),
        c.NamespaceAccessSet(namespace=NAMESPACE, classes=["*"]),
        c.NamespaceAccessSet(namespace="tenant-b", classes=["*"]),
    )


def _b_claim(name: str) -> ResourceClaim:
    return claim(request("gpu", {"memory": "5Gi"}), name=name, namespace="tenant-b")


def test_a_device_held_in_the_log_stays_with_its_namespace() -> None:
    log = _deny_log()
    log.reserve(memory_claim("a1", "10Gi"))  # tenant-a holds gpu-0, as the log says
    log.extend(admitted(_b_claim("b1")) + admitted(memory_claim("a2", "5Gi")))
    state = log.state()
    decided = decide_round(state, allocator_of(state), Backlog(order=pending(state)), share_ids())
    lines = sorted(describe(e) for _, events, _ in decided.by_stream() for e in events)
    reason = (
        "request gpu: 1 devices of class gpu.test.io match; 1 held by another namespace "
        "(not shared across namespaces: dracap.io/shared-across-namespaces=deny) on node node-a"
    )
    assert lines == [
        "AllocationBound a2 v1 node-a share-1",
        "CapacityReserved a2 v1 gpu-0 memory=5Gi shared share-1",
        f"ClaimUnschedulable b1: {reason}",
    ]


def test_within_one_round_the_first_namespace_keeps_the_device() -> None:
    log = _deny_log()
    log.extend(admitted(memory_claim("a1", "10Gi")) + admitted(_b_claim("b1")))
    state = log.state()
    decided = decide_round(state, allocator_of(state), Backlog(order=pending(state)), share_ids())
    assert [name for _, name in decided.allocated] == ["a1"]
    assert [key for key in decided.unschedulable] == [("tenant-b", "b1")]


# --- the claim's configuration, which the fold does not keep ---------------------------------


def _configured(name: str, memory: str) -> ResourceClaim:
    rc = memory_claim(name, memory)
    assert rc.spec.devices is not None
    config = [
        model.convert(
            {"opaque": {"driver": "gpu.test.io", "parameters": {"tuning": name}}},
            model.DeviceClaimConfiguration,
        )
    ]
    devices = msgspec.structs.replace(rc.spec.devices, config=config)
    return msgspec.structs.replace(rc, spec=model.ResourceClaimSpec(devices=devices))


def _bound_of(decided: Round, name: str) -> c.AllocationBound:
    [bound] = [
        e
        for e, _ in decided.writes[claim_stream(NAMESPACE, name)]
        if isinstance(e, c.AllocationBound)
    ]
    return bound


def test_a_configured_claim_is_bound_with_the_configuration_of_its_manifest() -> None:
    tuned, plain = _configured("c1", "10Gi"), memory_claim("c2", "10Gi")
    log = Log(*inventory(gpu()))
    log.extend(admitted(tuned) + admitted(plain))
    state = log.state()
    assert state.claims[(NAMESPACE, "c1")].spec.configs == 1  # type: ignore[union-attr]
    decided = decide_round(state, allocator_of(state), Backlog(order=pending(state)), share_ids())
    assert decided.configured == [(NAMESPACE, "c1")]  # the plain one needs nothing
    assert _bound_of(decided, "c1").allocation.devices.config is None  # type: ignore[union-attr]
    assert decided.configure({(NAMESPACE, "c1"): tuned}) == []
    [config] = _bound_of(decided, "c1").allocation.devices.config  # type: ignore[union-attr,misc]
    assert (config.source, config.opaque) == ("FromClaim", tuned.spec.devices.config[0].opaque)  # type: ignore[union-attr,index]
    # exactly what the allocator decides on the whole claim
    whole = allocator_of(state)
    whole.new_share_id = share_ids()
    out = whole.allocate(tuned, any_node=True)
    assert isinstance(out, Allocated)
    assert _bound_of(decided, "c1").allocation == out.allocation
    assert decided.configured == []


def test_a_configured_claim_without_a_manifest_in_the_log_is_left_pending() -> None:
    log = Log(*inventory(gpu()))
    log.extend(admitted(_configured("c1", "10Gi")) + admitted(memory_claim("c2", "10Gi")))
    state = log.state()
    decided = decide_round(state, allocator_of(state), Backlog(order=pending(state)), share_ids())
    assert decided.configure({}) == [(NAMESPACE, "c1")]
    lines = [describe(e) for _, events, _ in decided.by_stream() for e in events]
    assert lines == [
        "CapacityReserved c2 v1 gpu-0 memory=10Gi shared share-2",
        "AllocationBound c2 v1 node-a share-2",
    ]
    assert decided.allocated == [(NAMESPACE, "c2")]
