"""Service-level metrics derived from the folded log (no servers: a log in memory)."""

from __future__ import annotations

import datetime
import uuid
from typing import Any

from events import catalog as c
from events.envelopes import Envelope
from events.fold import apply, apply_event
from events.state import ClusterState
from services.enforcement.decisions import released
from services.runtime.ground.metrics import REGISTRY
from services.runtime.ops.slos import SloFold, SloTracker
from tests.unit.allocator_fixtures import device_class
from tests.unit.decision_fixtures import (
    NODE,
    Log,
    admitted,
    gpu,
    inventory,
    memory_claim,
)

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


class _Live:
    """What the tracker reads of a LiveState: the folded state."""

    def __init__(self) -> None:
        self.state = ClusterState()


def _feed(tracker: SloTracker, live: _Live, log: Log, start: int, seconds: float) -> None:
    """Fold and hand over the envelopes from ``start``, recorded ``seconds`` after T0."""
    for env in log.envelopes[start:]:
        stamped = Envelope(
            **{f: getattr(env, f) for f in Envelope.__struct_fields__ if f != "recorded_at"},
            recorded_at=T0 + datetime.timedelta(seconds=seconds),
        )
        apply(live.state, stamped)
        tracker.observe(stamped)


def _sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def _gauges(tracker: SloTracker) -> dict[tuple[str, str], float]:
    """The gauges that are not 0 (a known class's waiting claims read 0, never vanish)."""
    out: dict[tuple[str, str], float] = {}
    for family in tracker.collect():
        for sample in family.samples:
            if sample.value:
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
    from services.runtime.ops.gauges import stranded_ratios
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


def _stamped(log: Log, start: int, seconds: list[float]) -> list[Envelope]:
    """The envelopes from ``start``, the i-th recorded ``seconds[i]`` after T0."""
    return [
        Envelope(
            **{f: getattr(env, f) for f in Envelope.__struct_fields__ if f != "recorded_at"},
            recorded_at=T0 + datetime.timedelta(seconds=at),
        )
        for env, at in zip(log.envelopes[start:], seconds, strict=True)
    ]


def test_the_fold_gives_scheduling_enforcement_and_decisions_by_class() -> None:
    from services.runtime.ops.slos import Observation, SloFold

    log = Log(*inventory(gpu()))
    log.add(c.NodeLeaseAcquired(node=NODE, epoch=1, boot_id="b", ttl_ms=10_000))
    log.reserve(memory_claim("train", "10Gi"))  # submitted, admitted, reserved, bound
    [share] = log.state().claim("tenant-a", "train").share_ids  # type: ignore[union-attr]
    log.add(c.LimitApplied(share_id=share, node=NODE, level="none", actual={}))
    log.add(c.ClaimSubmitted(claim=memory_claim("huge", "1Ti")))
    log.add(c.ClaimRejected(namespace="tenant-a", name="huge", field="f", rule="r", reason=""))
    bogus = memory_claim("nowhere", "1Gi")
    bogus.spec.devices.requests[0].exactly.device_class_name = "made.up"  # type: ignore[union-attr]
    log.add(c.ClaimSubmitted(claim=bogus))
    log.add(c.ClaimRejected(namespace="tenant-a", name="nowhere", field="f", rule="r", reason=""))

    fold, state, seen = SloFold(), ClusterState(), []
    start = len(log.envelopes) - 9  # the claim's events onwards, 1 s apart
    for env in log.envelopes[:start]:
        apply(state, env)
    for env in _stamped(log, start, [float(i) for i in range(9)]):
        apply(state, env)
        seen += fold.observe(state, env.event, env.recorded_at)
    cls = "gpu.test.io"
    kinds = [(o.kind, o.label, o.outcome) for o in seen]
    assert ("decision", cls, "admitted") in kinds
    assert ("decision", cls, "rejected") in kinds
    assert ("decision", "", "rejected") in kinds, "a class nobody defined is no label"
    [scheduling] = [o for o in seen if o.kind == "scheduling"]
    [enforcement] = [o for o in seen if o.kind == "enforcement"]
    [convergence] = [o for o in seen if o.kind == "convergence"]
    # submitted at 0 s, admitted 1, reserved 2, bound 3, limit applied 4
    assert scheduling == Observation("scheduling", cls, 2.0, "allocated")
    assert enforcement == Observation("enforcement", cls, 1.0, "applied")
    assert convergence == Observation("convergence", cls, 4.0)
    assert fold.admitted == {} and fold.bound == {} and fold.pending_claims == {}
    assert fold.pending(state) == ({}, {}, {})


