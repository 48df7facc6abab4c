"""The state fold: lifecycle scenarios, one failing case per invariant, replay properties."""

from __future__ import annotations

import datetime
import inspect
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events import catalog as c
from events.envelopes import Envelope, new_envelope
from events.errors import InvariantViolation
from events.eventcodec import decode_stored, encode_payload
from events.fold import apply, fold, step_of
from events.folding import fold_event
from events.model import (
    AllocationResult,
    CapacityRequestPolicy,
    CapacityRequestPolicyRange,
    Device,
    DeviceCapacity,
    ObjectMeta,
    ResourceClaim,
    ResourceClaimSpec,
    ResourcePool,
    ResourceSlice,
    ResourceSliceSpec,
)
from events.quantities import Quantity
from events.state import REUSABLE_PHASES, ClusterState, PhaseChange, ShareChange
from events.statecodec import snapshot_decode, snapshot_encode, state_digest, to_builtins

Q = Quantity.parse
T0 = datetime.datetime(2025, 6, 1, tzinfo=datetime.UTC)
DRIVER = "gpu.example.com"
POOL = "node-a"
NODE = "node-a"


def policy(
    min: str = "1Gi", max: str | None = "40Gi", step: str | None = "1Gi"
) -> CapacityRequestPolicy:
    return CapacityRequestPolicy(
        default=Q(min),
        valid_range=CapacityRequestPolicyRange(
            min=Q(min), max=Q(max) if max else None, step=Q(step) if step else None
        ),
    )


def device(
    name: str,
    *,
    memory: str = "80Gi",
    shared: bool = True,
    pol: CapacityRequestPolicy | None = None,
) -> Device:
    return Device(
        name=name,
        allow_multiple_allocations=shared or None,
        capacity={"memory": DeviceCapacity(value=Q(memory), request_policy=pol)},
    )


def rslice(*devices: Device, name: str = "node-a-gpus", generation: int = 1) -> ResourceSlice:
    return ResourceSlice(
        metadata=ObjectMeta(name=name),
        spec=ResourceSliceSpec(
            driver=DRIVER,
            pool=ResourcePool(name=POOL, generation=generation, resource_slice_count=1),
            node_name=NODE,
            devices=list(devices),
        ),
    )


def reserve(
    share_id: str,
    amount: str = "4Gi",
    *,
    claim: str = "train",
    dev: str = "gpu-0",
    shared: bool = True,
    admin: bool = False,
    version: int = 1,
    policy_version: int = 1,
    node: str | None = NODE,
) -> c.CapacityReserved:
    return c.CapacityReserved(
        namespace="team-a",
        name=claim,
        allocation_version=version,
        request="gpu",
        driver=DRIVER,
        pool=POOL,
        device=dev,
        node=node,
        share_id=share_id,
        shared=shared,
        admin_access=admin,
        consumed={"memory": Q(amount)},
        policy_version=policy_version,
    )


def release(
    share_id: str, amount: str = "4Gi", *, dev: str = "gpu-0", version: int = 1
) -> c.CapacityReleased:
    return c.CapacityReleased(
        share_id=share_id,
        driver=DRIVER,
        pool=POOL,
        device=dev,
        allocation_version=version,
        consumed={"memory": Q(amount)},
        admin_access=False,
    )


def bound(claim: str, *share_ids: str, version: int = 1) -> c.AllocationBound:
    return c.AllocationBound(
        namespace="team-a",
        name=claim,
        allocation_version=version,
        node=NODE,
        allocation=AllocationResult(),
        share_ids=list(share_ids),
    )


def applied(share_id: str, node: str = NODE) -> c.LimitApplied:
    return c.LimitApplied(share_id=share_id, node=node, level="hard", actual={})


def envelope(event: c.Event, position: int) -> Envelope:
    return new_envelope(
        event, stream_version=1, actor="test", recorded_at=T0, position=position, event_id="e"
    )


