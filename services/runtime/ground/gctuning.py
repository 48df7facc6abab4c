"""Garbage-collector settings for processes that hold the fold in memory.

A service process keeps :class:`events.state.ClusterState` — every claim, share and
device of the log — as long-lived Python objects, and creates many short-lived ones
per message (envelopes, events, futures). With CPython's default thresholds (a young
collection every 700 net allocations, the oldest generation every ~100 young ones),
the collector runs hundreds of times per second under load, and each full collection
walks the whole fold: pauses that grow with the cluster and land on whichever request
is in flight. Measured with ``benchmarks/pipeline.py`` (3,000 claims, 2-core machine):
throughput ~300 -> ~320-336 claims/s and p99 at half that rate ~370-420 -> ~250-310 ms.

:func:`tune_for_long_lived_state` raises the young-generation threshold (fewer
young collections: short-lived objects are mostly gone by then) but keeps the middle
generation small, and makes full collections come more often than CPython's default
(below). A young collection's pause grows with the objects that survived since the
last one, and a middle one's with the survivors of all young ones since: with (50,000,
20) the middle collections walked up to a million objects and paused the event loop
for 190-360 ms, a stall that alone broke the p99 of a latency run; with (10,000, 2) the
pauses measured 2-3 ms (young) and 5-8 ms (middle) at 650 claims/s. Reference cycles
are still collected.

The other half is not creating work for the collector at all: the Structs that make
up the fold and the events (Kubernetes objects, events, envelopes, claim and share
states, grants, limits) are declared ``gc=False`` — pure data trees that never form a
reference cycle, so the collector need not track them; that took the tracked objects
per claim from ~39 to ~15.

What is left tracked still grows with what is live (the containers inside those
Structs: ~8 objects per claim of the fold), and a full collection walks all of it: the
fold of 1,000,000 events of ``benchmarks/eventlog.py``'s history is ~1.1 million tracked
objects, and one full collection of it paused the process for seconds
(``benchmarks/gcpause.py``). CPython starts one after a number of middle collections
(by default a hundred; here at the first chance, below), once the survivors promoted
since the last one reach a quarter of what it kept: in a process that lives for hours
with a large fold, a pause as long as the whole walk, that lands on every claim in
flight and grows with the cluster (issue 25). (With a hundred, in the minutes of a
``benchmarks/pipeline.py`` run with ``--live 0,20000``, ``dracap up`` made none before
its services had stopped: one at exit, 0.1-2.1 s on a loaded 2-core machine; a longer
run met one, below.)

:func:`freeze_survivors` takes the survivors out of the walk: after every full
collection it moves what survived it to the permanent generation (``gc.freeze()``), so
the next full collection walks only what survived since — a pause that grows with the
churn between two collections, not with what is live. A frozen object that dies is
still freed by its reference count (the fold is acyclic); only a *cycle* among frozen
objects that turns to garbage waits. It starts with a full collection of its own, at
startup, whose survivors are the first frozen set. It freezes only what is tracked: a
plain dict that a full collection untracked (nothing in it needed tracking) and the next
insertion tracked again is young once more, and walked by every collection until the
next full one: the fold keeps its big maps as :class:`events.state.TrackedDict` for that.

So that such garbage does not pile up, everything is walked again now and then: once
:data:`REWALK_S` (10 minutes) have passed since the last walk of everything, a thread
of the process (:class:`_Rewalks`) waits for a **lull** — a window of :data:`LULL_S`
in which the whole process used at most :data:`QUIET_SHARE` of a core — and then
unfreezes and collects everything (and freezes what it left). Under traffic that
never lets up it walks anyway once :data:`OVERDUE_S` have passed since the last walk.
A walk of everything is a pause as long as the fold is large: 0.5-2.3 s for ``dracap
up`` at 30,000-100,000 live claims on a 2-core machine. Before, the frozen set was
handed back on the clock and the next full collection walked it, whenever that came —
under load, by construction, since full collections come from allocations; and every
such walk measured (``REWALK_S`` shortened to 60 s in ``--live 0,100000`` runs of
``benchmarks/pipeline.py``) collected **nothing**: the services make no cyclic garbage
that lives long enough to be frozen. The walk stays, for a cycle that a library may
make, but where it costs fewest claims: in a lull few come. A lull says nothing of the
next second, though: a walk begun in one holds what arrives while it lasts (in a
benchmark, a 1.1 s walk begun in the pause before a run held that run's first claims).
Each walk is logged (how long, in a lull or overdue, and what it collected). A thread,
not a task of the event loop: the service commands enter :func:`long_lived_state`
before their loop starts (``dracap up`` inside it), and a walk holds the interpreter
whichever thread makes it; the thread only sleeps and reads clocks between walks.

How often a full collection comes is the third threshold: 0 here, a full collection at
the first young collection after a middle one (gated by CPython's rule above: the
survivors promoted since the last full collection must be a quarter of what it kept,
which with the survivors frozen is what that one walked). Each walks what survived
since the one before, so the rarer they are the longer each pause. With CPython's 100,
no full collection came during a whole ``--live 0,100000`` fill, and the first one after
it — in the half-rate run at 100,000 live — walked every claim folded since the start:
1.35 s (``benchmarks/pipeline.py``, a ``gc.callbacks`` probe). With 10 (one per ~330,000
net allocations) the same work came in pieces of 130-210 ms, about every 15 s under load
(one in a half-rate run is ~1-2 % of its claims held that long: the size of its p99).
With 0 the pieces are ~50,000 objects: in a ``--live 0,100000`` run the longest full
collection of ``dracap up`` 202-219 -> 54-59 ms, of the ledger process 113-149 -> 43-49
ms. The price is the collector's own work: ``dracap up``'s collections took 5.6-5.8 s
in all over that run instead of 3.6-4.1 s (~0.4 % of a core over its eight minutes), and
in a fold at full speed (``python -m benchmarks.gcpause --grow``) the collector's time
about doubles (3.1-4.3 -> 5.6-8.2 s, the fill 12-15 -> 14-19 s): young and middle
collections cost more too, not only the added full ones. Chosen for the pauses: a
latency goal of 35-50 ms cannot hold with 200 ms ones.

At exit the interpreter makes a full collection of its own; with everything unfrozen on
the way out of :func:`long_lived_state` it walked the whole fold: 2.2-2.5 s for ``dracap
up`` at 100,000 live claims (0.6-0.8 s for its ledger process), after the services had
stopped and before the process ended — inside a container's stop grace period, and
growing with the fold. :func:`freeze_at_exit`, for a process's entry point, has the
interpreter freeze everything first (an ``atexit`` entry): that collection walks
nothing, and the operating system takes the memory back.

A rule on the frozen set's size (walk everything again once it has doubled) was tried
first: the frozen set at startup is only the imports (~106,000 objects), so it would
double early, after some 13,000 claims (~8 tracked objects each), and walk them all.

:func:`long_lived_state` is both for the length of a ``with`` block, and puts the
collector back as it found it on the way out (thresholds, callbacks, nothing frozen):
a service run inside another program — a test, an embedding — leaves it untouched.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

__all__ = [
    "LULL_S",
    "OVERDUE_S",
    "QUIET_SHARE",
    "REWALK_S",
    "THRESHOLDS",
    "freeze_at_exit",
    "freeze_survivors",
    "long_lived_state",
    "tune_for_long_lived_state",
]

#: (young, middle, old) generation thresholds.
THRESHOLDS: Final = (10_000, 2, 0)
#: Seconds after a walk of everything (frozen set and all) before the next is due.
REWALK_S: Final = 600.0
#: Seconds of a window in which the process must be quiet for a due walk to start.
LULL_S: Final = 0.25
#: The most CPU (a share of one core, all threads) a quiet window may use.
QUIET_SHARE: Final = 0.1
#: Seconds after a walk of everything when the next comes whether the process is quiet or not.
OVERDUE_S: Final = 3 * REWALK_S

_log = logging.getLogger("dracap.gctuning")


def tune_for_long_lived_state() -> tuple[int, int, int]:
    """Apply :data:`THRESHOLDS`; returns the previous thresholds."""
    previous = gc.get_threshold()
    gc.set_threshold(*THRESHOLDS)
    return previous


def _freeze_after_full(phase: str, info: dict[str, Any]) -> None:
    """The ``gc.callbacks`` entry of :func:`freeze_survivors`: freeze what a full
    collection left."""
    if phase == "stop" and info.get("generation") == 2:
        gc.freeze()


def _walk_everything() -> int:
    """Unfreeze and collect everything (the callback freezes what is left); returns the
    objects collected."""
    gc.unfreeze()
    return gc.collect()


class _Rewalks:
    """When to walk everything again (module docstring): one :meth:`step` at a time, on
    the clocks it is given, so that tests can drive it. ``clock``: wall seconds;
    ``cpu_clock``: the process's CPU seconds (all threads)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
        walk: Callable[[], int] = _walk_everything,
    ) -> None:
        self.clock, self.cpu_clock, self.walk = clock, cpu_clock, walk
        self.walked_at = clock()  #: when everything was last walked
        self.window: tuple[float, float] | None = None  #: (wall, CPU) at a window's start
        self.in_lulls = 0  #: walks of everything in a lull
        self.overdue = 0  #: walks of everything that could not wait for one

    def step(self) -> float:
        """Walk everything if it is due and the window since the last step was quiet
        (or it is overdue); returns the seconds to wait before the next step."""
        now = self.clock()
        due = self.walked_at + REWALK_S
        if now < due:
            self.window = None
            return due - now
        cpu = self.cpu_clock()
        window, self.window = self.window, (now, cpu)
        quiet = window is not None and cpu - window[1] <= QUIET_SHARE * (now - window[0])
        overdue = now - self.walked_at >= OVERDUE_S
        if not (quiet or overdue):
            return LULL_S
        collected = self.walk()
        self.walked_at, self.window = self.clock(), None
        if quiet:
            self.in_lulls += 1
        else:
            self.overdue += 1
        _log.info(
            "walked everything the collector had frozen in %.0f ms (%s): %d objects collected",
            (self.walked_at - now) * 1000,
            "in a lull" if quiet else "overdue: no lull came",
            collected,
        )
        return REWALK_S


