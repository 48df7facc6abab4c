"""The machine's pace: how long a fixed piece of dracap's own work takes right now.

A growth run (``benchmarks/pipeline.py --live 0,100000``) compares phases minutes
apart, and on a shared machine the same code does not run at the same speed from one
minute to the next. Measured on a 2-core machine at idle (nothing of dracap running),
a fold of the same 20,000 events, the best of three, took 59-67 ms in most samples a
second apart and 92-110 ms in about one of six; and in growth runs the benchmark's own
process, whose work per claim is the same in every phase, spent from 31 % less to 39 %
more CPU per claim in the phase at 100,000 live than in the one at 0. A figure that
moved as much as the pace moved with the machine, not with the claims live.

:class:`Pace` builds the workload once (:func:`benchmarks.fold.build`: reservations and
releases on one slice) and :meth:`Pace.measure` times it: the median of ``samples``
samples, each the best of three folds of the whole workload in this process's CPU
time, in milliseconds. It blocks the caller's event loop for that long (about a
second), so the benchmark takes it between runs, with ``dracap up`` quiet.
"""

from __future__ import annotations

import statistics
import time
from typing import Final

from benchmarks.fold import build
from events.fold import fold

__all__ = ["EVENTS", "Pace"]

#: Events folded per timing: ~60 ms on the machine measured above.
EVENTS: Final = 20_000
ROUNDS: Final = 3


class Pace:
    """A fixed fold to time (see the module docstring)."""

    def __init__(self, events: int = EVENTS) -> None:
        if events < 1:
            raise ValueError(f"events: {events} is not a positive count")
        head, envelopes = build(events)
        self._workload = [head, *envelopes]

    def sample(self) -> float:
        """The best of :data:`ROUNDS` folds of the workload, in ms of this process's CPU."""
        best = float("inf")
        for _ in range(ROUNDS):
            start = time.process_time()
            fold(self._workload)
            best = min(best, time.process_time() - start)
        return best * 1000

    def measure(self, samples: int = 5) -> float:
        """The median of ``samples`` samples (ms)."""
        if samples < 1:
            raise ValueError(f"samples: {samples} is not a positive count")
        return statistics.median(self.sample() for _ in range(samples))
