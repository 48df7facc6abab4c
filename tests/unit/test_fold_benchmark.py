"""``benchmarks.fold``: the timed events follow the untimed history (``--history``).

The benchmark's figure (docs/services.md, "What a bigger state costs the fold") compares
the same work per event on a small state and on one that N events of history left
bigger; these tests hold it to that: the history is folded into the state the timed
events are folded on, and bad sizes are refused with the rule, not a traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.fold import measure

ROOT = Path(__file__).resolve().parents[2]


def test_the_history_is_folded_before_the_timed_events() -> None:
    seconds, with_history = measure(1_000, history=3_000, rounds=1)
    _, all_timed = measure(4_000, rounds=1)
    _, without = measure(1_000, rounds=1)
    assert seconds > 0
    assert with_history == all_timed  # the same state as folding all 4,000
    assert with_history > without  # and bigger than the timed events' alone


def test_sizes_out_of_range_are_refused_with_the_rule() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.fold", "100", "--history", "-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--history at least 0" in done.stderr
    assert "Traceback" not in done.stderr
