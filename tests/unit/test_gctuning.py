"""The collector settings of the service processes."""

from __future__ import annotations

import contextlib
import functools
import gc
import subprocess
import sys
import weakref
from collections.abc import Iterator

from services.runtime.ground.gctuning import (
    REWALK_S,
    THRESHOLDS,
    _SurvivorFreezer,
    freeze_survivors,
    long_lived_state,
    tune_for_long_lived_state,
)

CPYTHON_DEFAULT = (700, 10, 10)


@contextlib.contextmanager
def installed(now: list[float]) -> Iterator[_SurvivorFreezer]:
    """A freezer on the clock ``now[0]``, in ``gc.callbacks`` while inside; on the way
    out everything is unfrozen, as the process found it."""
    freezer = _SurvivorFreezer(clock=lambda: now[0])
    gc.callbacks.append(freezer)
    try:
        yield freezer
    finally:
        gc.callbacks.remove(freezer)
        gc.unfreeze()


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
    finally:
        undo()
    assert gc.get_freeze_count() == 0  # everything is walked again
    assert not any(isinstance(c, _SurvivorFreezer) for c in gc.callbacks)


def test_the_long_lived_settings_are_undone_on_the_way_out() -> None:
    before = gc.get_threshold()
    gc.set_threshold(*CPYTHON_DEFAULT)
    callbacks = list(gc.callbacks)
    try:
        with long_lived_state():
            assert gc.get_threshold() == THRESHOLDS
            assert gc.get_freeze_count() > 0  # the first walk's survivors
            assert any(isinstance(c, _SurvivorFreezer) for c in gc.callbacks)
        assert gc.get_threshold() == CPYTHON_DEFAULT
        assert gc.callbacks == callbacks
        assert gc.get_freeze_count() == 0
    finally:
        gc.set_threshold(*before)


def test_frozen_cycles_are_collected_once_the_rewalk_interval_has_passed() -> None:
    class Node:
        def __init__(self) -> None:
            self.other: Node | None = None

    now = [0.0]
    with installed(now) as freezer:
        gc.collect()  # walks everything; its survivors are frozen
        first, second = Node(), Node()
        first.other, second.other = second, first
        alive = weakref.ref(first)
        gc.collect()  # the cycle survives (still referenced): frozen
        del first, second
        now[0] = REWALK_S - 1
        gc.collect()
        assert alive() is not None  # a frozen cycle is not walked
        assert freezer.rewalks == 0
        now[0] = REWALK_S
        gc.collect()  # the interval has passed: the frozen set is handed back
        assert freezer.rewalks == 1
        gc.collect()
        assert alive() is None  # the walk of everything collected the cycle
        assert gc.get_freeze_count() > 0  # and froze what it left


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