class Log:
    """A log under construction with its folded state."""

    def __init__(self, *events: c.Event) -> None:
        self.state = ClusterState()
        self.envelopes: list[Envelope] = []
        for event in events:
            self.add(event)

    def add(self, *events: c.Event) -> Log:
        """Fold ``events``; after each, the fold's journal must be the difference of every
        claim's phase, and of every share's state, before and after it (every test here
        checks)."""
        for event in events:
            env = envelope(event, len(self.envelopes) + 1)
            before = {key: claim.phase for key, claim in self.state.claims.items()}
            held = {share_id: share.state for share_id, share in self.state.shares.items()}
            apply(self.state, env)
            after = {key: claim.phase for key, claim in self.state.claims.items()}
            changed = {
                key: PhaseChange(before.get(key), phase)
                for key, phase in after.items()
                if before.get(key) != phase
            }
            assert self.state.phase_changes() == changed, type(event).__name__
            moved = {
                share_id: ShareChange(held.get(share_id), share.state)
                for share_id, share in self.state.shares.items()
                if held.get(share_id) != share.state
            }
            assert self.state.share_changes() == moved, type(event).__name__
            self.envelopes.append(env)
        return self

    def violates(self, event: c.Event, invariant: str) -> InvariantViolation:
        """Assert ``event`` breaks ``invariant`` at the next position and changes nothing."""
        before = to_builtins(self.state)
        position = len(self.envelopes) + 1
        with pytest.raises(InvariantViolation) as err:
            apply(self.state, envelope(event, position))
        assert err.value.invariant == invariant, err.value
        assert err.value.position == position
        assert to_builtins(self.state) == before
        return err.value

    def consumed(self, dev: str = "gpu-0") -> Quantity:
        d = self.state.device(DRIVER, POOL, dev)
        assert d is not None
        return d.consumed()["memory"]

    def phase(self, claim: str = "train") -> str:
        record = self.state.claim("team-a", claim)
        assert record is not None
        return record.phase

    def share(self, share_id: str) -> str:
        return self.state.shares[share_id].state


def submitted(name: str = "train") -> c.ClaimSubmitted:
    return c.ClaimSubmitted(
        claim=ResourceClaim(
            metadata=ObjectMeta(name=name, namespace="team-a"), spec=ResourceClaimSpec()
        )
    )


def shared_log() -> Log:
    return Log(
        c.ResourceSlicePublished(slice=rslice(device("gpu-0", pol=policy()), device("gpu-1"))),
        submitted(),
        c.ClaimAdmitted(namespace="team-a", name="train"),
    )


# --- lifecycle ----------------------------------------------------------------------------


def test_full_lifecycle_with_duplicate_release() -> None:
    log = shared_log()
    assert log.phase() == "admitted"
    log.add(reserve("s-1", "4Gi"), reserve("s-2", "8Gi", dev="gpu-1"))
    assert log.consumed() == Q("4Gi")
    assert log.share("s-1") == "reserved"
    log.add(bound("train", "s-1", "s-2"))
    assert log.phase() == "allocated"
    assert log.share("s-1") == "bound"
    log.add(applied("s-1"))
    assert log.phase() == "allocated", "ready needs every share's limit"
    log.add(applied("s-2"))
    assert log.phase() == "ready"
    log.add(c.ReleaseRequested(namespace="team-a", name="train", allocation_version=1))
    assert log.phase() == "releasing"
    assert log.share("s-1") == "releasing"
    log.add(release("s-1"))
    assert log.consumed() == Q("0")
    assert log.phase() == "releasing"
    log.add(release("s-1"), release("s-2", "8Gi", dev="gpu-1"), release("s-2", "8Gi", dev="gpu-1"))
    assert log.consumed() == Q("0")
    assert log.consumed("gpu-1") == Q("0")
    assert log.phase() == "released"
    assert log.share("s-2") == "released"
    assert log.state.position == len(log.envelopes)
    assert not log.state.nodes[NODE].live_shares


def test_scheduling_alone_is_not_readiness_even_for_admin_only_claims() -> None:
    log = shared_log().add(reserve("a-1", "0", admin=True), bound("train", "a-1"))
    assert log.phase() == "allocated"
    assert log.consumed() == Q("0")
    log.add(applied("a-1"))
    assert log.phase() == "ready"


def test_admin_shares_do_not_consume_or_block_readiness() -> None:
    log = shared_log().add(
        reserve("s-1", "80Gi", dev="gpu-1"),
        reserve("a-1", "80Gi", dev="gpu-1", admin=True),
        bound("train", "s-1", "a-1"),
        applied("s-1"),
    )
    assert log.consumed("gpu-1") == Q("80Gi")
    assert log.phase() == "ready"


def test_limit_applied_before_bind_keeps_share_ready() -> None:
    log = shared_log().add(reserve("s-1"), applied("s-1"), bound("train", "s-1"))
    assert log.share("s-1") == "ready"
    assert log.phase() == "ready"


