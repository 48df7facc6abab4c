"""What each event means (``events.transitions``): the table covers the catalog, each
row says what it should, and the one staleness rule holds for the fold, audit and
billing alike."""

from __future__ import annotations

import typing

import pytest

from events import catalog
from events.transitions import (
    INVENTORY_CHANGES,
    KINDS,
    MEANINGS,
    AccessChanged,
    ClaimBound,
    ClaimDecided,
    ClaimEntered,
    ClaimReleasing,
    ClassDefined,
    ClassModeChanged,
    ClassRemoved,
    LimitsSettled,
    NodeEpochs,
    NodeFencedOff,
    NodeLost,
    NodeReturned,
    PolicyChanged,
    ShareHeld,
    ShareKnownAgain,
    ShareReleased,
    ShareUnknown,
    SliceChanged,
    events_meaning,
    first,
    meaning,
    stale,
)
from services.audit import records
from services.billing import service as billing_service
from services.billing import usage
from services.reservation.service import TRIGGERS
from services.runtime.store import livestate
from tests.integration import sample as s
from tests.unit.decision_fixtures import inventory
from tests.unit.test_catalog import every_event


def test_every_event_class_has_a_meaning() -> None:
    """A new event is a row of the table: without one, :func:`meaning` would raise."""
    assert set(MEANINGS) == set(typing.get_args(catalog.Event))


def test_claim_transitions() -> None:
    r = s.reserved("team-a", "c1", "gpu-0", "4Gi", share_id="s-1")
    assert meaning(s.claim_submitted("team-a", "c1")) == (
        ClaimEntered(namespace="team-a", name="c1"),
    )
    rejected = catalog.ClaimRejected(namespace="team-a", name="c1", field="f", rule="r", reason="")
    assert meaning(rejected) == (ClaimDecided(namespace="team-a", name="c1", outcome="rejected"),)
    assert meaning(catalog.ClaimWithdrawn(namespace="team-a", name="c1")) == (
        ClaimDecided(namespace="team-a", name="c1", outcome="withdrawn"),
    )
    (bound,) = meaning(s.bound(r))
    assert isinstance(bound, ClaimBound) and bound.share_ids == ("s-1",)


def test_share_transitions_carry_the_amounts() -> None:
    r = s.reserved("team-a", "c1", "gpu-0", "4Gi", share_id="s-1")
    (held,) = meaning(r)
    assert isinstance(held, ShareHeld)
    assert (held.share_id, held.claim, held.device) == ("s-1", "c1", "gpu-0")
    assert held.amounts == r.consumed and held.admin is r.admin_access
    assert meaning(s.released(r)) == (ShareReleased(share_id="s-1"),)
    node = s.POOL
    assert meaning(catalog.ShareMarkedUnknown(share_id="s-1", node=node)) == (
        ShareUnknown(share_id="s-1", node=node),
    )
    assert meaning(catalog.ShareConfirmed(share_id="s-1", node=node)) == (
        ShareKnownAgain(share_id="s-1", node=node),
    )
    failed = catalog.LimitFailed(share_id="s-1", node=node, retryable=True, reason="x")
    assert meaning(failed) == (
        LimitsSettled(share_id="s-1", node=node, applied=False, retryable=True),
    )


def test_node_and_class_transitions() -> None:
    acquired = catalog.NodeLeaseAcquired(node="n", epoch=2, boot_id="b", ttl_ms=1)
    assert meaning(acquired) == (NodeReturned(node="n", epoch=2),)
    assert meaning(catalog.NodeLeaseExpired(node="n", epoch=2)) == (NodeLost(node="n", epoch=2),)
    assert meaning(catalog.NodeFenced(node="n", epoch=3)) == (NodeFencedOff(node="n", epoch=3),)
    assert meaning(catalog.DeviceClassRemoved(name="gpu")) == (ClassRemoved(name="gpu"),)
    assert first((ClassDefined(name="a"), ClassRemoved(name="a")), ClassRemoved) is not None
    assert first((ClassDefined(name="a"),), ClassRemoved) is None


@pytest.mark.parametrize(
    ("epoch", "lease", "fenced", "expected"),
    [(1, 2, 0, True), (2, 2, 0, False), (2, 0, 3, True), (3, 2, 3, False), (0, 0, 0, False)],
)
def test_one_staleness_rule(epoch: int, lease: int, fenced: int, expected: bool) -> None:
    assert stale(epoch, lease, fenced) is expected
    assert NodeEpochs(node="n", lease_epoch=lease, fenced_epoch=fenced).stale(epoch) is expected


def test_node_epochs_after_each_change() -> None:
    node = NodeEpochs(node="n", lease_epoch=2)
    assert node.after(NodeReturned(node="n", epoch=1)) == node  # never goes back
    assert node.after(NodeLost(node="n", epoch=1)) is None  # stale: nothing changes
    assert node.after(NodeLost(node="n", epoch=3)) == NodeEpochs(node="n", lease_epoch=3)
    assert node.after(NodeFencedOff(node="n", epoch=4)) == NodeEpochs(
        node="n", lease_epoch=4, fenced_epoch=4
    )


