"""The collector settings of the service processes."""

from __future__ import annotations

import gc

from services.runtime.gctuning import THRESHOLDS, tune_for_long_lived_state

CPYTHON_DEFAULT = (700, 10, 10)


def test_tuning_sets_the_thresholds_and_returns_the_previous_ones() -> None:
    # Other tests run a service's startup in this process, which tunes the
    # collector too; start from CPython's default so the order does not matter.
    before = gc.get_threshold()
    gc.set_threshold(*CPYTHON_DEFAULT)
    try:
        assert tune_for_long_lived_state() == CPYTHON_DEFAULT
        assert gc.get_threshold() == THRESHOLDS
        young, _, _ = THRESHOLDS
        assert young > CPYTHON_DEFAULT[0]  # fewer young collections than the default
        assert gc.isenabled()  # cycles are still collected
    finally:
        gc.set_threshold(*before)