class _CountingSet(set[str]):
    """A node's live shares that count how often they are walked."""

    walks = 0

    def __iter__(self) -> Any:
        type(self).walks += 1
        return super().__iter__()


def test_a_share_marked_unknown_costs_that_share_not_its_node() -> None:
    """Each share is unknown since its node's expiry, and no event makes the tracker walk
    the node's live shares: it reads which shares went Unknown off the fold's journal."""
    live = _Live()
    now = [T0]
    tracker = SloTracker(live, now=lambda: now[0])  # type: ignore[arg-type]
    log = Log(*inventory(gpu()))
    log.add(c.NodeLeaseAcquired(node=NODE, epoch=1, boot_id="b", ttl_ms=10_000))
    for i in range(5):
        log.reserve(memory_claim(f"c{i}", "1Gi"))
    _feed(tracker, live, log, 0, 0)
    node = live.state.nodes[NODE]
    shares = sorted(node.live_shares)
    node.live_shares = _CountingSet(node.live_shares)
    start = len(log.envelopes)
    log.add(c.NodeLeaseExpired(node=NODE, epoch=1))
    for share in shares:
        log.add(c.ShareMarkedUnknown(share_id=share, node=NODE))
    _feed(tracker, live, log, start, 10.0)
    assert tracker.fold.unknown == {s: T0 + datetime.timedelta(seconds=10) for s in shares}
    # the fold walks them once for the expiry; the tracker never (it walked them once too)
    assert _CountingSet.walks == 1


def test_waiting_for_capacity_is_its_own_span_and_not_slow_or_unconverged() -> None:
    """A claim that does not fit: its decision is quick (scheduling 1 s), it waits for
    capacity (60 s: not unconverged meanwhile), then converges from its allocation."""
    live = _Live()
    now = [T0]
    tracker = SloTracker(live, now=lambda: now[0])  # type: ignore[arg-type]
    cls = "gpu.test.io"
    log = Log(*inventory(gpu()))
    log.add(c.NodeLeaseAcquired(node=NODE, epoch=1, boot_id="b", ttl_ms=10_000))
    log.reserve(memory_claim("big", "40Gi"))  # the device is full
    [big] = log.state().claim("tenant-a", "big").share_ids  # type: ignore[union-attr]
    log.add(c.LimitApplied(share_id=big, node=NODE, level="none", actual={}))
    _feed(tracker, live, log, 0, 0)
    counts = {
        name: _sample(f"{name}_count", **{"class": cls}) or 0.0
        for name in (
            "dracap_scheduling_latency_seconds",
            "dracap_capacity_wait_seconds",
            "dracap_claim_convergence_seconds",
        )
    }
    sums = {name: _sample(f"{name}_sum", **{"class": cls}) or 0.0 for name in counts}

    start = len(log.envelopes)
    log.extend(admitted(memory_claim("late", "10Gi")))
    _feed(tracker, live, log, start, 1.0)
    start = len(log.envelopes)
    log.reserve()  # the round finds no capacity: ClaimUnschedulable
    assert isinstance(log.envelopes[-1].event, c.ClaimUnschedulable)
    _feed(tracker, live, log, start, 2.0)
    now[0] = T0 + datetime.timedelta(seconds=50)
    gauges = _gauges(tracker)
    assert gauges[("dracap_capacity_waiting_claims", cls)] == 1
    assert gauges[("dracap_capacity_waiting_oldest_age_seconds", cls)] == 48.0
    assert ("dracap_unconverged_claims", cls) not in gauges, "full, not stuck"

    share = live.state.shares[big]
    start = len(log.envelopes)
    log.add(released(share))
    _feed(tracker, live, log, start, 61.0)
    start = len(log.envelopes)
    log.reserve()  # capacity came back: the waiting claim is allocated
    _feed(tracker, live, log, start, 62.0)
    [late] = live.state.claim("tenant-a", "late").share_ids  # type: ignore[union-attr]
    start = len(log.envelopes)
    log.add(c.LimitApplied(share_id=late, node=NODE, level="none", actual={}))
    _feed(tracker, live, log, start, 62.5)

    def grew(name: str) -> tuple[float, float]:
        count = (_sample(f"{name}_count", **{"class": cls}) or 0.0) - counts[name]
        total = (_sample(f"{name}_sum", **{"class": cls}) or 0.0) - sums[name]
        return count, total

    assert grew("dracap_scheduling_latency_seconds") == (1, 1.0), "the decision, not the wait"
    assert grew("dracap_capacity_wait_seconds") == (1, 60.0)
    assert grew("dracap_claim_convergence_seconds") == (1, 0.5), "from its allocation"
    assert _gauges(tracker) == {}


