"""The growth table of ``benchmarks/pipeline.py --live`` and the pace it reports."""

from __future__ import annotations

import pytest

from benchmarks import pipeline
from benchmarks.pace import Pace


def _phase(
    live: int, throughput: float, pace_ms: float, after_ms: float = 0.0, bench: float = 0.0
) -> pipeline.Phase:
    return pipeline.Phase(
        live=live,
        fill_rate=0.0,
        p50_at_rate=10.0,
        p99_at_rate=20.0,
        throughput=throughput,
        half_rate=throughput / 2,
        p50_at_half=50.0,
        p99_at_half=100.0,
        pace_ms=pace_ms,
        pace_after_ms=after_ms or pace_ms,
        split_sustained={"bench": bench} if bench else {},
    )


def test_the_report_gives_each_phases_pace_and_its_change(
    capsys: pytest.CaptureFixture[str],
) -> None:
    phases = [_phase(0, 800.0, 60.0, 62.0), _phase(100_000, 600.0, 90.0, 93.0)]
    pipeline.report_growth(phases, 3000.0, 50)
    out = capsys.readouterr().out
    assert "pace" in out.splitlines()[2], out  # the table's header
    assert "  60/62  " in out and "  90/93  " in out, out
    assert "sustained throughput      -25.0 %" in out, out
    assert "the machine's pace        +50.0 %" in out, out  # 61 -> 91.5 ms


def test_the_report_gives_the_load_generators_change(
    capsys: pytest.CaptureFixture[str],
) -> None:
    phases = [_phase(0, 800.0, 60.0, bench=0.14), _phase(100_000, 500.0, 60.0, bench=0.245)]
    pipeline.report_growth(phases, 3000.0, 50)
    out = capsys.readouterr().out
    assert "the load generator        +75.0 %" in out, out
    assert "the machine's pace         +0.0 %" in out, out


def test_no_pace_change_is_claimed_without_a_pace(capsys: pytest.CaptureFixture[str]) -> None:
    pipeline.report_growth([_phase(0, 800.0, 0.0), _phase(100_000, 600.0, 0.0)], 3000.0, 50)
    out = capsys.readouterr().out
    assert "the machine's pace" not in out and "the load generator" not in out, out


def test_the_pace_times_the_same_fold() -> None:
    pace = Pace(events=500)
    assert pace.measure(samples=3) > 0
    assert pace.sample() > 0


@pytest.mark.parametrize("bad", [0, -1])
def test_a_pace_refuses_counts_below_one(bad: int) -> None:
    with pytest.raises(ValueError, match="events"):
        Pace(events=bad)
    with pytest.raises(ValueError, match="samples"):
        Pace(events=10).measure(samples=bad)
