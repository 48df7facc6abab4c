"""Billing's pure computations: hours, segments, and the share state machine."""

from __future__ import annotations

import datetime
from decimal import Decimal

import pytest

from events import catalog
from events.catalog import Event
from events.envelopes import Envelope, new_envelope
from services.billing.usage import (
    BillingShare,
    NodeEpochs,
    Segment,
    apply,
    display,
    hourly,
    usage_rows,
)
from tests.integration import sample as s

T0 = datetime.datetime(2026, 12, 1, 9, 30, tzinfo=datetime.UTC)
GI = 2**30


def at(minutes: float) -> datetime.datetime:
    return T0 + datetime.timedelta(minutes=minutes)


def env(event: Event, position: int, minutes: float) -> Envelope:
    return new_envelope(
        event, stream_version=1, actor="system:test", position=position, recorded_at=at(minutes)
    )


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        (0, 0, []),
        (10, 5, []),
        (0, 20, [(9, 20 * 60_000_000)]),
        (0, 30, [(9, 30 * 60_000_000)]),
        (0, 45, [(9, 30 * 60_000_000), (10, 15 * 60_000_000)]),
        (30, 150, [(10, 3_600_000_000), (11, 3_600_000_000)]),
        (25, 95, [(9, 5 * 60_000_000), (10, 3_600_000_000), (11, 5 * 60_000_000)]),
    ],
)
def test_hourly_cuts_at_hour_boundaries(
    start: float, end: float, expected: list[tuple[int, int]]
) -> None:
    got = hourly(at(start), at(end))
    assert [(h.hour, us) for h, us in got] == expected
    assert all(h.minute == 0 and h.second == 0 for h, _ in got)


def test_usage_rows_sum_exactly_per_hour_and_state() -> None:
    segment = Segment(
        namespace="a",
        device_class="gpu",
        amounts={"memory": 10 * GI * 10**9},
        state="held",
        start=at(0),
        end=at(90),
    )
    rows = usage_rows([segment, segment])
    assert [(r.hour.hour, r.unit_seconds) for r in rows] == [
        (9, Decimal(2 * 10 * GI * 1800)),
        (10, Decimal(2 * 10 * GI * 3600)),
    ]
    amount, unit = display("memory", sum((r.unit_seconds for r in rows), Decimal(0)))
    assert (amount, unit) == (Decimal(30), "GiB-hours")  # 2 x 10 GiB x 1.5 h


def _share(state: str = "held") -> BillingShare:
    return BillingShare(
        share_id="s1",
        namespace="a",
        device_class="gpu",
        node="n1",
        amounts={"memory": GI * 10**9},
        billed=True,
        state=state,  # type: ignore[arg-type]
        since=at(0),
        position=1,
    )


def _segments(envs: list[Envelope], shares: dict[str, BillingShare]) -> list[tuple[str, int]]:
    update = apply(envs, {}, shares, {})
    return [(g.state, int((g.end - g.start).total_seconds() // 60)) for g in update.segments]


@pytest.mark.parametrize(
    ("events", "expected", "final"),
    [
        ([catalog.ShareMarkedUnknown(share_id="s1", node="n1")], [("held", 10)], "unknown"),
        (
            [
                catalog.ShareMarkedUnknown(share_id="s1", node="n1"),
                catalog.ShareConfirmed(share_id="s1", node="n1"),
            ],
            [("held", 10), ("unknown", 10)],
            "held",
        ),
        ([catalog.NodeLeaseExpired(node="n1", epoch=1)], [("held", 10)], "unknown"),
        (
            [catalog.NodeLeaseExpired(node="n1", epoch=1), catalog.NodeFenced(node="n1", epoch=1)],
            [("held", 10), ("unknown", 10)],
            "closed",
        ),
        ([catalog.ShareConfirmed(share_id="s1", node="n1")], [], "held"),  # not unknown: nothing
    ],
)
def test_share_state_machine(
    events: list[Event], expected: list[tuple[str, int]], final: str
) -> None:
    envs = [env(e, 2 + i, 10 * (i + 1)) for i, e in enumerate(events)]
    update = apply(envs, {}, {"s1": _share()}, {})
    assert [(g.state, int((g.end - g.start).total_seconds() // 60)) for g in update.segments] == (
        expected
    )
    assert update.shares.get("s1", _share()).state == final


def test_stale_fence_and_old_positions_change_nothing() -> None:
    nodes = {"n1": NodeEpochs(node="n1", lease_epoch=3)}
    fence = env(catalog.NodeFenced(node="n1", epoch=2), 5, 10)
    assert apply([fence], {}, {"s1": _share()}, nodes).segments == []
    r = s.reserved("a", "c", share_id="s1", pool="n1")
    release = env(s.released(r), 1, 10)  # at or before the share's last applied position
    assert apply([release], {}, {"s1": _share()}, {}).segments == []


def test_reservation_to_release_bills_the_claims_class_and_not_admin_shares() -> None:
    r = s.reserved("a", "c1", consumed="2Gi", pool="n1")
    admin = s.reserved("a", "c2", consumed="80Gi", pool="n1", admin=True)
    envs = [
        env(s.claim_submitted("a", "c1"), 1, 0),
        env(s.claim_submitted("a", "c2"), 2, 0),
        env(r, 3, 0),
        env(admin, 4, 0),
        env(s.released(r), 5, 60),
        env(s.released(admin), 6, 60),
    ]
    rows = apply(envs, {}, {}, {}).usage()
    assert [(x.device_class, x.state, x.unit_seconds) for x in rows] == [
        ("gpu.example.com", "held", Decimal(2 * GI * 1800)),
        ("gpu.example.com", "held", Decimal(2 * GI * 1800)),
    ]


def test_a_log_written_by_hand_never_stops_billing() -> None:
    r = s.reserved("a", "c1", pool="n1")
    opened = apply([env(r, 3, 0)], {}, {}, {})  # the claim was never submitted
    assert opened.shares[r.share_id].device_class == ""
    assert apply([env(s.released(r), 4, 0)], {}, {}, {}).segments == []  # never reserved


@pytest.mark.parametrize(
    ("number", "text"),
    [
        (Decimal("1.62E+11"), "162000000000"),
        (Decimal("0E-6"), "0"),
        (Decimal("1.500000"), "1.5"),
        (Decimal("12.000001"), "12.000001"),
        (Decimal(100), "100"),
    ],
)
def test_usage_numbers_are_plain_decimals(number: Decimal, text: str) -> None:
    from services.billing.service import plain

    assert plain(number) == text