def test_non_retryable_limit_failure_fails_the_claim() -> None:
    log = shared_log().add(reserve("s-1"), bound("train", "s-1"))
    log.add(c.LimitFailed(share_id="s-1", node=NODE, retryable=True, reason="busy"))
    assert log.phase() == "allocated"
    log.add(c.LimitFailed(share_id="s-1", node=NODE, retryable=False, reason="no mps"))
    assert log.phase() == "failed"
    assert log.consumed() == Q("4Gi"), "capacity stays until released"
    log.add(release("s-1"))
    assert log.consumed() == Q("0")


def test_stale_release_request_is_a_no_op() -> None:
    log = shared_log().add(reserve("s-1"), bound("train", "s-1"))
    log.add(c.ReleaseRequested(namespace="team-a", name="train", allocation_version=7))
    assert log.phase() == "allocated"


def test_claim_rejected_and_unschedulable() -> None:
    log = shared_log().add(
        c.ClaimRejected(namespace="team-a", name="train", field="f", rule="r", reason="x")
    )
    assert log.phase() == "rejected"
    log.add(c.ClaimUnschedulable(namespace="team-a", name="train", reason="full"))
    assert log.phase() == "unschedulable"


# --- invariants ---------------------------------------------------------------------------


def test_capacity_over_total() -> None:
    log = shared_log().add(reserve("s-1", "40Gi"), reserve("s-2", "40Gi"))
    err = log.violates(reserve("s-3", "1Gi"), "capacity")
    assert "gpu-0" in err.detail


def test_capacity_unknown_device_or_capacity() -> None:
    log = shared_log()
    log.violates(reserve("s-1", dev="gpu-9"), "capacity")
    bad = c.CapacityReserved(
        **{
            **{f: getattr(reserve("s-1"), f) for f in c.CapacityReserved.__struct_fields__},
            "consumed": {"cores": Q("1")},
        }
    )
    log.violates(bad, "capacity")


def test_capacity_withdrawn_device() -> None:
    log = shared_log().add(c.ResourceSliceWithdrawn(name="node-a-gpus"))
    log.violates(reserve("s-1"), "capacity")


def test_exclusive_dedicated_device_single_holder() -> None:
    log = Log(c.ResourceSlicePublished(slice=rslice(device("gpu-0", shared=False))))
    log.add(reserve("d-1", "80Gi", shared=False))
    log.violates(reserve("d-2", "0", claim="other", shared=False), "exclusive")
    log.violates(reserve("d-3", "0", shared=True), "exclusive")
    log.add(release("d-1", "80Gi"))
    log.add(reserve("d-4", "80Gi", claim="other", shared=False))
    assert log.state.devices[(DRIVER, POOL, "gpu-0")].exclusive_holder == ("team-a", "other")


def test_exclusive_shared_blocked_by_dedicated_hold_and_vice_versa() -> None:
    log = Log(c.ResourceSlicePublished(slice=rslice(device("gpu-0", shared=False))))
    log.add(reserve("d-1", "8Gi", shared=False))
    log.add(c.ResourceSlicePublished(slice=rslice(device("gpu-0", shared=True))))
    log.violates(reserve("s-1", "8Gi", claim="other"), "exclusive")
    log.add(release("d-1", "8Gi"), reserve("s-1", "8Gi", claim="other"))
    log.add(c.ResourceSlicePublished(slice=rslice(device("gpu-0", shared=False))))
    log.violates(reserve("d-2", "8Gi", claim="third", shared=False), "exclusive")


def test_identity_share_reserved_twice() -> None:
    log = shared_log().add(reserve("s-1"))
    log.violates(reserve("s-1", dev="gpu-1"), "identity")


def test_identity_release_of_unknown_share() -> None:
    log = shared_log()
    log.violates(release("nope"), "identity")


def test_identity_release_with_other_allocation_or_device() -> None:
    log = shared_log().add(reserve("s-1"))
    log.violates(release("s-1", version=2), "identity")
    log.violates(release("s-1", dev="gpu-1"), "identity")
    log.violates(release("s-1", "5Gi"), "identity")


def test_identity_bind_of_foreign_or_unknown_share() -> None:
    log = shared_log().add(reserve("s-1", claim="other"))
    log.violates(bound("train", "s-1"), "identity")
    log.violates(bound("train", "ghost"), "identity")


