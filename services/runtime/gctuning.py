"""Garbage-collector settings for processes that hold the fold in memory.

A service process keeps :class:`events.fold.ClusterState` — every claim, share and
device of the log — as long-lived Python objects, and creates many short-lived ones
per message (envelopes, events, futures). With CPython's default thresholds (a young
collection every 700 net allocations, the oldest generation every ~100 young ones),
the collector runs hundreds of times per second under load, and each full collection
walks the whole fold: pauses that grow with the cluster and land on whichever request
is in flight. Measured with ``benchmarks/pipeline.py`` (3,000 claims, 2-core machine):
throughput ~300 -> ~320-336 claims/s and p99 at half that rate ~370-420 -> ~250-310 ms.

:func:`tune_for_long_lived_state` raises the young-generation threshold (fewer, larger
young collections: short-lived objects are mostly gone by then) and keeps full
collections rare. Reference cycles are still collected; only less often.
"""

from __future__ import annotations

import gc
from typing import Final

__all__ = ["THRESHOLDS", "tune_for_long_lived_state"]

#: (young, middle, old) generation thresholds.
THRESHOLDS: Final = (50_000, 20, 100)


def tune_for_long_lived_state() -> tuple[int, int, int]:
    """Apply :data:`THRESHOLDS`; returns the previous thresholds."""
    previous = gc.get_threshold()
    gc.set_threshold(*THRESHOLDS)
    return previous
