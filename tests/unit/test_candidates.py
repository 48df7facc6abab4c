"""The max-trees of candidate lists: :func:`first_fit` against a plain scan."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.reservation.candidates import UNUSABLE, MaxTree, first_fit


def _scan(columns: list[list[int]], thresholds: list[int], start: int) -> int:
    for pos in range(start, len(columns[0])):
        if all(col[pos] >= t for col, t in zip(columns, thresholds, strict=True)):
            return pos
    return -1


@given(
    st.data(),
    st.integers(min_value=1, max_value=3),
    st.lists(st.integers(min_value=UNUSABLE, max_value=7), min_size=3, max_size=3),
)
def test_first_fit_is_the_leftmost_position_that_passes_every_tree(
    data: st.DataObject, trees: int, thresholds: list[int]
) -> None:
    count = data.draw(st.integers(min_value=1, max_value=40))
    column = st.lists(st.integers(min_value=UNUSABLE, max_value=6), min_size=count, max_size=count)
    columns = [data.draw(column) for _ in range(trees)]
    start = data.draw(st.integers(min_value=0, max_value=count + 1))
    built = [MaxTree(c) for c in columns]
    pairs = list(zip(built, thresholds[:trees], strict=True))
    assert first_fit(pairs, start, count) == _scan(columns, thresholds[:trees], start)


@pytest.mark.parametrize("trees", [1, 2, 3])
def test_first_fit_follows_updates(trees: int) -> None:
    rng = random.Random(trees)
    count = 300
    columns = [[rng.randint(UNUSABLE, 9) for _ in range(count)] for _ in range(trees)]
    built = [MaxTree(c) for c in columns]
    for _ in range(2000):
        column = rng.randrange(trees)
        pos = rng.randrange(count)
        columns[column][pos] = rng.randint(UNUSABLE, 9)
        built[column].set(pos, columns[column][pos])
        thresholds = [rng.randint(0, 9) for _ in range(trees)]
        start = rng.randrange(count)
        pairs = list(zip(built, thresholds, strict=True))
        assert first_fit(pairs, start, count) == _scan(columns, thresholds, start)
