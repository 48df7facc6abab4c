"""The collector settings of the service processes."""

from __future__ import annotations

import contextlib
import functools
import gc
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator

import pytest

from services.runtime.ground import gctuning
from services.runtime.ground.gctuning import (
    LULL_S,
    OVERDUE_S,
    QUIET_SHARE,
    REWALK_S,
    THRESHOLDS,
    _freeze_after_full,
    _Rewalks,
    freeze_survivors,
    long_lived_state,
    tune_for_long_lived_state,
)
from tests.fixtures.polling import until

CPYTHON_DEFAULT = (700, 10, 10)


@contextlib.contextmanager
def freezing() -> Iterator[None]:
    """Survivors of full collections frozen while inside (no rewalk thread); on the way
    out everything is unfrozen, as the process found it."""
    gc.callbacks.append(_freeze_after_full)
    try:
        yield
    finally:
        gc.callbacks.remove(_freeze_after_full)
        gc.unfreeze()


class Clocks:
    """A wall clock and a CPU clock the test moves, and the walks of everything asked."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cpu = 0.0
        self.walks: list[float] = []

    def rewalks(self) -> _Rewalks:
        return _Rewalks(clock=lambda: self.now, cpu_clock=lambda: self.cpu, walk=self.walk)

    def walk(self) -> int:
        self.walks.append(self.now)
        return 0

    def window(self, seconds: float, busy: float) -> None:
        """``seconds`` pass, of which the process used ``busy`` of a core."""
        self.now += seconds
        self.cpu += seconds * busy


def rewalker_running() -> bool:
    return any(thread.name == "dracap-gc-rewalk" for thread in threading.enumerate())


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


def test_a_full_collection_freezes_what_survived_it_until_undone() -> None:
    kept_before = [[i] for i in range(1_000)]
    undo = freeze_survivors()
    try:
        assert gc.get_freeze_count() >= len(kept_before)  # installing walks once, at once
        kept = [[i] for i in range(1_000)]  # tracked containers, like the fold's
        frozen = gc.get_freeze_count()
        gc.collect()
        assert gc.get_freeze_count() >= frozen + len(kept)
        assert rewalker_running()
    finally:
        undo()
    assert gc.get_freeze_count() == 0  # everything is walked again
    assert _freeze_after_full not in gc.callbacks
    assert not rewalker_running()


def test_the_long_lived_settings_are_undone_on_the_way_out() -> None:
    before = gc.get_threshold()
    gc.set_threshold(*CPYTHON_DEFAULT)
    callbacks = list(gc.callbacks)
    try:
        with long_lived_state():
            assert gc.get_threshold() == THRESHOLDS
            assert gc.get_freeze_count() > 0  # the first walk's survivors
            assert _freeze_after_full in gc.callbacks
        assert gc.get_threshold() == CPYTHON_DEFAULT
        assert gc.callbacks == callbacks
        assert gc.get_freeze_count() == 0
    finally:
        gc.set_threshold(*before)


def test_a_walk_of_everything_waits_until_it_is_due() -> None:
    clocks = Clocks()
    rewalks = clocks.rewalks()
    assert rewalks.step() == REWALK_S  # nothing before it is due: one wait, no polling
    clocks.window(REWALK_S - 1, busy=0.0)
    assert rewalks.step() == 1
    assert clocks.walks == []


def test_a_due_walk_waits_for_a_quiet_window() -> None:
    # Walking everything is a pause as long as the fold (0.5-2.3 s at 30,000-100,000
    # live claims): under load it held every claim in flight.
    clocks = Clocks()
    rewalks = clocks.rewalks()
    clocks.window(REWALK_S, busy=0.9)
    assert rewalks.step() == LULL_S  # due: the first window starts
    for _ in range(100):
        clocks.window(LULL_S, busy=2 * QUIET_SHARE)
        assert rewalks.step() == LULL_S
    assert clocks.walks == []
    clocks.window(LULL_S, busy=QUIET_SHARE / 2)
    assert rewalks.step() == REWALK_S
    assert clocks.walks == [clocks.now]
    assert (rewalks.in_lulls, rewalks.overdue) == (1, 0)
    clocks.window(1, busy=0.0)  # the next one is due a whole interval after this walk
    assert rewalks.step() == REWALK_S - 1


def test_a_late_step_measures_its_window_by_the_clock() -> None:
    # The thread may get the interpreter late under load: a window is as long as the
    # clock says, not LULL_S.
    clocks = Clocks()
    rewalks = clocks.rewalks()
    clocks.window(REWALK_S, busy=0.0)
    rewalks.step()
    clocks.window(4 * LULL_S, busy=2 * QUIET_SHARE * LULL_S / (4 * LULL_S))
    rewalks.step()
    assert clocks.walks == [clocks.now]  # half the quiet share of the window it was


def test_an_overdue_walk_comes_without_a_lull() -> None:
    clocks = Clocks()
    rewalks = clocks.rewalks()
    clocks.window(REWALK_S, busy=1.0)
    while clocks.now < OVERDUE_S:
        assert rewalks.step() == LULL_S
        clocks.window(LULL_S, busy=1.0)
    assert rewalks.step() == REWALK_S
    assert clocks.walks == [clocks.now]
    assert (rewalks.in_lulls, rewalks.overdue) == (0, 1)


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def a_frozen_dead_cycle() -> weakref.ref[Node]:
    """A reference cycle frozen by a full collection while referenced, unreferenced
    since (survivors must be frozen by the caller's setup); a weak reference to it."""
    first, second = Node(), Node()
    first.other, second.other = second, first
    gc.collect()  # the cycle survives (still referenced): frozen
    return weakref.ref(first)


def test_a_walk_of_everything_collects_a_frozen_cycle() -> None:
    clocks = Clocks()
    rewalks = _Rewalks(clock=lambda: clocks.now, cpu_clock=lambda: clocks.cpu)
    with freezing():
        gc.collect()  # walks everything; its survivors are frozen
        alive = a_frozen_dead_cycle()
        gc.collect()
        assert alive() is not None  # a frozen cycle is not walked
        clocks.window(REWALK_S, busy=0.0)
        rewalks.step()
        clocks.window(LULL_S, busy=0.0)
        rewalks.step()
        assert rewalks.in_lulls == 1
        assert alive() is None  # the walk of everything collected the cycle
        assert gc.get_freeze_count() > 0  # and froze what it left


async def test_the_rewalk_thread_walks_everything_once_due(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gctuning, "REWALK_S", 0.5)
    monkeypatch.setattr(gctuning, "OVERDUE_S", 0.5)  # whether this process is quiet or not
    undo = freeze_survivors()
    try:
        alive = a_frozen_dead_cycle()
        await until(lambda: alive() is None, within=60, what="the rewalk thread's walk")
    finally:
        undo()
    assert not rewalker_running()


#: a process tuned as a service grows a fold of this many "claims" (tracked objects each)
GROWN_CLAIMS = 150_000
TRACKED_PER_CLAIM = 9

_GROW = f"""
import gc
from services.runtime.ground.gctuning import freeze_survivors, tune_for_long_lived_state
tune_for_long_lived_state()
freeze_survivors()
walks = []
def walked(phase, info):  # what a full collection is about to walk: all but the frozen
    if phase == "start" and info["generation"] == 2:
        walks.append(sum(len(gc.get_objects(generation)) for generation in (0, 1, 2)))
gc.callbacks.append(walked)
fold = []
for i in range({GROWN_CLAIMS}):
    fold.append([[i] for _ in range({TRACKED_PER_CLAIM - 1})])
    for _ in range(30):
        message = [i]  # short-lived, as a service's envelopes and futures
walked_next = len(gc.get_objects())  # what the next full collection walks
print(len(walks), walked_next, max(walks))
"""


@functools.cache
def _grown() -> tuple[int, int, int]:
    """The fill of ``_GROW`` in its own interpreter (the test process's collector state
    is not a service's): full collections, what the next one walks, the longest walk."""
    result = subprocess.run(
        [sys.executable, "-c", _GROW], capture_output=True, text=True, check=True, timeout=120
    )
    full, walked_next, longest = (int(n) for n in result.stdout.split())
    return full, walked_next, longest


def test_a_growing_fold_is_walked_in_pieces_not_all_at_once() -> None:
    # The first full collection after a fill walked every claim folded since the one
    # before (1.35 s at 100,000 claims in dracap up): full collections come often enough
    # while the fold grows that each walks a part of it.
    full, walked_next, _ = _grown()
    grown = GROWN_CLAIMS * TRACKED_PER_CLAIM
    assert full >= 2, full
    assert walked_next < grown // 2, (walked_next, grown)


def test_each_full_collection_walks_a_few_young_collections_worth() -> None:
    # A full collection of 130-210 ms every ~15 s held every claim in flight in dracap
    # up at 100,000 live (third threshold 10: ~450,000 objects a walk in this fill);
    # with 0, one comes after each middle collection: ~50,000.
    full, _, longest = _grown()
    young, _, _ = THRESHOLDS
    assert full >= 20, full
    assert longest < 6 * young, longest


_EXIT = f"""
import atexit, gc, os
from services.runtime.hosting.process import run_service
exiting = []
atexit.register(exiting.append, 1)  # registered first: the last entry to run
def walked(phase, info):  # the interpreter's own full collection at exit
    if phase == "start" and info["generation"] == 2 and exiting:
        objects = sum(len(gc.get_objects(generation)) for generation in (0, 1, 2))
        os.write(1, f"{{objects}}\\n".encode())
gc.callbacks.append(walked)
fold = []
async def main():
    fold.extend([[i] for _ in range({TRACKED_PER_CLAIM - 1})] for i in range({GROWN_CLAIMS}))
    return 0
raise SystemExit(run_service(main))
"""


def test_a_service_process_does_not_walk_its_fold_as_it_exits() -> None:
    # dracap up spent 2.2-2.5 s at 100,000 live claims in the interpreter's collection at
    # exit, which walked the fold unfrozen on the way out of long_lived_state
    result = subprocess.run(
        [sys.executable, "-c", _EXIT], capture_output=True, text=True, check=True, timeout=120
    )
    walks = [int(n) for n in result.stdout.split()]
    assert walks, result.stdout + result.stderr  # the exit's collection was seen
    assert max(walks) < GROWN_CLAIMS, walks  # not the fold's 1.35 million objects
