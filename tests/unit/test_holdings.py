"""``dracap_capacity_held``: what each tenant holds now, kept by what events touch."""

from __future__ import annotations

import copy
from typing import Any

from events import catalog as c
from events.fold import apply
from events.state import ClusterState
from services.enforcement.decisions import released
from services.runtime.ops.holdings import HeldCapacity, held_by_tenant, share_holding
from tests.unit.decision_fixtures import NODE, Log, gpu, inventory, memory_claim

GI = 2**30 * 10**9  # nanos


class _Live:
    """What the collector reads of a LiveState."""

    def __init__(self) -> None:
        self.state = ClusterState()

    def subscribe(self, _listener: Any) -> Any:
        return lambda: None

    def on_replaced(self, _listener: Any) -> None:
        return None


def _sums(held: HeldCapacity) -> dict[tuple[str, str, str], int]:
    return {k: v for k, v in held._sums.items() if v}


def test_held_capacity_follows_reservations_releases_and_fences() -> None:
    live = _Live()
    held = HeldCapacity(live)  # type: ignore[arg-type]
    log = Log(*inventory(gpu("gpu-0"), gpu("gpu-1")))
    log.add(c.NodeLeaseAcquired(node=NODE, epoch=1, boot_id="b", ttl_ms=10_000))
    log.reserve(memory_claim("a", "10Gi"), memory_claim("b", "30Gi"))
    seen = 0

    def feed() -> None:
        nonlocal seen
        for env in log.envelopes[seen:]:
            apply(live.state, env)
            held._changed(env)
        seen = len(log.envelopes)
        assert _sums(held) == {k: v for k, v in held_by_tenant(live.state).items() if v}

    feed()
    assert _sums(held) == {("tenant-a", "gpu.test.io", "memory"): 40 * GI}
    [share_a] = live.state.claim("tenant-a", "a").share_ids  # type: ignore[union-attr]
    share = live.state.shares[share_a]
    admin = copy.copy(share)
    admin.admin_access = True
    assert share_holding(live.state, admin) is None, "an administrator's share: nothing billed"
    log.add(released(share))
    feed()
    assert _sums(held) == {("tenant-a", "gpu.test.io", "memory"): 30 * GI}
    log.add(c.NodeLeaseExpired(node=NODE, epoch=1))
    feed()  # Unknown shares still hold their capacity
    assert _sums(held) == {("tenant-a", "gpu.test.io", "memory"): 30 * GI}
    log.add(c.NodeFenced(node=NODE, epoch=1, reason="off"))
    feed()
    assert _sums(held) == {}
    [family] = held.collect()
    [sample] = family.samples  # the label set that held something reads 0, not gone
    assert (sample.labels["namespace"], sample.value) == ("tenant-a", 0.0)
