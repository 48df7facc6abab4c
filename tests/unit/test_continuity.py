"""What a reader keeps of the rows it read (``services/runtime/store/continuity.py``):
the newest ``KEPT``, whatever the pages' sizes, and nothing when told to forget."""

from __future__ import annotations

from services.runtime.store.continuity import KEPT, Continuity


def _page(first: int, count: int) -> list[tuple[int, str]]:
    return [(p, f"id-{p}") for p in range(first, first + count)]


def test_it_keeps_the_newest_rows_read_whatever_the_pages() -> None:
    kept = Continuity()
    assert kept.last() == [] and not kept.due(5)
    position = 0
    for size in (3, KEPT // 2, 1, KEPT + 7, 2, KEPT // 3):
        kept.saw(_page(position + 1, size))  # type: ignore[arg-type]
        position += size
        newest = _page(max(1, position - KEPT + 1), min(KEPT, position))
        assert kept.last() == newest


def test_rows_are_due_for_a_check_after_a_new_session_until_checked() -> None:
    kept = Continuity()
    kept.saw(_page(1, 2))  # type: ignore[arg-type]
    assert kept.due(1)
    kept.checked = 1
    assert not kept.due(1)
    assert kept.due(2)
    kept.forget()
    assert kept.last() == [] and not kept.due(3)