def test_policy_violations() -> None:
    log = shared_log()
    log.violates(reserve("s-1", "41Gi"), "policy")
    log.violates(reserve("s-1", "1536Mi"), "policy")
    log.violates(reserve("s-1", "512Mi"), "policy")
    log.violates(reserve("s-1", policy_version=9), "policy")
    log.add(reserve("s-1", "3Gi"))


def test_policy_valid_values() -> None:
    values = CapacityRequestPolicy(default=Q("1Gi"), valid_values=[Q("1Gi"), Q("4Gi")])
    log = Log(c.ResourceSlicePublished(slice=rslice(device("gpu-0", pol=values))))
    log.violates(reserve("s-1", "2Gi"), "policy")
    log.add(reserve("s-1", "4Gi"), reserve("s-2", "1024Mi"))


def test_a_policy_change_whose_number_was_taken_takes_the_next() -> None:
    # decided at version 1 -> 2, while a slice published meanwhile took 2 itself
    log = shared_log()
    change = c.RequestPolicyChanged(
        driver=DRIVER, pool=POOL, device="gpu-0", capacity="memory", policy=None, policy_version=1
    )
    log.add(change)
    dev = log.state.devices[(DRIVER, POOL, "gpu-0")]
    assert dev.policy_version == 2 and dev.capacity_policy_versions["memory"] == 2
    assert dev.policy_history["memory"][-1].version == 2


def test_idempotent_release_subtracts_once() -> None:
    log = shared_log().add(reserve("s-1", "4Gi"), reserve("s-2", "8Gi"))
    log.add(release("s-1"), release("s-1"), release("s-1"))
    assert log.consumed() == Q("8Gi")


def test_readiness_limit_applied_only_to_reserved_or_bound() -> None:
    log = shared_log().add(reserve("s-1"), bound("train", "s-1"))
    log.violates(applied("s-1", node="node-b"), "readiness")
    log.add(applied("s-1"))
    log.violates(applied("s-1"), "readiness")
    log.add(c.ReleaseRequested(namespace="team-a", name="train", allocation_version=1))
    log.violates(applied("s-1"), "readiness")
    log.add(release("s-1"))
    log.violates(applied("s-1"), "readiness")
    log.violates(applied("ghost"), "identity")


def test_order_of_positions() -> None:
    log = shared_log()
    with pytest.raises(InvariantViolation) as err:
        apply(log.state, envelope(reserve("s-1"), 2))
    assert err.value.invariant == "order"
    assert err.value.position == 2


# --- fencing ------------------------------------------------------------------------------


def fenced_setup() -> Log:
    return shared_log().add(
        reserve("s-1", "4Gi"),
        reserve("s-2", "8Gi", dev="gpu-1"),
        bound("train", "s-1", "s-2"),
        applied("s-1"),
        applied("s-2"),
        c.NodeLeaseExpired(node=NODE, epoch=5),
    )


def test_lease_expiry_marks_unknown_and_keeps_capacity() -> None:
    log = fenced_setup()
    assert log.share("s-1") == "unknown"
    assert log.consumed() == Q("4Gi")
    err = log.violates(release("s-1"), "fencing")
    assert "s-1" in err.detail
    log.add(reserve("s-3", "40Gi", claim="other"))
    log.violates(reserve("s-4", "37Gi", claim="third"), "capacity")  # 4 + 40 + 37 > 80


def test_confirmation_restores_ready() -> None:
    log = fenced_setup().add(c.ShareConfirmed(share_id="s-1", node=NODE))
    assert log.share("s-1") == "ready"
    assert log.share("s-2") == "unknown"
    log.add(release("s-1"))
    assert log.consumed() == Q("0")


def test_fence_releases_capacity_and_fails_claim() -> None:
    log = fenced_setup().add(c.NodeFenced(node=NODE, epoch=5))
    assert log.share("s-1") == log.share("s-2") == "released"
    assert log.consumed() == Q("0")
    assert log.consumed("gpu-1") == Q("0")
    assert log.phase() == "failed"
    log.add(release("s-1"))  # reclamation's own release after the fence: a no-op
    assert log.consumed() == Q("0")
    log.violates(c.ShareConfirmed(share_id="s-1", node=NODE), "fencing")