def test_audit_and_billing_keep_the_folds_epochs() -> None:
    """Audit and billing hold the same ``NodeEpochs`` (one rule, not copies)."""
    assert records.NodeEpochs is NodeEpochs
    assert usage.NodeEpochs is NodeEpochs


def test_a_class_applied_is_defined_by_its_name() -> None:
    applied = next(e for e in inventory() if isinstance(e, catalog.DeviceClassApplied))
    assert meaning(applied) == (ClassDefined(name=applied.device_class.metadata.name),)


def test_the_listeners_of_one_event_share_its_meaning() -> None:
    """Asked again about the same event, :func:`meaning` answers what it answered."""
    r = s.reserved("team-a", "c1", "gpu-0", "4Gi", share_id="s-1")
    other = s.reserved("team-a", "c2", "gpu-0", "4Gi", share_id="s-2")
    assert meaning(r) is meaning(r)
    assert meaning(other) != meaning(r)


def test_each_class_declares_the_kinds_its_events_stand_for() -> None:
    """``KINDS`` (what readers pick their event classes by) says what ``meaning`` gives,
    on a sample of every class of the catalog."""
    samples = every_event()
    assert {type(e) for e in samples} == set(KINDS)
    for event in samples:
        kinds = {type(t) for t in meaning(event)}
        assert kinds <= set(KINDS[type(event)]), type(event).__name__
        assert bool(kinds) == bool(KINDS[type(event)]), type(event).__name__


def test_the_inventory_changes_are_the_inventory_events() -> None:
    """The events that drop what a reader built from the inventory, picked by meaning."""
    assert events_meaning(*INVENTORY_CHANGES) == {
        catalog.DeviceClassApplied,
        catalog.DeviceClassRemoved,
        catalog.ClassModeSet,
        catalog.ResourceSlicePublished,
        catalog.ResourceSliceWithdrawn,
        catalog.RequestPolicyChanged,
        catalog.NodeLeaseAcquired,
        catalog.NodeLeaseExpired,
        catalog.NodeFenced,
        catalog.DeviceHealthChanged,
    }
    assert events_meaning(*INVENTORY_CHANGES) == livestate.INVENTORY_EVENTS


def test_the_reservation_plans_for_what_frees_capacity() -> None:
    assert set(TRIGGERS) == {
        catalog.ClaimAdmitted,
        catalog.CapacityReleased,
        catalog.NodeFenced,
        catalog.NodeLeaseAcquired,
        catalog.DeviceHealthChanged,
        catalog.NamespaceAccessSet,
    }


def test_inventory_and_access_transitions() -> None:
    policy = catalog.RequestPolicyChanged(
        driver="d", pool="p", device="g", capacity="memory", policy=None, policy_version=3
    )
    assert meaning(policy) == (
        PolicyChanged(driver="d", pool="p", device="g", capacity="memory", policy_version=3),
    )
    assert meaning(catalog.ResourceSliceWithdrawn(name="s")) == (
        SliceChanged(name="s", withdrawn=True),
    )
    mode = catalog.ClassModeSet(name="gpu", mode="disabled")
    assert meaning(mode) == (ClassModeChanged(name="gpu"),)
    access = next(e for e in every_event() if isinstance(e, catalog.NamespaceAccessSet))
    assert meaning(access) == (AccessChanged(namespace=access.namespace),)


def test_billing_reads_the_events_that_stand_for_what_it_bills() -> None:
    assert set(billing_service.EVENTS) == {
        catalog.ClaimSubmitted,
        catalog.CapacityReserved,
        catalog.CapacityReleased,
        catalog.ShareMarkedUnknown,
        catalog.ShareConfirmed,
        catalog.NodeLeaseAcquired,
        catalog.NodeLeaseExpired,
        catalog.NodeFenced,
    }


def test_a_node_changes_outcome_says_what_becomes_of_its_shares() -> None:
    """What audit and billing do to a node's live shares, said once."""
    node = NodeEpochs(node="n", lease_epoch=2)
    assert node.outcome(NodeLost(node="n", epoch=1)) is None  # stale
    returned = node.outcome(NodeReturned(node="n", epoch=3))
    assert returned is not None and returned.shares == "kept"
    lost = node.outcome(NodeLost(node="n", epoch=2))
    assert lost is not None and lost.shares == "unknown" and lost.epochs == node
    fenced = node.outcome(NodeFencedOff(node="n", epoch=2))
    assert fenced is not None and fenced.shares == "released"
    assert fenced.epochs == NodeEpochs(node="n", lease_epoch=2, fenced_epoch=2)


def test_a_release_asked_is_the_claims_agents_work() -> None:
    asked = catalog.ReleaseRequested(namespace="team-a", name="c1", allocation_version=1, node="n")
    assert meaning(asked) == (ClaimReleasing(namespace="team-a", name="c1", node="n"),)