class _Subscribable(_Live):
    """A live state a tracker can start on (``_feed`` hands it the envelopes)."""

    def subscribe(self, _listener: object) -> Any:
        return lambda: None


def _all_gauges(tracker: SloTracker) -> dict[tuple[str, str], float]:
    return {
        (sample.name, sample.labels["class"]): sample.value
        for family in tracker.collect()
        for sample in family.samples
    }


def test_a_class_has_every_series_at_zero_from_its_creation() -> None:
    """A class applied after the tracker started (an install loads its inventory after its
    services start) has its counters and histograms at 0, and each gauge reads 0 while
    nothing is pending: ``increase()`` sees the first event, panels never go empty."""
    live = _Subscribable()
    tracker = SloTracker(live, now=lambda: T0)  # type: ignore[arg-type]
    tracker.start()
    try:
        cls = f"fresh-{uuid.uuid4().hex[:8]}.test.io"  # no other test counted for it
        applied = c.DeviceClassApplied(device_class=device_class(cls), rollout="immediate")
        log = Log(applied)  # the class is applied after the start
        _feed(tracker, live, log, 0, 0)
        for outcome in ("admitted", "rejected", "unschedulable"):
            assert _sample("dracap_claim_decisions_total", outcome=outcome, **{"class": cls}) == 0
        for name in ("scheduling_latency", "capacity_wait", "claim_convergence"):
            assert _sample(f"dracap_{name}_seconds_count", **{"class": cls}) == 0, name
        gauges = _all_gauges(tracker)
        for name in (
            "dracap_unconverged_claims",
            "dracap_unconverged_claim_oldest_age_seconds",
            "dracap_unknown_shares",
            "dracap_unknown_share_oldest_age_seconds",
            "dracap_capacity_waiting_claims",
            "dracap_capacity_waiting_oldest_age_seconds",
        ):
            assert gauges[(name, cls)] == 0, name
    finally:
        tracker.stop()


def test_a_stale_expiry_or_fence_starts_and_ends_no_recovery() -> None:
    """The SLO fold reads what the fold did: an expiry or a fence older than the node's
    lease changed nothing, so it neither starts a node's loss nor ends one."""
    fold, state = SloFold(), ClusterState()
    spans: list[tuple[str, float]] = []

    def at(seconds: float, event: c.Event) -> None:
        apply_event(state, event, 0)
        seen = fold.observe(state, event, T0 + datetime.timedelta(seconds=seconds))
        spans.extend((o.label, o.value) for o in seen if o.kind == "recovery")

    at(0, c.NodeLeaseAcquired(node=NODE, epoch=1, boot_id="b", ttl_ms=1))
    at(1, c.NodeLeaseAcquired(node=NODE, epoch=2, boot_id="b", ttl_ms=1))
    at(2, c.NodeLeaseExpired(node=NODE, epoch=1))  # stale: lease 2 holds
    at(10, c.NodeLeaseExpired(node=NODE, epoch=2))
    at(11, c.NodeFenced(node=NODE, epoch=1))  # stale: the node is not fenced
    at(15, c.NodeLeaseAcquired(node=NODE, epoch=3, boot_id="b", ttl_ms=1))
    assert spans == [("returned", 5.0)]
