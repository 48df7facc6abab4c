"""The fold's maps keyed by tuples stay tracked by the collector (events.state.TrackedDict).

A plain dict of ``gc=False`` Structs under tuple keys is untracked by a full collection
and tracked again, in the youngest generation, by the next insertion: every collection
after walks the whole map. These tests fail on plain dicts: after a full collection the
map is untracked, so freezing misses it, and the next claim puts it back among the young
objects.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import pytest

from events import catalog as c
from events.fold import apply_event
from events.model import ObjectMeta, ResourceClaim, ResourceClaimSpec
from events.state import ClaimState, ClusterState, TrackedDict
from events.statecodec import snapshot_decode, snapshot_encode
from services.enforcement.views import NodeView

CLAIMS = 2_000


def submitted(name: str) -> c.ClaimSubmitted:
    return c.ClaimSubmitted(
        claim=ResourceClaim(
            metadata=ObjectMeta(name=name, namespace="team-a"), spec=ResourceClaimSpec()
        )
    )


def folded(claims: int) -> ClusterState:
    state = ClusterState()
    for i in range(claims):
        apply_event(state, submitted(f"claim-{i}"), i + 1)
    return state


def made(how: str) -> ClusterState:
    """A state with claims, made each way the services make one."""
    state = folded(CLAIMS)
    if how == "fold":
        return state
    if how == "snapshot":
        return snapshot_decode(snapshot_encode(state))
    if how == "constructor":
        return ClusterState(position=state.position, claims=dict(state.claims))
    assert how == "node view"
    view = NodeView(node="node-a", position=state.position, claims=list(state.claims.items()))
    return view.state()


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """No automatic collection inside; nothing left frozen after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def young(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects(generation=0))


@pytest.mark.parametrize("how", ["fold", "snapshot", "constructor", "node view"])
def test_the_maps_keyed_by_tuples_stay_tracked_after_a_full_collection(how: str) -> None:
    state = made(how)
    assert len(state.claims) == CLAIMS
    with collector_held():
        gc.collect()
        for name in ("pools", "devices", "claims"):
            mapping = getattr(state, name)
            assert type(mapping) is TrackedDict, name
            assert gc.is_tracked(mapping), name


def test_a_frozen_claims_map_stays_frozen_when_a_claim_is_added() -> None:
    state = folded(CLAIMS)
    with collector_held():
        gc.collect()  # the survivors, the claims map among them, are the oldest now
        gc.freeze()  # what gctuning.freeze_survivors does after each full collection
        apply_event(state, submitted(f"claim-{CLAIMS}"), CLAIMS + 1)  # a fresh key tuple
        assert state.claims[("team-a", f"claim-{CLAIMS}")].phase == "submitted"
        assert not young(state.claims), "the next young collection would walk every claim"


def test_a_map_given_to_a_state_is_kept_with_its_entries() -> None:
    claim = ClaimState(namespace="team-a", name="a", phase="submitted")
    state = ClusterState(claims={("team-a", "a"): claim})
    assert state.claims == {("team-a", "a"): claim}
    assert state == ClusterState(claims=TrackedDict({("team-a", "a"): claim}))
