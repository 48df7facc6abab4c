"""What ``dracap replay diff`` and ``timeline`` say changed in a record."""

from __future__ import annotations

import pytest

from events.state import ClaimState, ClusterState, DeviceState
from services.replay.history import AmbiguousNameError, field_changes, find_entity


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
    with pytest.raises(AmbiguousNameError) as two:  # two namespaces: say which
        find_entity(state, "infer")
    assert "claim:tenant-a/infer" in str(two.value) and "claim:tenant-b/infer" in str(two.value)
    found = find_entity(state, "tenant-b/infer")
    assert found is not None and found.key == "tenant-b/infer"
    assert find_entity(state, "nothing") is None


def _devices(state: ClusterState, *keys: tuple[str, str, str]) -> ClusterState:
    for driver, pool, name in keys:
        state.devices[(driver, pool, name)] = DeviceState(driver=driver, pool=pool, name=name)
    return state


def test_a_device_is_found_as_dracap_devices_prints_it() -> None:
    state = _devices(ClusterState(), ("gpu.io", "node-a-gpus", "gpu-0"), ("gpu.io", "b", "gpu-1"))
    for text in ("node-a-gpus/gpu-0", "gpu.io/node-a-gpus/gpu-0", "gpu-0", "device:gpu-0"):
        found = find_entity(state, text)
        assert found is not None and (found.kind, found.key) == (
            "device",
            "gpu.io/node-a-gpus/gpu-0",
        )


def test_a_name_several_objects_answer_to_is_ambiguous_not_missing() -> None:
    state = _devices(
        _claims(("tenant-a", "gpu-0")),
        ("gpu.io", "node-a-gpus", "gpu-0"),
        ("gpu.io", "node-b-gpus", "gpu-0"),
    )
    with pytest.raises(AmbiguousNameError) as both:
        find_entity(state, "gpu-0")
    assert [c.key for c in both.value.candidates] == [
        "gpu.io/node-a-gpus/gpu-0",
        "gpu.io/node-b-gpus/gpu-0",
        "tenant-a/gpu-0",
    ]
    found = find_entity(state, "claim:gpu-0")  # a prefix chooses
    assert found is not None and found.key == "tenant-a/gpu-0"
    found = find_entity(state, "node-b-gpus/gpu-0")
    assert found is not None and found.key == "gpu.io/node-b-gpus/gpu-0"
