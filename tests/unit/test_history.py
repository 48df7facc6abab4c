"""What ``dracap replay diff`` and ``timeline`` say changed in a record."""

from __future__ import annotations

from events.fold import ClaimState, ClusterState
from services.replay.history import field_changes, find_entity


def test_a_mapping_that_gains_a_key_is_that_key_added() -> None:
    # a device's first share: its consumption goes from {} to {memory: ...}
    before = {"consumed_nanos": {}, "live_shared": 0}
    after = {"consumed_nanos": {"memory": 10}, "live_shared": 1}
    assert field_changes(before, after) == {
        "consumed_nanos.memory": (None, 10),
        "live_shared": (0, 1),
    }
    assert field_changes(after, before) == {
        "consumed_nanos.memory": (10, None),
        "live_shared": (1, 0),
    }


def _claims(*keys: tuple[str, str]) -> ClusterState:
    state = ClusterState()
    for namespace, name in keys:
        state.claims[(namespace, name)] = ClaimState(namespace=namespace, name=name, phase="ready")
    return state


def test_a_claim_is_found_by_its_name_alone_when_no_other_namespace_has_it() -> None:
    state = _claims(("tenant-a", "train"), ("tenant-a", "infer"), ("tenant-b", "infer"))
    found = find_entity(state, "train")
    assert found is not None and (found.kind, found.key) == ("claim", "tenant-a/train")
    assert find_entity(state, "claim:train") == found
    assert find_entity(state, "infer") is None  # two namespaces: say which
    found = find_entity(state, "tenant-b/infer")
    assert found is not None and found.key == "tenant-b/infer"
