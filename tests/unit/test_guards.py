"""The guards the database applies are what the fold does to capacity, holds and epochs.

Rows: an event, and the guards it must produce. Every catalog event type not listed
produces none: it changes nothing the database checks. The integration test
``test_replay_equals_projections_at_every_step`` applies them on both append paths and
compares the tables with the fold after every append.
"""

from __future__ import annotations

from decimal import Decimal

import msgspec
import pytest

from events import catalog
from events.fold import apply_event
from events.guards import (
    Acquire,
    Fence,
    Guard,
    NoteEpoch,
    Release,
    Reserve,
    SetTotal,
    encode_guards,
    guards_of,
    guards_of_many,
)
from events.state import ClusterState
from tests.integration import sample as s

SHARED = s.reserved("ns", "a", consumed="10Gi", share_id="11111111-1111-4111-8111-111111111111")
DEDICATED = s.reserved(
    "ns", "b", device="gpu-1", shared=False, share_id="22222222-2222-4222-8222-222222222222"
)
ADMIN = s.reserved("ns", "c", admin=True, share_id="33333333-3333-4333-8333-333333333333")
GI = str(Decimal(1024**3 * 10**9).scaleb(-9))


def _reserve(event: catalog.CapacityReserved, *, exclusive: bool, at: int = 1) -> Reserve:
    return Reserve(
        at=at,
        share_id=event.share_id,
        driver=event.driver,
        pool=event.pool,
        device=event.device,
        node=event.node,
        namespace=event.namespace,
        claim=event.name,
        amounts={"memory": str(Decimal(event.consumed["memory"].nanos).scaleb(-9))},
        exclusive=exclusive,
    )


ROWS: list[tuple[str, catalog.Event, list[Guard]]] = [
    (
        "a slice sets the total of every device capacity",
        s.slice_published(devices={"gpu-0": {"memory": "1Gi"}, "gpu-1": {"memory": "2Gi"}}),
        [
            SetTotal(
                at=1, driver=s.DRIVER, pool=s.POOL, device="gpu-0", capacity="memory", total=GI
            ),
            SetTotal(
                at=1,
                driver=s.DRIVER,
                pool=s.POOL,
                device="gpu-1",
                capacity="memory",
                total=str(Decimal(2 * 1024**3 * 10**9).scaleb(-9)),
            ),
        ],
    ),
    ("a shared reservation holds its amounts", SHARED, [_reserve(SHARED, exclusive=False)]),
    ("a dedicated reservation holds the device", DEDICATED, [_reserve(DEDICATED, exclusive=True)]),
    ("an admin reservation holds nothing", ADMIN, []),
    ("a release gives back", s.released(SHARED), [Release(at=1, share_id=SHARED.share_id)]),
    (
        "an admin release is a release too (it finds nothing held)",
        s.released(ADMIN),
        [Release(at=1, share_id=ADMIN.share_id)],
    ),
    (
        "a lease expiry records its epoch",
        catalog.NodeLeaseExpired(node="n", epoch=4),
        [NoteEpoch(at=1, node="n", epoch=4)],
    ),
    (
        "a fence releases the node's shares",
        catalog.NodeFenced(node="n", epoch=4),
        [Fence(at=1, node="n", epoch=4)],
    ),
    (
        "a new lease is checked and written",
        catalog.NodeLeaseAcquired(node="n", epoch=5, boot_id="b", ttl_ms=9000),
        [Acquire(at=1, node="n", epoch=5, boot_id="b", ttl_ms=9000)],
    ),
    ("binding changes no capacity", s.bound(SHARED), []),
    ("a claim submission changes no capacity", s.claim_submitted(), []),
    (
        "an applied limit changes no capacity",
        catalog.LimitApplied(share_id=SHARED.share_id, node="node-a", level="hard", actual={}),
        [],
    ),
    (
        "a release request changes no capacity (the release does)",
        catalog.ReleaseRequested(namespace="ns", name="a", allocation_version=1),
        [],
    ),
]


@pytest.mark.parametrize(
    ("event", "expected"), [(e, g) for _, e, g in ROWS], ids=[r[0] for r in ROWS]
)
def test_guards_of(event: catalog.Event, expected: list[Guard]) -> None:
    assert guards_of(event) == expected


def test_only_capacity_events_have_guards() -> None:
    guarded = {type(e) for _, e, g in ROWS if g}
    assert guarded == {
        catalog.ResourceSlicePublished,
        catalog.CapacityReserved,
        catalog.CapacityReleased,
        catalog.NodeLeaseExpired,
        catalog.NodeFenced,
        catalog.NodeLeaseAcquired,
    }


def test_the_fold_and_the_guards_agree_on_what_counts() -> None:
    """What the fold consumes and holds is what the guards reserve."""
    state = ClusterState()
    apply_event(state, s.slice_published(devices={"gpu-0": {"memory": "80Gi"}}), 1)
    apply_event(
        state,
        s.slice_published("ded", {"gpu-1": {"memory": "40Gi"}}, shared=False),
        2,
    )
    for position, event in enumerate((SHARED, DEDICATED, ADMIN), start=3):
        apply_event(state, event, position)
    for event in (SHARED, DEDICATED, ADMIN):
        device = state.devices[(event.driver, event.pool, event.device)]
        reserves = [g for g in guards_of(event) if isinstance(g, Reserve)]
        counted = device.consumed_nanos.get("memory", 0) > 0 and not event.admin_access
        assert bool(reserves) == counted
        if reserves:
            assert reserves[0].exclusive == (device.exclusive_share == event.share_id)


def test_offsets_follow_the_append() -> None:
    guards = guards_of_many([s.claim_submitted(), SHARED, s.bound(SHARED), s.released(SHARED)])
    assert [(type(g).__name__, g.at) for g in guards] == [("Reserve", 2), ("Release", 4)]


def test_the_server_reads_guards_by_name() -> None:
    [decoded] = msgspec.json.decode(encode_guards([Release(at=3, share_id="x")]))
    assert decoded == {"kind": "release", "at": 3, "share_id": "x"}
