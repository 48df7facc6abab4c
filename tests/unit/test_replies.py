"""Replies in parts: split by the server's max_payload, joined by the requester."""

from __future__ import annotations

import pytest

from services.runtime.bus.replies import (
    HEADROOM,
    MAX_REPLY_PARTS,
    PART_HEADER,
    Assembly,
    ReplyPartError,
    split,
)

MAX_PAYLOAD = 1024 + HEADROOM  # a budget of 1 KiB per message


def test_a_reply_that_fits_is_one_message_without_headers() -> None:
    data = b"x" * 1024
    assert split(data, MAX_PAYLOAD) == [(data, None)]
    assert Assembly().add(data, None) == data


def test_a_larger_reply_goes_in_numbered_parts_and_comes_back_whole() -> None:
    data = bytes(range(256)) * 10  # 2,560 bytes: three parts
    messages = split(data, MAX_PAYLOAD)
    assert messages is not None
    assert [h for _, h in messages] == [{PART_HEADER: f"{i}/3"} for i in (1, 2, 3)]
    assert all(len(d) <= MAX_PAYLOAD - HEADROOM for d, _ in messages)
    assembly = Assembly()
    out = [assembly.add(d, h) for d, h in messages]
    assert out[:2] == [None, None]
    assert out[2] == data


def test_a_reply_of_more_parts_than_allowed_is_not_split() -> None:
    budget = MAX_PAYLOAD - HEADROOM
    messages = split(b"x" * (budget * MAX_REPLY_PARTS), MAX_PAYLOAD)
    assert messages is not None and len(messages) == MAX_REPLY_PARTS
    assert split(b"x" * (budget * MAX_REPLY_PARTS + 1), MAX_PAYLOAD) is None


@pytest.mark.parametrize(
    ("received", "complaint"),
    [
        ([("2/3", b"b")], "expected part 1"),
        ([("1/3", b"a"), ("3/3", b"c")], "expected part 2"),
        ([("1/3", b"a"), ("2/4", b"b")], "has 3 parts"),
        ([("1/1", b"a")], "2 to 64 parts"),
        ([("1/65", b"a")], "2 to 64 parts"),
        ([("one/two", b"a")], "is not <index>/<count>"),
        ([("1/2", b"a"), (None, b"whole")], "a whole reply arrived after part 1"),
    ],
)
def test_a_part_out_of_place_is_refused(
    received: list[tuple[str | None, bytes]], complaint: str
) -> None:
    assembly = Assembly()
    *before, (part, data) = received
    for earlier, chunk in before:
        assert assembly.add(chunk, {PART_HEADER: earlier} if earlier is not None else None) is None
    with pytest.raises(ReplyPartError, match=complaint):
        assembly.add(data, {PART_HEADER: part} if part is not None else None)
