"""The collector settings of the service processes."""

from __future__ import annotations

import gc

from services.runtime.gctuning import THRESHOLDS, tune_for_long_lived_state


def test_tuning_sets_the_thresholds_and_returns_the_previous_ones() -> None:
    before = gc.get_threshold()
    try:
        assert tune_for_long_lived_state() == before
        assert gc.get_threshold() == THRESHOLDS
        young, _, _ = THRESHOLDS
        assert young > before[0]  # fewer young collections than CPython's default
        assert gc.isenabled()  # cycles are still collected
    finally:
        gc.set_threshold(*before)
