"""What ``dracap replay diff`` and ``timeline`` say changed in a record."""

from __future__ import annotations

from services.replay.history import field_changes


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