def test_stale_fence_is_ignored() -> None:
    log = fenced_setup().add(c.NodeFenced(node=NODE, epoch=4))
    assert log.share("s-1") == "unknown"
    assert log.consumed() == Q("4Gi")


def test_single_share_marked_unknown() -> None:
    log = shared_log().add(reserve("s-1"), bound("train", "s-1"))
    log.add(c.ShareMarkedUnknown(share_id="s-1", node=NODE))
    assert log.share("s-1") == "unknown"
    log.add(c.ShareConfirmed(share_id="s-1", node=NODE))
    assert log.share("s-1") == "bound", "confirmation restores the prior state"


def acquired(epoch: int, boot: str = "boot-1") -> c.NodeLeaseAcquired:
    return c.NodeLeaseAcquired(node=NODE, epoch=epoch, boot_id=boot, ttl_ms=10_000)


def test_a_lease_must_be_newer_than_every_lease_and_fence_before() -> None:
    log = shared_log().add(acquired(1))
    assert log.state.nodes[NODE].lease == "live"
    assert log.state.nodes[NODE].boot_id == "boot-1"
    log.violates(acquired(1), "fencing")
    log.add(c.NodeLeaseExpired(node=NODE, epoch=1))
    log.violates(acquired(1), "fencing")
    log.add(c.NodeFenced(node=NODE, epoch=1, reason="power off"))
    assert "power off" in (log.state.nodes[NODE].reason or "")
    log.add(acquired(2, "boot-2"))
    assert log.state.nodes[NODE].lease == "live"
    assert log.state.nodes[NODE].reason is None


def test_an_unknown_share_is_released_only_once_a_new_lease_vouches_for_it() -> None:
    log = fenced_setup()
    log.violates(release("s-1"), "fencing")
    log.add(acquired(6))  # the agent is back under a new epoch
    assert log.share("s-1") == "unknown", "a new lease alone confirms nothing"
    log.add(release("s-1"))
    assert log.share("s-1") == "released"
    assert log.consumed() == Q("0")


def test_a_share_confirmed_after_its_claim_was_deleted_is_releasing() -> None:
    log = fenced_setup()
    log.add(c.ReleaseRequested(namespace="team-a", name="train", allocation_version=1))
    assert log.phase() == "releasing"
    assert log.share("s-1") == "unknown"
    log.add(acquired(6), c.ShareConfirmed(share_id="s-1", node=NODE))
    assert log.share("s-1") == "releasing"


def test_fence_reason_is_the_claims_reason() -> None:
    log = fenced_setup().add(c.NodeFenced(node=NODE, epoch=5, reason="BMC says off"))
    record = log.state.claim("team-a", "train")
    assert record is not None and record.reason is not None
    assert "BMC says off" in record.reason and "epoch 5" in record.reason


# --- policy changes -----------------------------------------------------------------------


def test_policy_change_does_not_alter_existing_shares() -> None:
    log = shared_log().add(reserve("s-1", "3Gi"))
    change = c.RequestPolicyChanged(
        driver=DRIVER,
        pool=POOL,
        device="gpu-0",
        capacity="memory",
        policy=policy(min="2Gi", step="2Gi"),
        policy_version=2,
    )
    log.add(change)
    share = log.state.shares["s-1"]
    assert share.policy_version == 1
    assert share.consumed == {"memory": Q("3Gi")}
    assert log.consumed() == Q("3Gi")
    dev = log.state.devices[(DRIVER, POOL, "gpu-0")]
    assert dev.policy_version == 2
    assert dev.capacity_policy_versions["memory"] == 2
    log.violates(reserve("s-2", "3Gi", policy_version=2), "policy")
    log.add(reserve("s-2", "3Gi", policy_version=1))  # decided under v1: checked against v1
    log.add(reserve("s-3", "4Gi", policy_version=2))
    log.add(release("s-1", "3Gi"))
    assert log.consumed() == Q("7Gi")


def test_republished_slice_bumps_policy_version_only_on_change() -> None:
    log = shared_log()
    dev = log.state.devices[(DRIVER, POOL, "gpu-0")]
    assert dev.policy_version == 1
    log.add(c.ResourceSlicePublished(slice=rslice(device("gpu-0", pol=policy()), device("gpu-1"))))
    assert dev.policy_version == 1
    log.add(c.ResourceSlicePublished(slice=rslice(device("gpu-0", pol=policy(max="8Gi")))))
    assert dev.policy_version == 2
    assert not log.state.devices[(DRIVER, POOL, "gpu-1")].present


