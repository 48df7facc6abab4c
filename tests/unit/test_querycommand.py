"""``dracap audit`` / ``dracap usage`` plumbing: times and output formats."""

from __future__ import annotations

import pytest

from services.commands.querying import emit, parse_time
from services.exitcodes import CommandError, ExitCode


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, None),
        ("2026-12-01T10:00:00Z", "2026-12-01T10:00:00+00:00"),
        ("2026-12-01T10:00:00", "2026-12-01T10:00:00+00:00"),  # no zone: UTC
        ("2026-12-01T11:00:00+01:00", "2026-12-01T10:00:00+00:00"),
        ("2026-12-01", "2026-12-01T00:00:00+00:00"),
    ],
)
def test_times_are_iso_8601_in_utc(text: str | None, expected: str | None) -> None:
    assert parse_time("--since", text) == expected


@pytest.mark.parametrize("text", ["yesterday", "1h", "", "2026-13-01"])
def test_a_bad_time_is_one_line_naming_the_flag(text: str) -> None:
    with pytest.raises(CommandError) as refused:
        parse_time("--from", text)
    assert refused.value.exit_code == ExitCode.BAD_INPUT
    assert str(refused.value).startswith("--from: must be an ISO 8601 time")
    assert "\n" not in str(refused.value)


ROWS = [{"namespace": "a", "amounts": {"memory": "1Gi"}, "open": True, "extra": 1}]


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("table", "NAMESPACE  AMOUNTS     OPEN\na          memory=1Gi  true"),
        ("csv", "namespace,amounts,open\na,memory=1Gi,true"),  # as JSON writes it
    ],
)
def test_table_and_csv_show_the_columns(output: str, expected: str) -> None:
    assert emit(output, ROWS, ("namespace", "amounts", "open")) == expected


def test_json_keeps_every_field() -> None:
    assert '"extra": 1' in emit("json", ROWS, ("namespace",))
