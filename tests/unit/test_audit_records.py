"""The audit's records, from envelopes: one per event, one more per share a fence frees."""

from __future__ import annotations

import datetime

import pytest

from events import catalog
from events.catalog import Event
from events.envelopes import Envelope, new_envelope
from services.audit.records import NodeEpochs, build
from tests.integration import sample as s

T0 = datetime.datetime(2026, 12, 1, 9, 30, tzinfo=datetime.UTC)


def env(event: Event, position: int, actor: str = "system:reservation-0") -> Envelope:
    return new_envelope(event, stream_version=1, actor=actor, position=position, recorded_at=T0)


def test_a_lifecycle_names_namespace_claim_share_device_amounts_and_actors() -> None:
    r = s.reserved("team-a", "c1", consumed="10Gi", pool="node-a")
    envs = [
        env(s.claim_submitted("team-a", "c1"), 1, "tenant:alice@team-a"),
        env(catalog.ClaimAdmitted(namespace="team-a", name="c1"), 2, "tenant:alice@team-a"),
        env(r, 3),
        env(
            catalog.LimitApplied(share_id=r.share_id, node="node-a", level="hard", actual={}),
            4,
            "agent:node-a#3",
        ),
        env(s.released(r), 5, "agent:node-a#3"),
    ]
    update = build(envs, {}, {}, {})
    rows = [
        (x.position, x.decision, x.namespace, x.claim, x.actor_kind, x.actor_epoch)
        for x in update.records
    ]
    assert rows == [
        (1, "submitted", "team-a", "c1", "tenant", None),
        (2, "admitted", "team-a", "c1", "tenant", None),
        (3, "capacity_reserved", "team-a", "c1", "system", None),
        (4, "limit_applied", "team-a", "c1", "agent", 3),
        (5, "capacity_released", "team-a", "c1", "agent", 3),
    ]
    reserved = update.records[2]
    assert reserved.share_id == r.share_id
    assert reserved.device == f"{s.DRIVER}/node-a/gpu-0"
    assert reserved.amounts == {"memory": "10Gi"}
    assert reserved.policy_version == 1
    assert reserved.request == "gpu"
    assert update.records[4].share_id == r.share_id
    assert not update.shares[r.share_id].live


def test_rejection_reason_and_unparseable_actor() -> None:
    rejected = catalog.ClaimRejected(
        namespace="team-d", name="bad", field="spec", rule="required", reason="empty"
    )
    [record] = build([env(rejected, 7, "test")], {}, {}, {}).records
    assert (record.decision, record.reason) == ("rejected", "spec: required: empty")
    assert (record.actor_kind, record.actor_name) == ("unknown", "test")


@pytest.mark.parametrize(("lease_epoch", "freed"), [(1, 2), (3, 0)])
def test_a_fence_frees_each_live_share_unless_stale(lease_epoch: int, freed: int) -> None:
    a = s.reserved("team-a", "c1", pool="node-b")
    b = s.reserved("team-b", "c2", pool="node-b")
    envs = [
        env(a, 1),
        env(b, 2),
        env(catalog.NodeFenced(node="node-b", epoch=2), 3, "operator:ops"),
    ]
    nodes = {"node-b": NodeEpochs(node="node-b", lease_epoch=lease_epoch)}
    records = build(envs, {}, {}, nodes).records
    fence = [x for x in records if x.position == 3]
    assert [x.seq for x in fence] == list(range(freed + 1))
    assert {x.namespace for x in fence[1:]} == ({"team-a", "team-b"} if freed else set())


def test_a_share_never_reserved_is_recorded_for_operators_only() -> None:
    r = s.reserved("team-a", "c1")
    [record] = build([env(s.released(r), 9)], {}, {}, {}).records
    assert (record.share_id, record.namespace, record.decision) == (
        r.share_id,
        None,
        "capacity_released",
    )
