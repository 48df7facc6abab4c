"""When the snapshot writer writes: an interval that grows with the state (issue 25).

A snapshot is the whole state, so a write costs in proportion to the records it holds.
At a fixed interval that was a cost per event that grew with the claims live; the
interval now grows with the records (``snapshots.interval``), so the records encoded
per event folded stay bounded whatever the state, while the events a start after a
crash folds stay a bounded multiple of the records it loads. A due snapshot waits for a
check that finds the state quiet (a lull), at most until it is twice due. The writer's
rules are run here on a state grown by hand, on a fake clock: work counted in records,
not timed.
"""

from __future__ import annotations

from events.state import ClusterState
from services.runtime.store.snapshots import (
    EVENTS_PER_RECORD,
    EVERY_EVENTS,
    EVERY_SECONDS,
    LULL_EVENTS,
    OVERDUE,
    SnapshotWriter,
    interval,
    snapshot_records,
)
from tests.fixtures.clock import FakeClock
from tests.unit.test_snapshot_encoding import _state


def _writer(state: ClusterState) -> SnapshotWriter:
    # the time rule never fires: the clock does not move
    return SnapshotWriter(None, lambda: state, clock=FakeClock())  # type: ignore[arg-type]


def test_a_small_state_is_written_every_25000_events_as_before() -> None:
    state, _ = _state(10)
    writer = _writer(state)
    assert snapshot_records(state) < 100
    state.position = EVERY_EVENTS - 1
    assert not writer.due()
    state.position = EVERY_EVENTS
    assert writer.due()


def test_a_large_state_waits_half_an_event_per_record() -> None:
    state, _ = _state(1)
    share = next(iter(state.shares.values()))
    state.shares = {f"s{i}": share for i in range(200_000)}
    records = snapshot_records(state)
    assert records >= 200_000 and interval(records) == int(records * EVENTS_PER_RECORD)
    writer = _writer(state)
    state.position = EVERY_EVENTS  # due at a fixed 25,000: 8 writes of the state per interval
    assert not writer.due()
    state.position = interval(records)
    assert writer.due()


def test_the_records_encoded_per_event_stay_bounded_as_the_state_grows() -> None:
    """Two million events, each claim two records (claim, share) every four events: the
    records encoded per event folded stay under 1 / EVENTS_PER_RECORD (with a fixed
    25,000 they grew with the state, to ~20 per event here), and the events folded
    after a crash under one interval of the state's size."""
    state, _ = _state(1)
    share = next(iter(state.shares.values()))
    shares: dict[str, object] = {}
    state.shares = shares  # type: ignore[assignment]
    writer = _writer(state)
    step, encoded, writes, worst_gap = 1_000, 0, 0, 0.0
    for position in range(step, 2_000_001, step):
        for i in range(len(shares), position // 2):  # two records per four events
            shares[f"s{i}"] = share
        state.position = position
        records = snapshot_records(state)
        worst_gap = max(worst_gap, (position - writer.last_position) / interval(records))
        if writer.due():  # written: what maybe_write does, less the database
            encoded += records
            writes += 1
            writer.last_position = position
    assert writes > 5
    assert encoded / state.position <= 1 / EVENTS_PER_RECORD
    assert worst_gap <= 1.0 + step / EVERY_EVENTS  # never more than an interval unsaved


def test_a_due_snapshot_waits_for_a_lull_at_most_until_it_is_overdue() -> None:
    state, _ = _state(10)
    writer = _writer(state)
    step = EVERY_EVENTS // 10  # the events folded between two checks: never a lull
    state.position = 0
    writes = []
    while not writes:
        state.position += step
        if writer.to_write():
            writes.append(state.position)
    assert writes == [OVERDUE * EVERY_EVENTS]  # due at 25,000; written at twice that
    writer.last_position = state.position
    state.position += EVERY_EVENTS  # due again, folded since the check before
    assert not writer.to_write()
    state.position += LULL_EVENTS  # a check that found the state quiet: written
    assert writer.to_write()


def test_a_due_snapshot_in_a_lull_is_written_at_once_and_none_before_it_is_due() -> None:
    state, _ = _state(10)
    writer = _writer(state)
    state.position = EVERY_EVENTS - 1
    assert not writer.to_write()  # not due, however quiet
    assert not writer.to_write()
    state.position = EVERY_EVENTS + LULL_EVENTS - 1
    assert writer.to_write()  # due, and only LULL_EVENTS folded since the last check


def test_the_first_check_after_a_start_waits_one_more_check_for_a_lull() -> None:
    state, _ = _state(10)
    writer = _writer(state)
    state.position = EVERY_EVENTS  # due, nothing known of the second before
    assert not writer.to_write()
    assert writer.to_write()


def test_a_stop_writes_whatever_was_folded_since_the_last_snapshot() -> None:
    state, _ = _state(10)
    writer = _writer(state)
    state.position = 1
    assert writer.to_write(stopping=True)
    writer.last_position = 1
    assert not writer.to_write(stopping=True)


def test_the_time_rule_waits_for_a_lull_too() -> None:
    state, _ = _state(10)
    clock = FakeClock()
    writer = SnapshotWriter(None, lambda: state, clock=clock)  # type: ignore[arg-type]
    state.position = 10
    writer.to_write()
    clock.now += EVERY_SECONDS
    state.position += 1_000  # busy in the check's second
    assert not writer.to_write()
    assert writer.to_write()  # quiet since
    writer.last_position, writer.last_time = state.position, clock.monotonic()  # written
    clock.now += EVERY_SECONDS
    state.position += 1_000
    assert not writer.to_write()  # due, busy
    clock.now += EVERY_SECONDS
    state.position += 1_000
    assert writer.to_write()  # twice every_seconds: overdue, busy or not