def test_unrecorded_policy_version_from_v1_is_resolved() -> None:
    log = shared_log()
    payload = json.loads(encode_payload(reserve("s-1", "3Gi")))
    del payload["shared"], payload["policy_version"]
    event = decode_stored(json.dumps(payload), "reservation.capacity_reserved", 1)
    log.add(event)
    assert log.state.shares["s-1"].policy_version == 1
    payload["share_id"] = "s-2"
    payload["consumed"] = {"memory": "1536Mi"}
    bad = decode_stored(json.dumps(payload), "reservation.capacity_reserved", 1)
    log.violates(bad, "policy")


# --- replay, comparison, snapshots --------------------------------------------------------


def test_snapshot_round_trip_and_resume() -> None:
    log = fenced_setup().add(c.ShareConfirmed(share_id="s-1", node=NODE))
    head = log.envelopes[:6]
    tail = log.envelopes[6:]
    snap = snapshot_encode(fold(head))
    restored = snapshot_decode(snap)
    assert restored == fold(head)
    assert to_builtins(fold(tail, restored)) == to_builtins(log.state)
    assert state_digest(fold(tail, snapshot_decode(snap))) == state_digest(log.state)
    assert state_digest(log.state)["live_shares"] == 2


def test_digest_is_deterministic_and_sensitive() -> None:
    a = shared_log().add(reserve("s-1")).state
    b = shared_log().add(reserve("s-1")).state
    assert state_digest(a) == state_digest(b)
    assert json.dumps(to_builtins(a)) == json.dumps(to_builtins(b))
    c_ = shared_log().add(reserve("s-1", "5Gi")).state
    assert state_digest(a)["sha256"] != state_digest(c_)["sha256"]


# --- properties ---------------------------------------------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.integers(0, 2), st.integers(1, 30)),
        st.tuples(st.just("release"), st.integers(0, 1000), st.booleans()),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_random_reserve_release_never_oversubscribes(ops: list[tuple[str, int, object]]) -> None:
    devices = [device(f"gpu-{i}", memory="64Gi", pol=policy(max=None)) for i in range(3)]
    log = Log(c.ResourceSlicePublished(slice=rslice(*devices)))
    reserved: list[c.CapacityReserved] = []
    digests = [state_digest(log.state)]
    for n, (op, a, b) in enumerate(ops):
        if op == "reserve":
            event: c.Event = reserve(f"s-{n}", f"{b}Gi", claim=f"c-{n}", dev=f"gpu-{a}")
        elif reserved:
            r = reserved[a % len(reserved)]
            event = release(r.share_id, dev=r.device, amount=r.consumed["memory"].canonical())
        else:
            continue
        before = state_digest(log.state)
        violation: InvariantViolation | None = None
        try:
            log.add(event)
        except InvariantViolation as err:
            violation = err
        if violation is not None:
            assert violation.invariant == "capacity"
            assert state_digest(log.state) == before
            continue
        if isinstance(event, c.CapacityReserved):
            reserved.append(event)
        digests.append(state_digest(log.state))
        for dev in log.state.devices.values():
            live = sum(
                s.consumed["memory"].nanos
                for s in log.state.shares.values()
                if s.device == dev.name and s.state != "released"
            )
            assert dev.consumed_nanos.get("memory", 0) == live
            assert 0 <= live <= dev.total["memory"].nanos
    assert len(digests) == len(log.envelopes)
    for k, digest in enumerate(digests, start=1):
        assert state_digest(fold(log.envelopes[:k])) == digest
    assert fold(log.envelopes) == log.state


# --- administration and operations ------------------------------------------------------


def test_namespace_access_is_recorded_and_replaced() -> None:
    log = Log(c.NamespaceAccessSet(namespace="team-a", classes=["gpu.example.com"]))
    access = log.state.namespaces["team-a"]
    assert (access.classes, access.admin_access) == (["gpu.example.com"], False)
    log.add(c.NamespaceAccessSet(namespace="team-a", classes=["*"], admin_access=True))
    access = log.state.namespaces["team-a"]
    assert (access.classes, access.admin_access) == (["*"], True)


def test_withdrawing_a_claim_without_allocation() -> None:
    log = shared_log().add(c.ClaimWithdrawn(namespace="team-a", name="train"))
    assert log.phase() == "withdrawn"


