"""The event ids dracap mints (events/uuids.py): version 7 UUIDs, in the order they were made."""

from __future__ import annotations

import itertools
import time
import uuid

from events.uuids import time_ordered_uuid, time_ordered_uuids


def test_they_are_canonical_version_7_uuids() -> None:
    for text in [*time_ordered_uuids(500), time_ordered_uuid()]:
        parsed = uuid.UUID(text)
        assert str(parsed) == text  # canonical, lower-case text: what Postgres stores
        assert parsed.version == 7
        assert parsed.variant == uuid.RFC_4122


def test_their_first_48_bits_are_the_unix_time_in_milliseconds() -> None:
    before = time.time_ns() // 1_000_000
    made = uuid.UUID(time_ordered_uuid()).int >> 80
    after = time.time_ns() // 1_000_000
    assert before <= made <= after


def test_ids_minted_in_later_milliseconds_sort_after_the_earlier_ones() -> None:
    # What keeps an index's inserts at its right edge: random (version 4) ids fail this.
    minted: list[str] = []
    for _ in range(20):
        minted.extend(time_ordered_uuids(5))
        stamp = time.time_ns() // 1_000_000
        while time.time_ns() // 1_000_000 == stamp:
            pass
    batches = [minted[i : i + 5] for i in range(0, len(minted), 5)]
    for earlier, later in itertools.pairwise(batches):
        assert max(earlier) < min(later)


def test_they_do_not_repeat() -> None:
    minted = time_ordered_uuids(100_000)
    assert len(set(minted)) == len(minted)
