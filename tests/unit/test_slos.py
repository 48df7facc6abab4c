"""Service-level metrics derived from the folded log (no servers: a log in memory)."""

from __future__ import annotations

import datetime
from typing import Any

from events import catalog as c
from events.fold import ClusterState, apply
from services.runtime.metrics import REGISTRY
from services.runtime.slos import SloTracker
from tests.unit.decision_fixtures import NODE, Log, gpu, inventory, memory_claim

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


class _Live:
    """What the tracker reads of a LiveState: the folded state."""

    def __init__(self) -> None:
        self.state = ClusterState()


def _feed(tracker: SloTracker, live: _Live, log: Log, start: int, seconds: float) -> None:
    """Fold and hand over the envelopes from ``start``, recorded ``seconds`` after T0."""
    for env in log.envelopes[start:]:
        stamped = c.Envelope(
            **{f: getattr(env, f) for f in c.Envelope.__struct_fields__ if f != "recorded_at"},
            recorded_at=T0 + datetime.timedelta(seconds=seconds),
        )
        apply(live.state, stamped)
        tracker.observe(stamped)


def _sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def _gauges(tracker: SloTracker) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for family in tracker.collect():
        for sample in family.samples:
            out[(sample.name, sample.labels["class"])] = sample.value
    return out


def test_convergence_unconverged_claims_and_unknown_shares() -> None:
    live = _Live()
    now = [T0]
    tracker = SloTracker(live, now=lambda: now[0])  # type: ignore[arg-type]
    log = Log(*inventory(gpu()))
    log.add(c.NodeLeaseAcquired(node=NODE, epoch=1, boot_id="b", ttl_ms=10_000))
    _feed(tracker, live, log, 0, 0)
    cls = "gpu.test.io"
    before: Any = _sample("dracap_claim_convergence_seconds_count", **{"class": cls}) or 0.0

    start = len(log.envelopes)
    log.reserve(memory_claim("train", "10Gi"))
    _feed(tracker, live, log, start, 1.0)
    now[0] = T0 + datetime.timedelta(seconds=4)
    assert _gauges(tracker)[("dracap_unconverged_claims", cls)] == 1
    assert _gauges(tracker)[("dracap_unconverged_claim_oldest_age_seconds", cls)] == 3.0

    [share] = live.state.claim("tenant-a", "train").share_ids  # type: ignore[union-attr]
    start = len(log.envelopes)
    log.add(c.LimitApplied(share_id=share, node=NODE, level="none", actual={}))
    _feed(tracker, live, log, start, 1.5)
    after = _sample("dracap_claim_convergence_seconds_count", **{"class": cls})
    assert after == before + 1, "one claim converged"
    assert _gauges(tracker) == {}, "nothing pending any more"

    start = len(log.envelopes)
    log.add(c.NodeLeaseExpired(node=NODE, epoch=1))
    _feed(tracker, live, log, start, 10.0)
    now[0] = T0 + datetime.timedelta(seconds=25)
    assert _gauges(tracker)[("dracap_unknown_shares", cls)] == 1
    assert _gauges(tracker)[("dracap_unknown_share_oldest_age_seconds", cls)] == 15.0

    fenced_before = _sample("dracap_node_recovery_seconds_count", outcome="fenced") or 0.0
    start = len(log.envelopes)
    log.add(c.NodeFenced(node=NODE, epoch=1, reason="test"))
    _feed(tracker, live, log, start, 40.0)
    assert _sample("dracap_node_recovery_seconds_count", outcome="fenced") == fenced_before + 1
    assert _gauges(tracker) == {}, "the fence released the unknown share"


def test_free_capacity_below_a_devices_smallest_grant_is_stranded() -> None:
    from services.runtime.gauges import stranded_ratios
    from tests.unit.allocator_fixtures import device
    from tests.unit.decision_fixtures import memory_claim as claim_of

    policy = {"default": "10Gi", "validRange": {"min": "10Gi"}}
    log = Log(*inventory(device("gpu-0", {"memory": ("40Gi", policy)})))
    log.reserve(claim_of("big", "32Gi"))
    state = log.state()
    [key] = list(state.devices)
    members = {"gpu.test.io": [key]}
    assert stranded_ratios(state, members) == {("gpu.test.io", "memory"): 8 / 40}
    fits = Log(*inventory(device("gpu-0", {"memory": ("40Gi", policy)})))
    fits.reserve(claim_of("half", "20Gi"))
    assert stranded_ratios(fits.state(), members) == {("gpu.test.io", "memory"): 0.0}