def _rewalk_until(rewalks: _Rewalks, stopped: threading.Event) -> None:
    """The rewalk thread's loop."""
    while not stopped.wait(rewalks.step()):
        pass


def freeze_survivors() -> Callable[[], None]:
    """Freeze what each full collection leaves, and walk everything again in lulls
    (module docstring), until the returned function is called, which stops that and
    unfreezes everything. For a process's main loop (``dracap up``, a service
    command), not for a library."""
    gc.callbacks.append(_freeze_after_full)
    gc.collect()  # the first walk of everything, while there is little: then frozen
    stopped = threading.Event()
    thread = threading.Thread(
        target=_rewalk_until, args=(_Rewalks(), stopped), name="dracap-gc-rewalk", daemon=True
    )
    thread.start()

    def undo() -> None:
        stopped.set()
        thread.join()
        if _freeze_after_full in gc.callbacks:
            gc.callbacks.remove(_freeze_after_full)
        gc.unfreeze()

    return undo


def freeze_at_exit() -> None:
    """Freeze everything as the interpreter exits, before its last collection, which
    then walks nothing (module docstring). For a process's entry point only."""
    atexit.register(gc.freeze)


@contextlib.contextmanager
def long_lived_state() -> Iterator[None]:
    """:func:`tune_for_long_lived_state` and :func:`freeze_survivors` while inside;
    the previous thresholds back, and nothing frozen, on the way out."""
    previous = tune_for_long_lived_state()
    thaw = freeze_survivors()
    try:
        yield
    finally:
        thaw()
        gc.set_threshold(*previous)