def test_withdrawing_an_allocated_claim_is_refused() -> None:
    log = shared_log().add(reserve("s-1"), bound("train", "s-1"))
    log.violates(c.ClaimWithdrawn(namespace="team-a", name="train"), "identity")


def test_dead_letters_are_counted() -> None:
    event = c.MessageDeadLettered(
        consumer="reservation", event_id="e-1", position=3, deliveries=5, reason="boom"
    )
    assert Log(event, event).state.dead_letters == 2


# --- dispatch ---------------------------------------------------------------------------


def test_every_event_class_has_one_step_of_the_same_signature() -> None:
    for cls in c.EVENT_TYPES.values():
        step = step_of(cls)
        assert step.__name__ != "<lambda>", cls  # the step itself, no adapter
        assert list(inspect.signature(step).parameters) == ["state", "ev", "position"], cls


# --- the live-claim index (the quota's count) ---------------------------------------------


def _recount(state: ClusterState) -> dict[str, int]:
    counts: dict[str, int] = {}
    for (namespace, _), claim in state.claims.items():
        if claim.phase not in REUSABLE_PHASES:
            counts[namespace] = counts.get(namespace, 0) + 1
    return counts


def test_live_claims_follow_a_lifecycle() -> None:
    log = shared_log()
    assert log.state.live_claims == {"team-a": 1}
    log.add(reserve("s-1"), bound("train", "s-1"), applied("s-1"))
    assert log.phase() == "ready" and log.state.live_claim_count("team-a") == 1
    log.add(c.ReleaseRequested(namespace="team-a", name="train", allocation_version=1))
    assert log.state.live_claim_count("team-a") == 1  # releasing still holds its share
    log.add(release("s-1"))
    assert log.phase() == "released" and log.state.live_claims == {}
    log.add(submitted(), c.ClaimAdmitted(namespace="team-a", name="train"))
    assert log.state.live_claims == {"team-a": 1}


def test_a_failed_claim_counts_until_it_is_deleted() -> None:
    log = fenced_setup().add(c.NodeFenced(node=NODE, epoch=5))
    assert log.phase() == "failed"
    assert log.state.live_claims == _recount(log.state) == {"team-a": 1}


CLAIM_OPS = st.lists(
    st.tuples(
        st.sampled_from(["submit", "admit", "reject", "unschedulable", "withdraw", "release"]),
        st.sampled_from(["team-a", "team-b"]),
        st.sampled_from(["c1", "c2", "c3"]),
    ),
    max_size=40,
)


def _claim_event(op: str, namespace: str, name: str) -> c.Event:
    if op == "submit":
        meta = ObjectMeta(name=name, namespace=namespace)
        return c.ClaimSubmitted(claim=ResourceClaim(metadata=meta, spec=ResourceClaimSpec()))
    if op == "admit":
        return c.ClaimAdmitted(namespace=namespace, name=name)
    if op == "reject":
        return c.ClaimRejected(namespace=namespace, name=name, field="f", rule="r", reason="")
    if op == "unschedulable":
        return c.ClaimUnschedulable(namespace=namespace, name=name, reason="full")
    if op == "withdraw":
        return c.ClaimWithdrawn(namespace=namespace, name=name)
    return c.ReleaseRequested(namespace=namespace, name=name, allocation_version=0)


@settings(max_examples=150, deadline=None)
@given(CLAIM_OPS)
def test_the_live_claim_index_equals_a_recount(ops: list[tuple[str, str, str]]) -> None:
    log = Log()
    for op, namespace, name in ops:
        log.add(_claim_event(op, namespace, name))
        assert log.state.live_claims == _recount(log.state)
    assert snapshot_decode(snapshot_encode(log.state)) == log.state
    assert fold(log.envelopes).live_claims == log.state.live_claims


def test_a_refused_event_changes_no_phase_and_the_journal_is_not_compared() -> None:
    log = Log(submitted())
    assert log.state.phase_changes() == {("team-a", "train"): PhaseChange(None, "submitted")}
    refusal = fold_event(log.state, reserve("s-1", "4Gi", dev="no-such-gpu"), 2)
    assert refusal is not None and log.state.phase_changes() == {}
    assert log.state.share_changes() == {}
    again = Log(submitted())
    again.state.phases_before.clear()
    again.state.shares_before["s-0"] = None
    assert again.state == Log(submitted()).state  # equal folds, whatever the last event did
